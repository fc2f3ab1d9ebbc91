"""Searched plans, exported, load in the engines' own code: DeepSpeed's ``DeepSpeedConfig``,
torchtitan 0.3's ``ConfigManager`` (and its ``ParallelDims`` and schedule lookup), and for
Megatron-LM the flag and validate_args table read from its code. Where an engine is not
installed (``pip install -e ".[engines]"``) its tests skip, saying so; torchtitan 0.2 and a
Megatron-LM checkout are optional (TORCHTITAN_0_2_PATH, MEGATRON_LM_PATH).

Every engine is imported once per module (their imports take seconds)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

import autoplan
from autoplan.engines import ENGINES, get_engine, partition_uniform, preset_name, violation
from autoplan.export import export
from autoplan.megatron_rules import broken_rules, parse_args, parse_script
from autoplan.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
SMALL_MIXED = autoplan.Cluster.load(ROOT / "examples/clusters/small-mixed-v100-t4.json")
DGX_A100 = autoplan.Cluster.load(ROOT / "examples/clusters/dgx-a100-1node.json")


@cache
def searched(model_name: str, cluster_file: str, global_batch: int, target: str) -> tuple:
    """(plan, model, cluster) of the best plan ``search --for target`` finds."""
    cluster = autoplan.Cluster.load(ROOT / cluster_file)
    model = autoplan.models.get(model_name)
    # A narrower search than the default keeps the suite quick; the plan is still the best of its space.
    result = autoplan.search(model, cluster, global_batch, target=target, progress=False, max_micro_batch=2,
                             max_estimates=4, placement_alternatives=1)
    assert result.target == target and result.stack == ENGINES[target].stack
    plan = result.best.plan
    return plan, autoplan.models.get(model_name, dtype=plan.dtype), cluster


ROUND_TRIPS = {
    # cluster file, model, global batch
    "llama-tiny-on-v100-t4": ("examples/clusters/small-mixed-v100-t4.json", "llama-tiny", 16),
    "llama3-8b-on-dgx-a100": ("examples/clusters/dgx-a100-1node.json", "llama3-8b", 32),
}


# --------------------------------------------------------------------------------- Megatron-LM
@pytest.mark.parametrize("cluster_file,name,gb", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_megatron_search_then_export_obeys_validate_args(cluster_file, name, gb):
    plan, model, cluster = searched(name, cluster_file, gb, "megatron")
    out = export(plan, "megatron", model, cluster=cluster)
    argv, env = parse_script(out.text)
    args = parse_args(argv)
    assert broken_rules(argv, env, world_size=plan.num_gpus, arch=9) == []
    assert args.fp16 == (not all("bf16" in g.device.peak_flops for g in cluster.groups))


def test_megatron_validate_args_itself():
    """With a Megatron-LM checkout (MEGATRON_LM_PATH), its own parse_args and validate_args
    (and the TransformerConfig they build) accept the exports."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path:
        pytest.skip("MEGATRON_LM_PATH is not set (Megatron-LM's trainer is not a package; the flag and "
                    "validate_args table is checked instead)")
    scripts = []
    for cluster_file, name, gb in ROUND_TRIPS.values():
        plan, model, cluster = searched(name, cluster_file, gb, "megatron")
        scripts.append((export(plan, "megatron", model, cluster=cluster).text, plan.num_gpus))
    for text, world in scripts:
        proc = subprocess.run([sys.executable, str(ROOT / "tests/engine_checks/megatron_validate.py"), str(world)],
                              input=text, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [path, os.environ.get("PYTHONPATH", "")])})
        assert proc.returncode == 0 and "ACCEPTED" in proc.stdout, proc.stderr[-2000:]


# ----------------------------------------------------------------------------------- DeepSpeed
@pytest.fixture(scope="module")
def deepspeed_config():
    config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed "
                                 "(pip install -e '.[engines]')")
    utils = importlib.import_module("deepspeed.runtime.utils")
    return config, utils


def load_deepspeed(module, plan: Plan, text: str, monkeypatch):
    """DeepSpeedConfig of the exported JSON, with the data-parallel size the plan's process
    groups give DeepSpeed's engine (through an mpu, as Megatron-DeepSpeed passes one)."""

    class DataParallel:
        def get_data_parallel_world_size(self):
            return plan.dp

    monkeypatch.setattr(module.dist, "get_rank", lambda *a, **k: 0)
    return module.DeepSpeedConfig(json.loads(text), mpu=DataParallel())


