"""Exports to Megatron-LM, DeepSpeed and torchtitan: every Megatron-LM launch script obeys the
flag and validate_args table read from Megatron-LM's code (autoplan/data/engines/megatron-lm.json),
each framework's own arithmetic holds (world size, batches, layer split), and plans an engine
cannot express are refused with the field that blocks them and the nearest plan it can run.
Loading the exports with the engines' own code is in tests/test_engines.py."""
from __future__ import annotations

import json
import re
import tomllib
from functools import cache

import pytest

import autoplan
from autoplan.cli import main as cli_main
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.export import TORCHTITAN_SCHEDULES, export, megatron_layout, toml_dumps
from autoplan.megatron_rules import broken_rules, parse_args, parse_script, table
from autoplan.models.config import TransformerConfig
from autoplan.plan import DeviceGroup, Plan


# ---------------------------------------------------------------------------------------------
@cache
def model(name: str, layers: int | None = None):
    return autoplan.models.get(name, **({"layers": layers} if layers else {}))


CLUSTER = Cluster.homogeneous("A100", 2, 8)
V100_T4 = Cluster.load("examples/clusters/mixed-v100-t4.json")


def uniform(name="llama-tiny", layers=8, **kw) -> Plan:
    for key, default in (("tp", 1), ("pp", 1), ("dp", 1), ("micro_batch", 1), ("global_batch", 16)):
        kw.setdefault(key, default)
    return Plan.uniform(model(name, layers), CLUSTER, **kw)


def split(plan: Plan, blocks: list[int]) -> Plan:
    """The plan with these transformer blocks per stage (embedding first, head last)."""
    bounds, start = [], 0
    for i, b in enumerate(blocks):
        end = start + b + (1 if i == 0 else 0) + (1 if i == len(blocks) - 1 else 0)
        bounds.append((start, end))
        start = end
    return plan.with_split(bounds)


def blocks_of(plan: Plan) -> list[int]:
    n = len(plan.stages)
    return [s.num_layers - (s.start == 0) - (i == n - 1) for i, s in enumerate(plan.stages)]


def megatron(plan: Plan, spec=None, **kw):
    """(args, env) of the Megatron-LM export, parsed by the table's argparse."""
    argv, env = parse_script(export(plan, "megatron", spec, **kw).text)
    return parse_args(argv), env, argv


