"""Exported Megatron-LM / DeepSpeed / torchtitan configs are checked against the flag
names and schema keys those projects document, and against the rules each framework
applies to them (world size, batch arithmetic, layer split); plans a target cannot
express are refused with the field that blocks them."""
from __future__ import annotations

import argparse
import json
import shlex
import tomllib
from functools import cache

import pytest

import autoplan
from autoplan.cli import main as cli_main
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.export import TORCHTITAN_SCHEDULES, export, toml_dumps
from autoplan.plan import DeviceGroup, Plan

# ---------------------------------------------------------------------------------------------
# Reference: what the projects document. Only names listed here may appear in an export.

# Megatron-LM, megatron/training/arguments.py (_add_distributed_args, _add_training_args,
# _add_network_size_args, _add_mixed_precision_args, _add_moe_args): flag -> argparse settings.
MEGATRON_FLAGS: dict[str, dict] = {
    "--tensor-model-parallel-size": dict(type=int),
    "--pipeline-model-parallel-size": dict(type=int),
    "--num-layers-per-virtual-pipeline-stage": dict(type=int),
    "--decoder-first-pipeline-num-layers": dict(type=int),
    "--decoder-last-pipeline-num-layers": dict(type=int),
    "--sequence-parallel": dict(action="store_true"),
    "--micro-batch-size": dict(type=int),
    "--global-batch-size": dict(type=int),
    "--recompute-granularity": dict(choices=["full", "selective"]),
    "--recompute-method": dict(choices=["uniform", "block"]),
    "--recompute-num-layers": dict(type=int),
    "--use-distributed-optimizer": dict(action="store_true"),
    "--use-torch-fsdp2": dict(action="store_true"),
    "--bf16": dict(action="store_true"),
    "--fp16": dict(action="store_true"),
    "--num-layers": dict(type=int),
    "--hidden-size": dict(type=int),
    "--ffn-hidden-size": dict(type=int),
    "--num-attention-heads": dict(type=int),
    "--kv-channels": dict(type=int),
    "--group-query-attention": dict(action="store_true"),
    "--num-query-groups": dict(type=int),
    "--seq-length": dict(type=int),
    "--max-position-embeddings": dict(type=int),
    "--normalization": dict(choices=["LayerNorm", "RMSNorm"]),
    "--swiglu": dict(action="store_true"),
    "--position-embedding-type": dict(choices=["learned_absolute", "rope", "relative", "none"]),
    "--disable-bias-linear": dict(action="store_true"),
    "--untie-embeddings-and-output-weights": dict(action="store_true"),
    "--num-experts": dict(type=int),
    "--moe-router-topk": dict(type=int),
}