@pytest.mark.parametrize("cluster_file,name,gb", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_deepspeed_search_then_export_loads(deepspeed_config, monkeypatch, cluster_file, name, gb):
    module, _ = deepspeed_config
    plan, model, cluster = searched(name, cluster_file, gb, "deepspeed")
    cfg = load_deepspeed(module, plan, export(plan, "deepspeed", model, cluster=cluster).text, monkeypatch)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (plan.global_batch, plan.micro_batch, plan.num_micro_batches)
    assert cfg.zero_optimization_stage == plan.zero
    half = "bf16" if all("bf16" in g.device.peak_flops for g in cluster.groups) else "fp16"
    assert (cfg.bfloat16_config.enabled, cfg.float16_config.enabled) == (half == "bf16", half == "fp16")


DEEPSPEED_PLANS = {
    "zero2-full-recompute": dict(tp=1, pp=1, dp=8, micro_batch=2, global_batch=64, zero=2, recompute="full"),
    "pipeline-zero1": dict(tp=1, pp=2, dp=4, micro_batch=1, global_batch=32, zero=1),
    "fp32": dict(tp=1, pp=1, dp=4, micro_batch=1, global_batch=16, zero=0, dtype="fp32"),
}


@pytest.mark.parametrize("kw", DEEPSPEED_PLANS.values(), ids=list(DEEPSPEED_PLANS))
def test_deepspeed_configs_load(deepspeed_config, monkeypatch, kw):
    module, utils = deepspeed_config
    model = autoplan.models.get("llama-tiny", layers=6)
    plan = Plan.uniform(model, DGX_A100, **kw)
    if plan.pp > 1:
        parts = partition_uniform(model.num_layers, plan.pp)
        plan = plan.with_split(list(zip(parts, parts[1:])))
    cfg = load_deepspeed(module, plan, export(plan, "deepspeed", model).text, monkeypatch)
    assert cfg.train_batch_size == plan.global_batch and cfg.zero_optimization_stage == plan.zero


def test_pipeline_split_is_deepspeeds_uniform_partition(deepspeed_config):
    _, utils = deepspeed_config
    for items in range(1, 40):
        for parts in range(1, 9):
            assert partition_uniform(items, parts) == utils.partition_uniform(items, parts), (items, parts)


# ---------------------------------------------------------------------------------- torchtitan
@pytest.fixture(scope="module")
def torchtitan():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[engines]')")
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.distributed.parallel_dims import ParallelDims
        from torchtitan.models.llama3 import config_registry  # noqa: F401  (the slow import, once)
    except ImportError as e:   # e.g. triton, which torchtitan 0.3 imports at load time
        pytest.skip(f"torchtitan does not import here: {e}")
    from torch.distributed.pipelining.schedules import get_schedule_class
    return ConfigManager, ParallelDims, get_schedule_class


def load_torchtitan(tt, text: str, tmp_path, name: str):
    """The Trainer.Config torchtitan's own ConfigManager builds from the exported module (for
    a model torchtitan does not ship, the plan applied to its llama3 debug model's config)."""
    ConfigManager, _, _ = tt
    module = f"autoplan_job_{name.replace('-', '_').replace('.', '_')}"   # unique: modules are cached
    (tmp_path / f"{module}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        if "def autoplan_plan():" in text:
            return ConfigManager().parse_args(["--module", module, "--config", "autoplan_plan"])
        config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel"])
        config = importlib.import_module(module).apply_autoplan(config)
        config.__post_init__()   # Trainer.Config's own validation, on the settings applied
        return config
    finally:
        sys.path.remove(str(tmp_path))


def check_torchtitan(tt, config, plan: Plan) -> None:
    """torchtitan's own mesh validation, schedule lookup and batch arithmetic accept it."""
    _, ParallelDims, get_schedule_class = tt
    par, tr = config.parallelism, config.training
    dims = ParallelDims.from_config(par, plan.num_gpus)
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp) == (plan.dp, plan.tp, plan.pp)
    get_schedule_class(par.pipeline_parallel_schedule)
    assert tr.local_batch_size % par.pipeline_parallel_microbatch_size == 0
    if plan.pp > 1:
        assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == plan.num_micro_batches
        assert len(par.module_fqns_per_model_part) == len(plan.stages)
    assert tr.global_batch_size == plan.global_batch
    if plan.zero and plan.dp > 1:
        # torchtitan's own reading of the reshard policy: ZeRO-3 reshards after forward, the
        # pipelined ZeRO-1 keeps the gathered weights.
        from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
        assert get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward, plan.pp > 1) == (plan.zero == 3)