def megatron_stage_layers(args, num_layers: int) -> list[int]:
    """Blocks per pipeline stage (all virtual stages, model order) the way Megatron-LM assigns
    them from its flags."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout:
        text = args.pipeline_model_parallel_layout
        text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
        return [stage.count("t") for stage in text.split("|")]
    if args.num_layers_per_virtual_pipeline_stage:
        per = args.num_layers_per_virtual_pipeline_stage
        return [per] * (num_layers // per)
    return [num_layers // pp] * pp


# ---------------------------------------------------------------------------------------------
MEGATRON_CASES = {
    "tp2-pp2-dp2-1f1b": dict(plan=lambda: uniform(tp=2, pp=2, dp=2, micro_batch=2, global_batch=32),
                             expect={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                     "micro_batch_size": 2, "global_batch_size": 32, "bf16": True},
                             env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    "interleaved-selective-sp-zero1": dict(
        plan=lambda: uniform(tp=4, pp=2, dp=2, global_batch=16, schedule="interleaved-1f1b", virtual_stages=2,
                             recompute="selective", sequence_parallel=True, zero=1),
        expect={"num_layers_per_virtual_pipeline_stage": 2, "sequence_parallel": True,
                "recompute_granularity": "selective", "use_distributed_optimizer": True,
                "pipeline_model_parallel_layout": None},
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    "uneven-split-as-layout": dict(
        plan=lambda: split(uniform(pp=4, dp=2), [2, 1, 3, 2]),
        expect={"pipeline_model_parallel_layout": "Et*2|t|t*3|t*2L", "decoder_first_pipeline_num_layers": None},
        env={}),
    "uneven-interleaved-as-layout": dict(
        plan=lambda: split(uniform(pp=2, schedule="interleaved-1f1b", virtual_stages=2), [1, 2, 2, 3]),
        expect={"pipeline_model_parallel_layout": "Et|t*2|t*2|t*3L",
                "num_layers_per_virtual_pipeline_stage": None}, env={}),
    "head-alone-in-last-stage": dict(plan=lambda: uniform(pp=2).with_split([(0, 9), (9, 10)]),
                                     expect={"pipeline_model_parallel_layout": "Et*8|L"}, env={}),
    "full-recompute-fp16": dict(plan=lambda: uniform(tp=2, pp=2, dp=1, recompute="full", dtype="fp16"),
                                expect={"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1, "fp16": True, "bf16": False},
                                env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    "zero3-is-fsdp2": dict(plan=lambda: uniform(dp=8, tp=1, pp=1, micro_batch=2, global_batch=32, zero=3),
                           expect={"use_torch_fsdp2": True, "gradient_accumulation_fusion": False,
                                   "use_distributed_optimizer": False},
                           env={"CUDA_DEVICE_MAX_CONNECTIONS": None}),
    "zero3-with-tensor-parallel": dict(plan=lambda: uniform(dp=4, tp=2, global_batch=32, zero=3),
                                       expect={"use_torch_fsdp2": True}, env={"CUDA_DEVICE_MAX_CONNECTIONS": None}),
}


@pytest.mark.parametrize("case", MEGATRON_CASES.values(), ids=list(MEGATRON_CASES))
def test_megatron_scripts_obey_the_validate_args_table(case):
    plan = case["plan"]()
    spec = model("llama-tiny", 8)
    args, env, argv = megatron(plan, spec)
    for key, value in case["expect"].items():
        assert getattr(args, key) == value, key
    assert env == case["env"]
    # Every rule of the table holds, on GPUs before Blackwell (where the most rules apply).
    assert broken_rules(argv, env, world_size=plan.num_gpus, arch=9) == []
    # Megatron-LM's own arithmetic: dp from the world size, micro-batches, the layer split.
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = plan.num_gpus // (tp * pp)
    assert dp == plan.dp
    assert args.global_batch_size // (args.micro_batch_size * dp) == plan.num_micro_batches
    assert args.num_layers == spec.config.layers
    assert megatron_stage_layers(args, args.num_layers) == blocks_of(plan)


BROKEN = {
    # What the issue measured against Megatron-LM: each must break the named rule.
    "fsdp2-without-no-grad-fusion": (["--micro-batch-size", "1", "--use-torch-fsdp2",
                                      "--untie-embeddings-and-output-weights"], {}, 8,
                                     "fsdp2-no-grad-accumulation-fusion"),
    "tensor-parallel-without-env": (["--micro-batch-size", "1", "--tensor-model-parallel-size", "2"], {}, 8,
                                    "tensor-parallel-connections"),
    "fsdp2-with-connections-1": (["--micro-batch-size", "1", "--use-torch-fsdp2", "--no-gradient-accumulation-fusion",
                                  "--untie-embeddings-and-output-weights"], {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, 8,
                                 "fsdp2-connections"),
    "layout-missing-loss": (["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                             "--pipeline-model-parallel-layout", "Et*2|t*2", "--num-layers", "4", "--hidden-size", "8",
                             "--num-attention-heads", "2", "--max-position-embeddings", "8"], {}, 2, "layout-ends"),
    "layout-wrong-layer-count": (["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
                                  "--pipeline-model-parallel-layout", "Et|tL", "--num-layers", "4", "--hidden-size", "8",
                                  "--num-attention-heads", "2", "--max-position-embeddings", "8"], {}, 2,
                                 "layout-layers"),
    "uneven-without-layout": (["--micro-batch-size", "1", "--pipeline-model-parallel-size", "3", "--num-layers", "8",
                               "--hidden-size", "8", "--num-attention-heads", "2", "--max-position-embeddings", "8"],
                              {}, 3, "even-split"),
    "batch-not-divisible": (["--micro-batch-size", "3", "--global-batch-size", "16"], {}, 2, "global-batch"),
    "world-not-divisible": (["--micro-batch-size", "1", "--tensor-model-parallel-size", "4"],
                            {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, 6, "world-size"),
}


@pytest.mark.parametrize("argv,env,world,rule", BROKEN.values(), ids=list(BROKEN))
def test_rule_table_catches_what_megatron_refuses(argv, env, world, rule):
    assert rule in [b.rule for b in broken_rules(argv, env, world_size=world)]


def test_rule_table_is_from_one_commit_and_names_its_sources():
    t = table()
    assert re.fullmatch(r"[0-9a-f]{40}", t["commit"])
    from autoplan.engines import MEGATRON_COMMIT
    assert t["commit"] == MEGATRON_COMMIT
    assert all(r["source"].startswith("megatron/") for r in t["rules"])
    assert len({r["id"] for r in t["rules"]}) == len(t["rules"])


@pytest.mark.parametrize("flag,value", [("--no-such-flag", None), ("--recompute-granularity", "partial"),
                                        ("--rotary-base", "1e4")], ids=["unknown", "bad-choice", "bad-type"])
def test_flags_megatron_lacks_or_rejects_are_caught(flag, value):
    with pytest.raises(ConfigError):
        parse_args([flag] + ([value] if value else []))


QWEN_LIKE = TransformerConfig(name="qwen-like", arch="llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=256,
                              seq_len=32, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6)
MODEL_FLAG_CASES = {
    "llama3-8b-rope-scaling": (lambda: model("llama3-8b"), dict(
        group_query_attention=True, num_query_groups=8, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=8.0,
        layernorm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=False, vocab_size=128256,
        untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0)),
    "gpt-tied-layernorm": (lambda: model("gpt-tiny", 8), dict(
        group_query_attention=False, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
        attention_dropout=0.0, hidden_dropout=0.0)),
    "mixtral-experts": (lambda: model("mixtral-8x7b"), dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
                                                          rotary_base=1000000, use_rope_scaling=False,
                                                          moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                                                          moe_router_load_balancing_type=["aux_loss"],
                                                          moe_aux_loss_coeff=[0.02], multi_latent_attention=False,
                                                          moe_shared_expert_intermediate_size=None,
                                                          expert_model_parallel_size=1)),
    "deepseek-shared-dense-first-latent": (lambda: model("deepseek-tiny", 8), dict(
        num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_layer_freq="([0]*1+[1]*7)",
        multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=16, moe_router_pre_softmax=False)),
    "qkv-bias-only": (lambda: autoplan.models.get(QWEN_LIKE), dict(add_bias_linear=False, add_qkv_bias=True,
                                                                    rotary_base=1000000, layernorm_epsilon=1e-6)),
}


@pytest.mark.parametrize("make,expect", MODEL_FLAG_CASES.values(), ids=list(MODEL_FLAG_CASES))
def test_megatron_carries_the_model_facts(make, expect):
    spec = make()
    plan = Plan.uniform(spec, CLUSTER, tp=2, pp=2, dp=1, micro_batch=1, global_batch=8)
    args, env, argv = megatron(plan, spec)
    cfg = spec.config
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size, args.seq_length) == \
        (cfg.layers, cfg.hidden, cfg.heads, cfg.ffn_hidden, spec.seq_len)
    for key, value in expect.items():
        assert getattr(args, key) == value, key
    assert broken_rules(argv, env, world_size=plan.num_gpus) == []


def test_megatron_without_model_writes_only_parallel_flags():
    args, _, _ = megatron(uniform(tp=2, pp=2, dp=2))
    assert args.num_layers is None and args.tensor_model_parallel_size == 2


def test_megatron_layout_string():
    units = [["embedding", "block:0"], ["block:1", "block:2"], ["head"]]
    assert megatron_layout(units) == "Et|t*2|L"


# ---------------------------------------------------------------------------------------------
def _hetero_tp() -> Plan:
    p = uniform(tp=2, pp=2, dp=2)
    groups = (p.groups[0], DeviceGroup(ranks=p.groups[1].ranks + (8, 9, 10, 11), tp=4))
    return Plan(groups=groups, stages=p.stages, micro_batch=1, num_micro_batches=8, model=p.model,
                seq_len=p.seq_len)


def _mixed_recompute() -> Plan:
    p = uniform(pp=2)
    return Plan(groups=p.groups, stages=(p.stages[0], p.stages[1].__class__(
        p.stages[1].start, p.stages[1].end, 1, "full")), micro_batch=1, num_micro_batches=16,
        model=p.model, seq_len=p.seq_len)


REFUSALS = {
    "megatron-heterogeneous-tp": ("megatron", _hetero_tp, "groups[].tp", "tp=2 on every stage"),
    "megatron-zero-bubble": ("megatron", lambda: uniform(pp=2, schedule="zero-bubble"), "schedule", "interleaved-1f1b"),
    "megatron-gpipe": ("megatron", lambda: uniform(pp=2, schedule="gpipe"), "schedule", "schedule=1f1b"),
    "megatron-zero2": ("megatron", lambda: uniform(dp=4, zero=2), "zero", "zero=1"),
    "megatron-zero3-with-pipeline": ("megatron", lambda: uniform(pp=2, dp=2, zero=3), "zero", "zero=1"),
    "megatron-zero3-fp16": ("megatron", lambda: uniform(dp=2, zero=3, dtype="fp16"), "zero", "zero=1"),
    "megatron-zero3-tied-embeddings": ("megatron", lambda: uniform("gpt-tiny", dp=2, zero=3), "zero", "zero=1"),
    "megatron-interleaved-uneven-micro-batches": (
        "megatron", lambda: uniform(pp=2, global_batch=5, schedule="interleaved-1f1b", virtual_stages=2),
        "num_micro_batches", "4 micro-batches"),
    "megatron-mixed-recompute": ("megatron", _mixed_recompute, "stages[].recompute", "recompute=full"),
    "deepspeed-tensor-parallel": ("deepspeed", lambda: uniform(tp=2, dp=2), "groups[].tp", "tp=1"),
    "deepspeed-selective": ("deepspeed", lambda: uniform(dp=2, recompute="selective"), "stages[].recompute",
                            "recompute=full"),
    "deepspeed-zero3-with-pipeline": ("deepspeed", lambda: uniform(pp=2, dp=2, zero=3), "zero", "zero=1"),
    "deepspeed-interleaved": ("deepspeed", lambda: uniform(pp=2, schedule="interleaved-1f1b", virtual_stages=2),
                              "schedule", "schedule=1f1b"),
    "deepspeed-custom-split": ("deepspeed", lambda: split(uniform(pp=2), [3, 5]), "stages", "[0, 5, 10]"),
    "torchtitan-heterogeneous-tp": ("torchtitan", _hetero_tp, "groups[].tp", "tp=2"),
    "torchtitan-fp16": ("torchtitan", lambda: uniform(dp=2, dtype="fp16"), "dtype", "bf16"),
    "torchtitan-zero1": ("torchtitan", lambda: uniform(dp=2, zero=1), "zero", "zero=0"),
    "torchtitan-1f1b-too-few-micro-batches": ("torchtitan", lambda: uniform(pp=4, global_batch=2), "num_micro_batches",
                                              "4 micro-batches"),
    "torchtitan-mixed-recompute": ("torchtitan", _mixed_recompute, "stages[].recompute", "recompute=full"),
}


@pytest.mark.parametrize("target,make,field,nearest", REFUSALS.values(), ids=list(REFUSALS))
def test_inexpressible_plans_are_refused_with_the_nearest_plan(target, make, field, nearest):
    plan = make()
    with pytest.raises(ConfigError) as err:
        export(plan, target, model(plan.model or "llama-tiny", 8))
    assert err.value.field == field
    assert nearest in err.value.fix, err.value.fix
    assert "\n" not in str(err.value)


MODEL_REFUSALS = {
    "torchtitan-gpt": ("torchtitan", "gpt-tiny", None, "model"),
    "megatron-vision": ("megatron", "swin-tiny-test", None, "model"),
}


@pytest.mark.parametrize("target,name,layers,field", MODEL_REFUSALS.values(), ids=list(MODEL_REFUSALS))
def test_models_an_engine_does_not_build_are_refused(target, name, layers, field):
    spec = model(name, layers)
    plan = Plan.uniform(spec, CLUSTER, tp=1, pp=1, dp=4, micro_batch=1, global_batch=8)
    with pytest.raises(ConfigError) as err:
        export(plan, target, spec)
    assert err.value.field == field


def test_torchtitan_0_2_refuses_tensor_parallel_without_sequence_parallel():
    plan = uniform(tp=2, dp=2)
    with pytest.raises(ConfigError) as err:
        export(plan, "torchtitan", engine_version="0.2")
    assert err.value.field == "sequence_parallel"
    assert "enable_sequence_parallel=False" in export(plan, "torchtitan").text


def test_model_mismatch_is_refused():
    with pytest.raises(ConfigError) as err:
        export(uniform("llama-tiny"), "megatron", model("gpt-tiny", 8))
    assert err.value.field == "model"


def test_unknown_engine_version_is_refused():
    with pytest.raises(ConfigError) as err:
        export(uniform(dp=2), "torchtitan", engine_version="0.1")
    assert err.value.field == "engine_version"


# ---------------------------------------------------------------------------------------------
DEEPSPEED_CASES = {
    "zero3-dp8": dict(plan=lambda: uniform(dp=8, micro_batch=2, global_batch=64, zero=3), cluster=None,
                      expect={"stage": 3, "ckpt": False, "dtype": "bf16"}),
    "zero1-full-recompute": dict(plan=lambda: uniform(dp=4, global_batch=16, zero=1, recompute="full"), cluster=None,
                                 expect={"stage": 1, "ckpt": True, "dtype": "bf16"}),
    "pipeline-zero1": dict(plan=lambda: uniform(pp=2, dp=4, global_batch=32, zero=1), cluster=None,
                           expect={"stage": 1, "ckpt": False, "stages": 2, "dtype": "bf16"}),
    "zero2-fp32": dict(plan=lambda: uniform(dp=4, global_batch=16, zero=2, dtype="fp32"), cluster=None,
                       expect={"stage": 2, "ckpt": False, "dtype": "fp32"}),
    "v100-gets-fp16": dict(plan=lambda: Plan.uniform(model("llama-tiny", 8), V100_T4, tp=1, pp=1, dp=8, micro_batch=1,
                                                     global_batch=16, zero=1), cluster=V100_T4,
                           expect={"stage": 1, "ckpt": False, "dtype": "fp16"}),
}


@pytest.mark.parametrize("case", DEEPSPEED_CASES.values(), ids=list(DEEPSPEED_CASES))
def test_deepspeed_config_batch_dtype_and_stages(case):
    plan = case["plan"]()
    cfg = json.loads(export(plan, "deepspeed", model("llama-tiny", 8), cluster=case["cluster"]).text)
    # DeepSpeed's batch rule: train_batch_size = micro batch * accumulation * data-parallel size.
    dp = plan.num_gpus // plan.pp
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    assert cfg["train_batch_size"] == plan.global_batch
    assert cfg["zero_optimization"]["stage"] == case["expect"]["stage"]
    assert ("activation_checkpointing" in cfg) == case["expect"]["ckpt"]
    dtype = case["expect"]["dtype"]
    assert [k for k in ("bf16", "fp16") if cfg.get(k, {}).get("enabled")] == ([] if dtype == "fp32" else [dtype])
    if dtype == "fp16":
        assert cfg["fp16"]["loss_scale"] == 0, "dynamic loss scaling"
    if "stages" in case["expect"]:
        pipe = cfg["autoplan_pipeline"]
        assert pipe["num_stages"] == case["expect"]["stages"]
        assert pipe["stage_boundaries"] == [0] + [s.end for s in plan.stages]


# ---------------------------------------------------------------------------------------------
TORCHTITAN_CASES = {
    "fsdp-tp-pp-1f1b": dict(plan=lambda: uniform(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, zero=3,
                                                 sequence_parallel=True),
                            expect={"data_parallel_shard_degree": 2, "data_parallel_replicate_degree": 1,
                                    "fsdp_reshard_after_forward": "always", "pipeline_parallel_schedule": "1F1B"}),
    "fsdp-pipelined-zero1": dict(plan=lambda: uniform(tp=1, pp=2, dp=4, micro_batch=1, global_batch=16, zero=1),
                                 expect={"data_parallel_shard_degree": 4, "fsdp_reshard_after_forward": "never"}),
    "ddp-interleaved": dict(plan=lambda: uniform(pp=2, dp=4, global_batch=32, schedule="interleaved-1f1b",
                                                 virtual_stages=2),
                            expect={"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1,
                                    "pipeline_parallel_schedule": "Interleaved1F1B"}),
    "zero-bubble-uneven": dict(plan=lambda: split(uniform(pp=4, dp=2, schedule="zero-bubble", zero=3), [1, 3, 2, 2]),
                               expect={"pipeline_parallel_schedule": "InterleavedZeroBubble"}),
    "gpipe-selective": dict(plan=lambda: uniform(pp=2, dp=1, schedule="gpipe", recompute="selective"),
                            expect={"pipeline_parallel_schedule": "GPipe"}),
    "no-pipeline-accumulation": dict(plan=lambda: uniform(dp=8, micro_batch=2, global_batch=64),
                                     expect={"pipeline_parallel_degree": 1}),
}


@pytest.mark.parametrize("case", TORCHTITAN_CASES.values(), ids=list(TORCHTITAN_CASES))
def test_torchtitan_0_2_toml_arithmetic(case):
    plan = case["plan"]()
    cfg = tomllib.loads(export(plan, "torchtitan", model("llama-tiny", 8), engine_version="0.2").text)
    par, tr = cfg["parallelism"], cfg["training"]
    for key, value in case["expect"].items():
        assert par[key] == value, key
    # torchtitan's arithmetic: the mesh covers the world, batches divide into micro-batches.
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert dp * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] == plan.num_gpus
    assert tr["global_batch_size"] == plan.global_batch
    assert tr["global_batch_size"] % (tr["local_batch_size"] * dp) == 0
    assert tr["seq_len"] == plan.seq_len
    assert cfg["activation_checkpoint"]["mode"] == plan.recompute
    if plan.pp > 1:
        mb = par["pipeline_parallel_microbatch_size"]
        assert tr["local_batch_size"] % mb == 0 and tr["local_batch_size"] // mb == plan.num_micro_batches
        parts = par["module_fqns_per_model_part"]
        assert len(parts) == len(plan.stages)
        assert [sum(m.startswith("layers.") for m in p) for p in parts] == blocks_of(plan)
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    else:
        assert tr["global_batch_size"] // (tr["local_batch_size"] * dp) == plan.num_micro_batches


def test_torchtitan_0_3_is_a_python_config_of_torchtitans_own_model():
    spec = model("llama3-8b")
    plan = Plan.uniform(spec, CLUSTER, tp=8, pp=1, dp=2, micro_batch=1, global_batch=8)
    out = export(plan, "torchtitan", spec)
    assert out.suffix == ".py"
    compile(out.text, "job.py", "exec")
    assert "from torchtitan.models.llama3.config_registry import llama3_8b" in out.text
    assert "def autoplan_plan():" in out.text


FLAVOR_CASES = {
    "llama3-8b-is-torchtitans-8B": ("llama3-8b", None, ("llama3", "8B")),
    "changed-shape-is-custom": ("llama3-8b", 8, ("llama3-8b", "custom")),
    "mixtral-is-custom": ("mixtral-8x7b", None, ("mixtral-8x7b", "custom")),
}


@pytest.mark.parametrize("name,layers,expect", FLAVOR_CASES.values(), ids=list(FLAVOR_CASES))
def test_torchtitan_model_flavor(name, layers, expect):
    spec = model(name, layers)
    plan = Plan.uniform(spec, CLUSTER, tp=8, pp=1, dp=2, micro_batch=1, global_batch=8, sequence_parallel=True)
    cfg = tomllib.loads(export(plan, "torchtitan", spec, engine_version="0.2").text)
    assert (cfg["model"]["name"], cfg["model"]["flavor"]) == expect
    py = export(plan, "torchtitan", spec)
    assert ("def autoplan_plan():" in py.text) == (expect[1] != "custom")
    assert "def apply_autoplan(config):" in py.text


def test_schedule_names_cover_every_autoplan_schedule():
    from autoplan.plan import SCHEDULES
    assert set(TORCHTITAN_SCHEDULES) == set(SCHEDULES)


TOML_VALUES = {
    "quotes-and-backslash": {"s": {"a": 'say "hi" \\ there', "b": "tab\there"}},
    "control-chars": {"s": {"a": "line1\nline2\x01"}},
    "types": {"t": {"i": 3, "f": 0.25, "yes": True, "no": False, "l": ["x", "y"], "n": [1, 2]}},
    "nested-lists": {"p": {"parts": [["a", "b"], ["c"]]}},
}


@pytest.mark.parametrize("data", TOML_VALUES.values(), ids=list(TOML_VALUES))
def test_toml_writer_round_trips(data):
    assert tomllib.loads(toml_dumps(data)) == data


def test_placement_other_than_rank_order_is_noted():
    p = uniform(tp=2, pp=2, dp=2)
    swapped = Plan(groups=(DeviceGroup(ranks=(4, 5, 6, 7), tp=2), DeviceGroup(ranks=(0, 1, 2, 3), tp=2)),
                   stages=p.stages, micro_batch=1, num_micro_batches=8, model=p.model, seq_len=p.seq_len)
    assert not any("order[i]" in n for n in export(p, "megatron").notes)
    notes = export(swapped, "megatron").notes
    assert any("0->4" in n for n in notes)


def test_comments_cannot_break_out_of_their_line():
    plan = uniform(tp=2, pp=2, dp=2)
    tricky = Plan(groups=plan.groups, stages=plan.stages, micro_batch=1, num_micro_batches=8,
                  model="x\nexport EVIL=1", seq_len=plan.seq_len)
    argv, env = parse_script(export(tricky, "megatron").text)
    assert "EVIL" not in env


# ---------------------------------------------------------------------------------------------
def test_cli_writes_file_and_reports_refusal(tmp_path, capsys):
    plan = uniform(tp=2, pp=2, dp=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = tmp_path / "job.toml"
    assert cli_main(["export", str(path), "--to", "torchtitan", "--engine-version", "0.2", "--out", str(out)]) == 2
    assert "sequence_parallel" in capsys.readouterr().err
    assert cli_main(["export", str(path), "--to", "megatron", "--out", str(tmp_path / "job.sh")]) == 0
    argv, env = parse_script((tmp_path / "job.sh").read_text())
    assert parse_args(argv).tensor_model_parallel_size == 2 and env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert cli_main(["export", str(path), "--to", "deepspeed"]) == 2
    assert "nearest" in capsys.readouterr().err


def test_cli_search_for_an_engine_then_export(tmp_path, capsys):
    plan_path, job = tmp_path / "plan.json", tmp_path / "job.sh"
    cluster = "examples/clusters/small-mixed-v100-t4.json"
    assert cli_main(["search", "--cluster", cluster, "--model", "llama-tiny", "--global-batch", "16", "--for",
                     "megatron", "--no-progress", "--out", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "stack megatron-core" in out and "Megatron-LM main" in out
    plan = Plan.load(plan_path)
    assert plan.dtype == "fp16"   # V100 and T4 have no bf16 units
    assert cli_main(["export", str(plan_path), "--to", "megatron", "--model", "llama-tiny", "--cluster", cluster,
                     "--out", str(job)]) == 0
    argv, env = parse_script(job.read_text())
    assert parse_args(argv).fp16 and broken_rules(argv, env, world_size=plan.num_gpus) == []
    assert cli_main(["search", "--cluster", cluster, "--model", "llama-tiny", "--global-batch", "16", "--for",
                     "deepspeed", "--tp", "2"]) == 2
    assert "tp: allows only [2], none of which DeepSpeed" in capsys.readouterr().err


# ------------------------------------------------------------------- mixture of experts
def moe_plan(name="moe-tiny", tp=1, dp=4, ep=2, zero=1, **kw) -> Plan:
    return Plan.uniform(model(name, 8), CLUSTER, tp=tp, pp=kw.pop("pp", 1), dp=dp, ep=ep, zero=zero,
                        micro_batch=1, global_batch=16, **kw)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_expert_parallel_flags(tp):
    plan = moe_plan(tp=tp, ep=2, sequence_parallel=tp > 1)
    args, env, argv = megatron(plan, model("moe-tiny", 8))
    assert args.expert_model_parallel_size == 2
    # Experts are tensor-parallel like the rest (Megatron's default, written out).
    assert args.expert_tensor_parallel_size == (tp if tp > 1 else None)
    assert broken_rules(argv, env, world_size=plan.num_gpus) == []
    dense, _, _ = megatron(uniform(tp=2, dp=2), model("llama-tiny", 8))
    assert dense.expert_model_parallel_size == 1


def test_megatron_capacity_factor_and_softmax_order():
    spec = autoplan.models.get("moe-tiny", layers=8, capacity_factor=1.25, normalize_top_k=False)
    plan = Plan.uniform(spec, CLUSTER, tp=1, pp=1, dp=2, ep=2, micro_batch=1, global_batch=16)
    args, _, _ = megatron(plan, spec)
    assert args.moe_expert_capacity_factor == 1.25 and args.moe_pad_expert_input_to_capacity
    assert args.moe_router_pre_softmax


def test_torchtitan_expert_parallel_degree():
    cfg = tomllib.loads(export(moe_plan(ep=4, zero=3), "torchtitan", model("moe-tiny", 8), engine_version="0.2").text)
    assert cfg["parallelism"]["expert_parallel_degree"] == 4
    assert cfg["parallelism"]["data_parallel_shard_degree"] == 4


def test_torchtitan_moe_presets_are_its_own_config_functions():
    spec = autoplan.models.get("qwen3-30b-a3b")
    plan = Plan.uniform(spec, CLUSTER, tp=1, pp=1, dp=16, ep=8, zero=3, micro_batch=1, global_batch=16)
    out = export(plan, "torchtitan", spec)
    compile(out.text, "job.py", "exec")
    assert "from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b" in out.text
    assert "expert_parallel_degree=8" in out.text


def test_deepspeed_moe_settings():
    cfg = json.loads(export(moe_plan(ep=2), "deepspeed", model("moe-tiny", 8)).text)
    assert cfg["autoplan_moe"] == {"num_experts": 4, "ep_size": 2, "k": 2, "capacity_factor": 1.0,
                                   "drop_tokens": False}
    assert "deepspeed.moe.layer.MoE" in cfg["comment"]


MOE_REFUSALS = {
    "megatron-fsdp2-with-ep": ("megatron", lambda: moe_plan(ep=2, zero=3), "moe-tiny", "zero"),
    "megatron-ep-tp-without-sp": ("megatron", lambda: moe_plan(tp=2, ep=2), "moe-tiny", "sequence_parallel"),
    "torchtitan-ep-with-tp": ("torchtitan", lambda: moe_plan(tp=2, ep=2, zero=3, sequence_parallel=True),
                              "moe-tiny", "ep"),
    "torchtitan-ep-replicated": ("torchtitan", lambda: moe_plan(ep=2, zero=0), "moe-tiny", "zero"),
    "deepspeed-moe-zero3": ("deepspeed", lambda: moe_plan(ep=2, zero=3), "moe-tiny", "zero"),
    "deepspeed-shared-experts": ("deepspeed", lambda: moe_plan("deepseek-tiny", ep=2), "deepseek-tiny", "model"),
}


@pytest.mark.parametrize("target,make,name,field", MOE_REFUSALS.values(), ids=list(MOE_REFUSALS))
def test_inexpressible_moe_plans_are_refused(target, make, name, field):
    with pytest.raises(ConfigError) as err:
        export(make(), target, model(name, 8))
    assert err.value.field == field and ("nearest" in err.value.fix or "export --to" in err.value.fix)