# DeepSpeed config JSON documentation ("DeepSpeed Configuration JSON"): top-level keys and
# the keys of the sections the export writes.
DEEPSPEED_TOP = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "fp16", "bf16", "amp", "zero_optimization", "activation_checkpointing", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "sparse_gradients",
    "steps_per_print", "wall_clock_breakdown", "dump_state", "flops_profiler", "tensorboard", "comms_logger",
    "aio", "autotuning", "elasticity", "data_efficiency", "checkpoint", "zero_allow_untested_optimizer",
}
DEEPSPEED_SECTIONS = {
    "zero_optimization": {
        "stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
        "reduce_bucket_size", "contiguous_gradients", "offload_param", "offload_optimizer",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "sub_group_size", "elastic_checkpoint",
        "stage3_gather_16bit_weights_on_model_save", "ignore_unused_parameters", "round_robin_gradients",
        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"},
    "activation_checkpointing": {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                 "number_checkpoints", "synchronize_checkpoint_boundary", "profile"},
    "bf16": {"enabled"},
    "fp16": {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"},
}
# Not DeepSpeed settings: annotations the export adds (DeepSpeed reads only the keys it knows).
DEEPSPEED_ANNOTATIONS = {"comment", "autoplan_pipeline"}

# torchtitan, torchtitan/config/job_config.py: [section] -> documented fields.
TORCHTITAN_KEYS = {
    "job": {"config_file", "dump_folder", "description", "use_for_integration_test", "print_args"},
    "model": {"name", "flavor", "tokenizer_path", "converters", "print_after_conversion"},
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm",
                 "steps", "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile",
                 "gc_freq", "gc_debug", "seed", "deterministic"},
    "parallelism": {"data_parallel_replicate_degree", "enable_compiled_autograd", "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "pipeline_parallel_degree", "pipeline_parallel_split_points",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "context_parallel_degree", "context_parallel_rotate_method", "expert_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns"},
}
# torch.distributed.pipelining get_schedule_class names, which torchtitan's
# pipeline_parallel_schedule takes.
TORCH_SCHEDULE_NAMES = {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                        "ZBVZeroBubble", "DualPipeV"}
TORCHTITAN_LITERALS = {("parallelism", "fsdp_reshard_after_forward"): {"default", "always", "never"},
                       ("training", "mixed_precision_param"): {"bfloat16", "float32"},
                       ("activation_checkpoint", "mode"): {"selective", "full", "none"}}


# ---------------------------------------------------------------------------------------------
@cache
def model(name: str, layers: int | None = None):
    return autoplan.models.get(name, **({"layers": layers} if layers else {}))


CLUSTER = Cluster.homogeneous("A100", 2, 8)


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


def megatron_parse(text: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, kw in MEGATRON_FLAGS.items():
        parser.add_argument(flag, **kw)
    argv = shlex.split("\n".join(l for l in text.splitlines() if not l.startswith("#")))
    args, unknown = parser.parse_known_args(argv)
    assert not unknown, f"flags Megatron-LM does not document: {unknown}"
    return args


def megatron_stage_layers(args: argparse.Namespace, num_layers: int) -> list[int]:
    """Blocks per pipeline stage the way Megatron-LM assigns them from its flags."""
    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if args.num_layers_per_virtual_pipeline_stage:
        per = args.num_layers_per_virtual_pipeline_stage
        assert num_layers % (per * pp) == 0, "Megatron: num_layers must be a multiple of per-virtual-stage * pp"
        return [per] * (num_layers // per)
    rest, middle = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if middle == 0:
        assert rest == 0
        return [first, last]
    assert rest % middle == 0, "Megatron: the remaining layers must divide evenly over the middle stages"
    even = rest // middle
    out = [even] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


# ---------------------------------------------------------------------------------------------
MEGATRON_CASES = {
    "tp2-pp2-dp2-1f1b": dict(plan=lambda: uniform(tp=2, pp=2, dp=2, micro_batch=2, global_batch=32),
                             expect={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                     "micro_batch_size": 2, "global_batch_size": 32, "bf16": True}),
    "interleaved-selective-sp-zero1": dict(
        plan=lambda: uniform(tp=4, pp=2, dp=2, global_batch=16, schedule="interleaved-1f1b", virtual_stages=2,
                             recompute="selective", sequence_parallel=True, zero=1),
        expect={"num_layers_per_virtual_pipeline_stage": 2, "sequence_parallel": True,
                "recompute_granularity": "selective", "use_distributed_optimizer": True}),
    "uneven-first-and-last-stage": dict(
        plan=lambda: split(uniform(pp=4, dp=2), [1, 2, 2, 3]),
        expect={"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}),
    "two-stages-any-split": dict(plan=lambda: split(uniform(pp=2), [5, 3]),
                                 expect={"decoder_first_pipeline_num_layers": 5,
                                         "decoder_last_pipeline_num_layers": None}),
    "full-recompute-fp16": dict(plan=lambda: uniform(tp=2, pp=2, dp=1, recompute="full", dtype="fp16"),
                                expect={"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1, "fp16": True, "bf16": False}),
    "zero3-without-pipeline": dict(plan=lambda: uniform(dp=8, tp=1, pp=1, micro_batch=2, global_batch=32, zero=3),
                                   expect={"use_torch_fsdp2": True, "use_distributed_optimizer": False}),
}


@pytest.mark.parametrize("case", MEGATRON_CASES.values(), ids=list(MEGATRON_CASES))
def test_megatron_flags_are_documented_and_consistent(case):
    plan = case["plan"]()
    spec = model("llama-tiny", 8)
    args = megatron_parse(export(plan, "megatron", spec).text)
    for key, value in case["expect"].items():
        assert getattr(args, key) == value, key
    # Megatron-LM's own arithmetic: dp from the world size, batch divisibility, layer split.
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    assert plan.num_gpus % (tp * pp) == 0
    dp = plan.num_gpus // (tp * pp)
    assert dp == plan.dp
    assert args.global_batch_size % (args.micro_batch_size * dp) == 0
    assert args.global_batch_size // (args.micro_batch_size * dp) == plan.num_micro_batches
    assert args.num_layers == spec.config.layers
    assert megatron_stage_layers(args, args.num_layers) == blocks_of(plan)


MODEL_FLAG_CASES = {
    "llama-gqa-rope-swiglu": ("llama-tiny", {"group_query_attention": True, "num_query_groups": 2,
                                             "normalization": "RMSNorm", "swiglu": True,
                                             "position_embedding_type": "rope", "disable_bias_linear": True,
                                             "untie_embeddings_and_output_weights": True}),
    "gpt-tied-layernorm": ("gpt-tiny", {"group_query_attention": False, "normalization": None, "swiglu": False,
                                        "position_embedding_type": None,
                                        "untie_embeddings_and_output_weights": False}),
    "moe-experts": ("moe-tiny", {"num_experts": 4, "moe_router_topk": 2}),
}


@pytest.mark.parametrize("name,expect", MODEL_FLAG_CASES.values(), ids=list(MODEL_FLAG_CASES))
def test_megatron_model_shape_flags(name, expect):
    spec = model(name, 8)
    plan = uniform(name, tp=2, pp=2, dp=1)
    args = megatron_parse(export(plan, "megatron", spec).text)
    cfg = spec.config
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size, args.seq_length) == \
        (cfg.layers, cfg.hidden, cfg.heads, cfg.ffn_hidden, spec.seq_len)
    assert args.max_position_embeddings >= args.seq_length
    for key, value in expect.items():
        assert getattr(args, key) == value, key


def test_megatron_without_model_writes_only_parallel_flags():
    args = megatron_parse(export(uniform(tp=2, pp=2, dp=2), "megatron").text)
    assert args.num_layers is None and args.tensor_model_parallel_size == 2


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
    "megatron-heterogeneous-tp": ("megatron", _hetero_tp, "groups[].tp"),
    "megatron-uneven-middle": ("megatron", lambda: split(uniform(pp=4), [2, 1, 3, 2]), "stages"),
    "megatron-zero-bubble": ("megatron", lambda: uniform(pp=2, schedule="zero-bubble"), "schedule"),
    "megatron-gpipe": ("megatron", lambda: uniform(pp=2, schedule="gpipe"), "schedule"),
    "megatron-zero2": ("megatron", lambda: uniform(dp=4, zero=2), "zero"),
    "megatron-zero3-with-pipeline": ("megatron", lambda: uniform(pp=2, dp=2, zero=3), "zero"),
    "megatron-interleaved-uneven": ("megatron", lambda: split(uniform(pp=2, schedule="interleaved-1f1b",
                                                                      virtual_stages=2), [1, 2, 2, 3]), "stages"),
    "megatron-mixed-recompute": ("megatron", _mixed_recompute, "stages[].recompute"),
    "megatron-stage-without-block": ("megatron", lambda: uniform(pp=2).with_split([(0, 1), (1, 10)]), "stages[0]"),
    "deepspeed-tensor-parallel": ("deepspeed", lambda: uniform(tp=2, dp=2), "groups[].tp"),
    "deepspeed-selective": ("deepspeed", lambda: uniform(dp=2, recompute="selective"), "stages[].recompute"),
    "deepspeed-zero3-with-pipeline": ("deepspeed", lambda: uniform(pp=2, dp=2, zero=3), "zero"),
    "deepspeed-interleaved": ("deepspeed", lambda: uniform(pp=2, schedule="interleaved-1f1b", virtual_stages=2),
                              "schedule"),
    "torchtitan-heterogeneous-tp": ("torchtitan", _hetero_tp, "groups[].tp"),
    "torchtitan-fp16": ("torchtitan", lambda: uniform(dp=2, dtype="fp16"), "dtype"),
    "torchtitan-mixed-recompute": ("torchtitan", _mixed_recompute, "stages[].recompute"),
}


@pytest.mark.parametrize("target,make,field", REFUSALS.values(), ids=list(REFUSALS))
def test_inexpressible_plans_are_refused(target, make, field):
    with pytest.raises(ConfigError) as err:
        export(make(), target, model("llama-tiny", 8))
    assert err.value.field == field
    assert err.value.fix, "a refusal must say what to do instead"


def test_vision_model_is_refused_by_megatron_but_not_deepspeed():
    swin = autoplan.models.get("swin-tiny-test")
    plan = Plan.uniform(swin, CLUSTER, tp=1, pp=1, dp=4, micro_batch=2, global_batch=16)
    with pytest.raises(ConfigError) as err:
        export(plan, "megatron", swin)
    assert err.value.field == "model"
    assert json.loads(export(plan, "deepspeed", swin).text)["train_batch_size"] == 16


def test_model_mismatch_is_refused():
    with pytest.raises(ConfigError) as err:
        export(uniform("llama-tiny"), "megatron", model("gpt-tiny", 8))
    assert err.value.field == "model"


# ---------------------------------------------------------------------------------------------
DEEPSPEED_CASES = {
    "zero3-dp8": dict(plan=lambda: uniform(dp=8, micro_batch=2, global_batch=64, zero=3),
                      expect={"stage": 3, "ckpt": False}),
    "zero1-full-recompute": dict(plan=lambda: uniform(dp=4, global_batch=16, zero=1, recompute="full"),
                                 expect={"stage": 1, "ckpt": True}),
    "pipeline-zero1": dict(plan=lambda: uniform(pp=2, dp=4, global_batch=32, zero=1),
                           expect={"stage": 1, "ckpt": False, "stages": 2}),
    "zero2-fp32": dict(plan=lambda: uniform(dp=4, global_batch=16, zero=2, dtype="fp32"),
                       expect={"stage": 2, "ckpt": False}),
}


@pytest.mark.parametrize("case", DEEPSPEED_CASES.values(), ids=list(DEEPSPEED_CASES))
def test_deepspeed_config_uses_documented_keys(case):
    plan = case["plan"]()
    cfg = json.loads(export(plan, "deepspeed", model("llama-tiny", 8)).text)
    assert set(cfg) <= DEEPSPEED_TOP | DEEPSPEED_ANNOTATIONS, set(cfg) - DEEPSPEED_TOP - DEEPSPEED_ANNOTATIONS
    for section, keys in DEEPSPEED_SECTIONS.items():
        if section in cfg:
            assert set(cfg[section]) <= keys, (section, set(cfg[section]) - keys)
    # DeepSpeed's batch rule: train_batch_size = micro batch * accumulation * data-parallel size.
    dp = plan.num_gpus // plan.pp
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    assert cfg["train_batch_size"] == plan.global_batch
    assert cfg["zero_optimization"]["stage"] == case["expect"]["stage"]
    assert ("activation_checkpointing" in cfg) == case["expect"]["ckpt"]
    assert cfg.get(plan.dtype, {}).get("enabled", plan.dtype == "fp32") is True
    if "stages" in case["expect"]:
        pipe = cfg["autoplan_pipeline"]
        assert pipe["num_stages"] == case["expect"]["stages"]
        assert pipe["stage_boundaries"] == [0] + [s.end for s in plan.stages]


# ---------------------------------------------------------------------------------------------
TORCHTITAN_CASES = {
    "fsdp-tp-pp-1f1b": dict(plan=lambda: uniform(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, zero=3),
                            expect={"data_parallel_shard_degree": 2, "data_parallel_replicate_degree": 1,
                                    "fsdp_reshard_after_forward": "always", "pipeline_parallel_schedule": "1F1B"}),
    "ddp-interleaved": dict(plan=lambda: uniform(pp=2, dp=4, global_batch=32, schedule="interleaved-1f1b",
                                                 virtual_stages=2),
                            expect={"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1,
                                    "pipeline_parallel_schedule": "Interleaved1F1B"}),
    "zero-bubble-uneven": dict(plan=lambda: split(uniform(pp=4, dp=2, schedule="zero-bubble", zero=1), [1, 3, 2, 2]),
                               expect={"pipeline_parallel_schedule": "InterleavedZeroBubble",
                                       "fsdp_reshard_after_forward": "never"}),
    "gpipe-selective": dict(plan=lambda: uniform(pp=2, dp=1, schedule="gpipe", recompute="selective"),
                            expect={"pipeline_parallel_schedule": "GPipe"}),
    "no-pipeline-accumulation": dict(plan=lambda: uniform(dp=8, micro_batch=2, global_batch=64),
                                     expect={"pipeline_parallel_degree": 1}),
}


@pytest.mark.parametrize("case", TORCHTITAN_CASES.values(), ids=list(TORCHTITAN_CASES))
def test_torchtitan_toml_uses_documented_keys(case):
    plan = case["plan"]()
    cfg = tomllib.loads(export(plan, "torchtitan", model("llama-tiny", 8)).text)
    assert set(cfg) <= set(TORCHTITAN_KEYS)
    for section, table in cfg.items():
        assert set(table) <= TORCHTITAN_KEYS[section], (section, set(table) - TORCHTITAN_KEYS[section])
    for (section, key), allowed in TORCHTITAN_LITERALS.items():
        if key in cfg.get(section, {}):
            assert cfg[section][key] in allowed
    par, tr = cfg["parallelism"], cfg["training"]
    assert par["pipeline_parallel_schedule"] in TORCH_SCHEDULE_NAMES
    assert par["enable_async_tensor_parallel"] is False
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
        # Split points name the first block of every later stage: they rebuild the plan's split.
        points = [int(p.split(".")[1]) for p in par["pipeline_parallel_split_points"]]
        assert len(points) == len(plan.stages) - 1
        starts = [0] + points + [model("llama-tiny", 8).config.layers]
        assert [b - a for a, b in zip(starts, starts[1:])] == blocks_of(plan)
    else:
        assert tr["global_batch_size"] // (tr["local_batch_size"] * dp) == plan.num_micro_batches


FLAVOR_CASES = {
    "llama3-8b-is-a-flavor": ("llama3-8b", None, ("llama3", "8B")),
    "changed-shape-is-custom": ("llama3-8b", 8, ("llama3-8b", "custom")),
}


@pytest.mark.parametrize("name,layers,expect", FLAVOR_CASES.values(), ids=list(FLAVOR_CASES))
def test_torchtitan_model_flavor(name, layers, expect):
    spec = model(name, layers)
    plan = Plan.uniform(spec, CLUSTER, tp=8, pp=1, dp=2, micro_batch=1, global_batch=8)
    cfg = tomllib.loads(export(plan, "torchtitan", spec).text)
    assert (cfg["model"]["name"], cfg["model"]["flavor"]) == expect


def test_schedule_names_cover_every_autoplan_schedule():
    from autoplan.plan import SCHEDULES
    assert set(TORCHTITAN_SCHEDULES) == set(SCHEDULES)
    assert set(TORCHTITAN_SCHEDULES.values()) <= TORCH_SCHEDULE_NAMES


TOML_VALUES = {
    "quotes-and-backslash": {"s": {"a": 'say "hi" \\ there', "b": "tab\there"}},
    "control-chars": {"s": {"a": "line1\nline2\x01"}},
    "types": {"t": {"i": 3, "f": 0.25, "yes": True, "no": False, "l": ["x", "y"], "n": [1, 2]}},
}


@pytest.mark.parametrize("data", TOML_VALUES.values(), ids=list(TOML_VALUES))
def test_toml_writer_round_trips(data):
    assert tomllib.loads(toml_dumps(data)) == data


def test_placement_other_than_rank_order_is_noted():
    p = uniform(tp=2, pp=2, dp=2)
    swapped = Plan(groups=(DeviceGroup(ranks=(4, 5, 6, 7), tp=2), DeviceGroup(ranks=(0, 1, 2, 3), tp=2)),
                   stages=p.stages, micro_batch=1, num_micro_batches=8, model=p.model, seq_len=p.seq_len)
    assert not export(p, "megatron").notes
    notes = export(swapped, "megatron").notes
    assert any("0->4" in n for n in notes)


# ---------------------------------------------------------------------------------------------
def test_cli_writes_file_and_reports_refusal(tmp_path, capsys):
    plan = uniform(tp=2, pp=2, dp=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = tmp_path / "job.toml"
    assert cli_main(["export", str(path), "--to", "torchtitan", "--out", str(out)]) == 0
    assert tomllib.loads(out.read_text())["parallelism"]["tensor_parallel_degree"] == 2
    assert cli_main(["export", str(path), "--to", "deepspeed"]) == 2
    assert "tensor parallelism" in capsys.readouterr().err