@pytest.mark.parametrize("cluster_file,name,gb", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_torchtitan_search_then_export_loads(torchtitan, tmp_path, cluster_file, name, gb):
    plan, model, cluster = searched(name, cluster_file, gb, "torchtitan")
    out = export(plan, "torchtitan", model, cluster=cluster)
    config = load_torchtitan(torchtitan, out.text, tmp_path, f"{name}_{cluster_file.split('/')[-1][:-5]}")
    check_torchtitan(torchtitan, config, plan)
    if preset_name(model, get_engine("torchtitan")) is not None:
        # torchtitan's own model is the plan's model: the facts the export does not restate agree.
        m, cfg = config.model_spec.model, model.config
        attn = m.layers[0].attention
        assert (m.dim, m.vocab_size, len(m.layers)) == (cfg.hidden, cfg.vocab, cfg.layers)
        assert (attn.n_heads, attn.n_kv_heads) == (cfg.heads, cfg.kv_heads)
        assert (attn.rope.theta, attn.rope.scaling_factor) == (cfg.rope_theta, cfg.rope_scaling_factor)
        assert m.layers[0].feed_forward.w1.out_features == cfg.ffn_hidden


TORCHTITAN_PLANS = {
    "interleaved-uneven-selective": (dict(tp=2, pp=2, dp=2, micro_batch=1, global_batch=8,
                                          schedule="interleaved-1f1b", virtual_stages=2, recompute="selective",
                                          sequence_parallel=True), [(0, 2), (2, 4), (4, 5), (5, 8)]),
    "zero-bubble-fsdp-full": (dict(tp=1, pp=4, dp=2, micro_batch=1, global_batch=16, schedule="zero-bubble",
                                   zero=3, recompute="full"), None),
    "pipelined-fsdp-zero1": (dict(tp=1, pp=2, dp=4, micro_batch=1, global_batch=16, zero=1), None),
    "replicate-gpipe-embedding-alone": (dict(tp=1, pp=2, dp=4, micro_batch=2, global_batch=16, schedule="gpipe"),
                                        [(0, 1), (1, 8)]),
}


@pytest.mark.parametrize("case", list(TORCHTITAN_PLANS))
def test_torchtitan_configs_load(torchtitan, tmp_path, case):
    kw, bounds = TORCHTITAN_PLANS[case]
    model = autoplan.models.get("llama-tiny", layers=6)
    plan = Plan.uniform(model, DGX_A100, **kw)
    if bounds:
        plan = plan.with_split(bounds)
    config = load_torchtitan(torchtitan, export(plan, "torchtitan", model).text, tmp_path, case)
    check_torchtitan(torchtitan, config, plan)
    assert config.parallelism.module_fqns_per_model_part[0][0] == "tok_embeddings"


MOE_PRESETS = ["qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3"]


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_torchtitan_expert_parallel_configs_load(torchtitan, tmp_path, name):
    """An expert-parallel plan of a mixture of experts torchtitan ships: its ConfigManager and
    ParallelDims accept the degrees, and its own model agrees with the zoo's on the experts."""
    model = autoplan.models.get(name)
    plan = Plan.uniform(model, DGX_A100, tp=1, pp=2, dp=4, ep=4, micro_batch=1, global_batch=16, zero=3)
    config = load_torchtitan(torchtitan, export(plan, "torchtitan", model).text, tmp_path, f"ep_{name}")
    check_torchtitan(torchtitan, config, plan)
    _, ParallelDims, _ = torchtitan
    assert ParallelDims.from_config(config.parallelism, plan.num_gpus).ep == plan.ep
    m, cfg = config.model_spec.model, model.config
    assert (m.dim, m.vocab_size, len(m.layers)) == (cfg.hidden, cfg.vocab, cfg.layers)
    assert [layer.moe is None for layer in m.layers] == [i < cfg.dense_layers for i in range(cfg.layers)]
    moe = m.layers[-1].moe
    assert (moe.num_experts, moe.routed_experts.token_dispatcher.top_k,
            moe.routed_experts.inner_experts.hidden_dim) == (cfg.num_experts, cfg.top_k, cfg.moe_ffn_hidden)
    shared = getattr(moe, "shared_experts", None)
    assert (shared.w1.out_features if shared is not None else 0) == cfg.shared_ffn_hidden
    if cfg.kv_lora_rank:
        attn = m.layers[0].attention
        assert (attn.kv_lora_rank, attn.q_lora_rank or 0) == (cfg.kv_lora_rank, cfg.q_lora_rank)


def test_torchtitan_0_2_toml_loads(tmp_path):
    """With torchtitan 0.2.x installed in a folder (pip install --target DIR torchtitan==0.2.2;
    TORCHTITAN_0_2_PATH=DIR), its ConfigManager reads every 0.2 export."""
    path = os.environ.get("TORCHTITAN_0_2_PATH")
    if not path:
        pytest.skip("TORCHTITAN_0_2_PATH is not set (torchtitan 0.2 cannot share an environment with 0.3)")
    files = []
    model = autoplan.models.get("llama-tiny", layers=6)
    for i, (kw, bounds) in enumerate(TORCHTITAN_PLANS.values()):
        plan = Plan.uniform(model, DGX_A100, **kw)
        if bounds:
            plan = plan.with_split(bounds)
        f = tmp_path / f"job{i}.toml"
        f.write_text(export(plan, "torchtitan", model, engine_version="0.2").text)
        files.append((str(f), plan.num_gpus, plan.tp, plan.pp, len(plan.stages)))
    proc = subprocess.run([sys.executable, str(ROOT / "tests/engine_checks/torchtitan02_load.py"), json.dumps(files)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0 and proc.stdout.count("ACCEPTED") == len(files), proc.stderr[-2000:]


# ------------------------------------------------------------------------- mixtures of experts
def test_megatron_expert_parallel_export_obeys_validate_args():
    model = autoplan.models.get("mixtral-8x7b")
    plan = Plan.uniform(model, DGX_A100, tp=2, pp=1, dp=4, ep=4, micro_batch=1, global_batch=16, zero=1,
                        sequence_parallel=True)
    argv, env = parse_script(export(plan, "megatron", model).text)
    args = parse_args(argv)
    assert broken_rules(argv, env, world_size=plan.num_gpus, arch=8) == []
    assert (args.expert_model_parallel_size, args.num_experts, args.moe_router_topk) == (4, 8, 2)


def test_deepspeed_expert_parallel_config_loads(deepspeed_config, monkeypatch):
    """DeepSpeed-MoE's expert parallelism lives in the model code (deepspeed.moe.layer.MoE's
    ep_size); the config the plan exports still loads with the plan's batch and ZeRO stage."""
    module, _ = deepspeed_config
    model = autoplan.models.get("moe-tiny")
    plan = Plan.uniform(model, DGX_A100, tp=1, pp=1, dp=8, ep=4, micro_batch=1, global_batch=16, zero=2)
    cfg = load_deepspeed(module, plan, export(plan, "deepspeed", model).text, monkeypatch)
    assert (cfg.train_batch_size, cfg.zero_optimization_stage) == (16, 2)


# ---------------------------------------------------------------------------- search --for
@pytest.mark.parametrize("target", ["megatron", "deepspeed", "torchtitan"])
def test_searched_plans_are_all_expressible(target):
    model = autoplan.models.get("llama-tiny")
    result = autoplan.search(model, SMALL_MIXED, 16, target=target, progress=False, max_micro_batch=4)
    dtype = result.best.plan.dtype
    assert dtype == ("fp32" if target == "torchtitan" else "fp16")   # V100 and T4 have no bf16
    for rp in result.ranked:
        assert violation(rp.plan, target, autoplan.models.get("llama-tiny", dtype=dtype), SMALL_MIXED) is None
