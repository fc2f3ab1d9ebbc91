"""Context parallelism in the exports: Megatron-LM's --context-parallel-size/--cp-comm-type
(checked against the flag and validate_args table read from its code) and torchtitan's
context_parallel_degree (and 0.2's rotate method), with the engines' own arithmetic; what an
engine cannot split is refused with the nearest plan it can run."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

import autoplan
from autoplan.engines import get_engine, violation
from autoplan.errors import ConfigError
from autoplan.export import export
from autoplan.megatron_rules import broken_rules
from autoplan.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import CLUSTER, megatron, model, uniform  # noqa: E402

CASES = {
    # name: (plan, Megatron's --cp-comm-type)
    "ring-with-tp-sp-and-zero3": (lambda: uniform(tp=2, cp=2, dp=2, global_batch=16, zero=3,
                                                  sequence_parallel=True), "p2p"),
    "all-gather-with-pipeline": (lambda: uniform(cp=4, pp=2, dp=1, global_batch=8, cp_comm="all_gather"),
                                 "all_gather"),
    "head-scatter-zero3": (lambda: uniform(cp=2, dp=4, global_batch=16, cp_comm="a2a", zero=3), "a2a"),
}


@pytest.mark.parametrize("name", CASES, ids=list(CASES))
def test_megatron_gets_the_context_degree_and_exchange(name):
    make, comm = CASES[name]
    plan = make()
    args, env, argv = megatron(plan, model("llama-tiny", 8))
    assert args.context_parallel_size == plan.cp and args.cp_comm_type == [comm]
    assert broken_rules(argv, env, world_size=plan.num_gpus, arch=9) == []
    # Megatron-LM derives data parallelism from the world: world / (tp * pp * cp).
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    assert plan.num_gpus // (tp * pp * cp) == plan.dp
    assert args.global_batch_size == args.micro_batch_size * plan.dp * plan.num_micro_batches


def test_megatron_table_has_its_context_rules():
    argv = ["--context-parallel-size", "4", "--seq-length", "36", "--micro-batch-size", "1"]
    assert "context-sequence" in {b.rule for b in broken_rules(argv, {}, world_size=4)}


@pytest.mark.parametrize("name", ["ring-with-tp-sp-and-zero3", "all-gather-with-pipeline"])
def test_torchtitan_0_2_gets_the_degree_and_rotation(name):
    plan = CASES[name][0]()
    cfg = tomllib.loads(export(plan, "torchtitan", model("llama-tiny", 8), engine_version="0.2").text)
    par = cfg["parallelism"]
    assert par["context_parallel_degree"] == plan.cp
    assert par["context_parallel_rotate_method"] == {"p2p": "alltoall", "all_gather": "allgather"}[plan.cp_comm]
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert dp * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] * plan.cp == plan.num_gpus


def test_torchtitan_0_3_gets_the_degree():
    plan = CASES["all-gather-with-pipeline"][0]()
    text = export(plan, "torchtitan", model("llama-tiny", 8)).text
    compile(text, "job.py", "exec")
    assert "context_parallel_degree=4," in text and "rotate" not in text


def test_plans_without_cp_export_no_cp_settings():
    plan = uniform(tp=2, dp=2)
    assert "context" not in export(plan, "megatron").text
    assert "context_parallel" not in export(plan, "torchtitan", model("llama-tiny", 8)).text


def _a2a_at(seq_len: int) -> Plan:
    """cp=2 head scatter on a sequence that splits in 2 but not in 4."""
    spec = autoplan.models.get("llama-tiny", layers=8, seq_len=seq_len)
    return Plan.uniform(spec, CLUSTER, tp=1, cp=2, pp=1, dp=1, micro_batch=1, global_batch=4, cp_comm="a2a")


REFUSED = {
    # name: (engine, version, plan, field)
    "deepspeed-has-no-cp-setting": ("deepspeed", None, lambda: uniform(cp=2, dp=2), "groups[].cp"),
    "torchtitan-has-no-head-scatter": ("torchtitan", None, lambda: uniform(cp=2, dp=2, cp_comm="a2a"), "cp_comm"),
    "torchtitan-0.3-has-no-ring-rotation-choice": ("torchtitan", None, lambda: uniform(cp=2, dp=2), "cp_comm"),
    "megatron-wants-2cp-chunks-for-a2a": ("megatron", None, lambda: _a2a_at(34), "groups[].cp"),
}


@pytest.mark.parametrize("name", REFUSED, ids=list(REFUSED))
def test_engines_that_cannot_split_sequences_so_refuse(name):
    engine, version, make, field = REFUSED[name]
    err = violation(make(), get_engine(engine, version))
    assert isinstance(err, ConfigError) and err.field == field and err.fix.startswith("nearest")


def test_search_for_an_engine_keeps_to_its_exchanges():
    assert get_engine("deepspeed").constraints()["cp"] == (1,)
    assert get_engine("torchtitan").constraints()["cp_comm"] == ("all_gather",)
    assert get_engine("torchtitan", "0.2").constraints()["cp_comm"] == ("p2p", "all_gather")
