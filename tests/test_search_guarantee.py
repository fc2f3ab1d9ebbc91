"""The search's guarantee: on small named cases, homogeneous and mixed, its best plan is
never slower than the best of an exhaustive enumeration of the plans it can express
(tests/exhaustive.py: every pipeline, setting, contiguous split and per-stage recompute,
timed by the full cost model), within 0.5%."""
from __future__ import annotations

import pytest

from autoplan import Cluster, models
from autoplan.errors import NoPlanFitsError
from search import search
from tests.exhaustive import Space, best_plan

TOLERANCE = 0.005


def device(name: str, memory_gib: float, tflops: float, bandwidth_GBps: float = 1000) -> dict:
    return {"name": name, "memory_GiB": memory_gib, "peak_TFLOPS": {"bf16": tflops},
            "memory_bandwidth_GBps": bandwidth_GBps, "compute_units": 80,
            "intra_node_link": {"bandwidth_GBps": 100, "latency_us": 5}}


def homogeneous(memory_gib: float, nodes: int, gpus_per_node: int) -> Cluster:
    return Cluster.from_dict({"name": "toy", "inter_node": {"bandwidth_GBps": 10, "latency_us": 10},
                              "node_groups": [{"name": "n", "nodes": nodes, "gpus_per_node": gpus_per_node,
                                               "device": device("toy-gpu", memory_gib, 100)}]})


def mixed(groups: list[tuple[str, int, int, float, float]], inter_GBps: float = 5) -> Cluster:
    """groups: (name, nodes, GPUs per node, GiB, TFLOP/s)."""
    return Cluster.from_dict({"name": "toy-mixed", "inter_node": {"bandwidth_GBps": inter_GBps, "latency_us": 10},
                              "node_groups": [{"name": n, "nodes": k, "gpus_per_node": g,
                                               "device": device(f"{n}-gpu", mem, tf)}
                                              for n, k, g, mem, tf in groups]})


def real_mixed(v100: tuple[int, int], t4: tuple[int, int]) -> Cluster:
    """V100-16GB and T4 nodes joined by 25 GbE, as examples/clusters/small-mixed-v100-t4.json."""
    return Cluster.from_dict({"name": "v100-t4", "inter_node": {"bandwidth_GBps": 0.78, "latency_us": 25},
                              "node_groups": [{"name": "v100", "device": "V100-16GB", "nodes": v100[0],
                                               "gpus_per_node": v100[1]},
                                              {"name": "t4", "device": "T4", "nodes": t4[0],
                                               "gpus_per_node": t4[1]}]})


def toy(layers: int, hidden: int, heads: int, seq: int, vocab: int):
    return models.transformer(layers=layers, hidden=hidden, heads=heads, seq_len=seq, vocab=vocab)


def toy_moe(layers: int, hidden: int, heads: int, seq: int, vocab: int, experts: int, top_k: int):
    return models.transformer(layers=layers, hidden=hidden, heads=heads, seq_len=seq, vocab=vocab, arch="moe",
                              num_experts=experts, top_k=top_k, ffn_hidden=2 * hidden)


# name: (model, cluster, global batch, space)
CASES = {
    "homogeneous-roomy-all-schedules": (
        lambda: toy(3, 512, 8, 512, 16000), lambda: homogeneous(6, 2, 2), 8,
        Space(recompute=("none", "full"), zero=(0, 3), max_virtual_stages=2, max_micro_batch=2)),
    "homogeneous-tight-memory": (
        lambda: toy(4, 1024, 16, 1024, 32000), lambda: homogeneous(3.4, 2, 2), 4,
        Space(schedules=("1f1b", "zero-bubble"), recompute=("none", "full"), zero=(0, 1),
              sequence_parallel=(False, True), max_micro_batch=2)),
    "homogeneous-four-nodes-interleaved": (
        lambda: toy(4, 512, 8, 512, 16000), lambda: homogeneous(2.9, 4, 1), 8,
        Space(schedules=("1f1b", "interleaved-1f1b", "zero-bubble"), recompute=("selective", "full"), zero=(0,),
              max_virtual_stages=2)),
    # Expert parallelism inside a node (ep 2) or across the slow network (ep 4); the best
    # plan splits the experts.
    "homogeneous-moe-expert-parallel": (
        lambda: toy_moe(3, 512, 8, 512, 16000, 4, 2), lambda: homogeneous(3, 2, 2), 8,
        Space(schedules=("1f1b",), recompute=("none", "full"), zero=(0, 1), sequence_parallel=(False,),
              max_micro_batch=2)),
    "mixed-fast-slow-all-schedules": (
        lambda: toy(3, 1024, 16, 1024, 32000),
        lambda: mixed([("fast", 1, 2, 4.0, 100), ("slow", 1, 2, 2.0, 30)]), 4,
        Space(schedules=("zero-bubble", "interleaved-1f1b"), recompute=("none", "full"), zero=(0, 3),
              sequence_parallel=(False,), max_virtual_stages=2, max_micro_batch=2)),
    "mixed-tight-memory-recompute": (
        lambda: toy(4, 1024, 16, 1024, 32000),
        lambda: mixed([("fast", 1, 2, 3.4, 100), ("slow", 1, 2, 3.4, 60)]), 4,
        Space(schedules=("1f1b", "zero-bubble"), recompute=("none", "full"), zero=(0,), sequence_parallel=(False,),
              max_micro_batch=2)),
    "mixed-three-types": (
        lambda: toy(3, 512, 8, 512, 16000),
        lambda: mixed([("a", 1, 2, 3.0, 100), ("b", 1, 1, 3.0, 50), ("c", 1, 1, 2.0, 25)]), 4,
        Space(schedules=("1f1b", "zero-bubble", "gpipe"), recompute=("none",), zero=(0, 1),
              sequence_parallel=(False,))),
    # A long sequence on one node: context parallelism (every degree and exchange) against
    # tensor, pipeline and data parallelism and recomputation.
    "homogeneous-long-sequence-context": (
        lambda: toy(2, 512, 8, 8192, 16000), lambda: homogeneous(6, 1, 4), 2,
        Space(schedules=("1f1b",), recompute=("none", "full"), zero=(0, 3), max_micro_batch=1, pp=(1, 2),
              min_cp_tokens=2048)),
    "v100-t4-gpt2-like-pinned-pp3": (
        lambda: toy(4, 1024, 16, 1024, 50257), lambda: real_mixed((1, 4), (2, 2)), 32,
        Space(schedules=("1f1b", "zero-bubble"), recompute=("none",), zero=(0, 1), sequence_parallel=(False,),
              pp=(3,), max_micro_batch=8)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_search_is_never_worse_than_exhaustive_enumeration(case):
    make_model, make_cluster, global_batch, space = CASES[case]
    model, cluster = make_model(), make_cluster()
    best_t, best_p, count = best_plan(model, cluster, global_batch, space)
    assert count > 50, "the enumeration must cover a real space"
    if best_t is None:
        with pytest.raises(NoPlanFitsError):
            search(model, cluster, global_batch, progress=False, **space.search_kwargs())
        return
    found = search(model, cluster, global_batch, progress=False, **space.search_kwargs()).best
    print(f"{case}: {count} plans; exhaustive {best_p.describe()} {best_t:.6g} s; "
          f"search {found.plan.describe()} {found.estimate.iteration_time_s:.6g} s")
    assert found.estimate.iteration_time_s <= best_t * (1 + TOLERANCE), \
        f"search {found.plan.describe()} {found.estimate.iteration_time_s:.6g} s vs exhaustive " \
        f"{best_p.describe()} {best_t:.6g} s ({count} plans)"


# The plan Plan.uniform writes (Megatron's even split, one recompute mode) is one the search
# can express; it must never come back slower. Interleaved chunks share their group's
# memory, so a split that fits only as a whole is easy to lose.
UNIFORM_CASES = {
    "gpt3-175b-1024-a100-interleaved": (
        "gpt3-175b", lambda: Cluster.homogeneous("A100-80GB", 128, 8, inter_node_GBps=25), 1536,
        dict(tp=4, pp=8, dp=32, micro_batch=1, schedule="interleaved-1f1b", virtual_stages=4,
             sequence_parallel=True, zero=2)),
}


@pytest.mark.parametrize("name", list(UNIFORM_CASES), ids=list(UNIFORM_CASES))
def test_search_is_never_worse_than_the_uniform_plan(name):
    import autoplan
    model_name, make_cluster, global_batch, fields = UNIFORM_CASES[name]
    model, cluster = models.get(model_name), make_cluster()
    uniform = autoplan.Plan.uniform(model, cluster, global_batch=global_batch, **fields)
    reference = autoplan.estimate(model, cluster, uniform)
    assert reference.fits and not reference.tight
    found = search(model, cluster, global_batch, progress=False, tp=[fields["tp"]], pp=[fields["pp"]],
                   dp=[fields["dp"]], micro_batch=[fields["micro_batch"]], schedules=[fields["schedule"]],
                   virtual_stages=[fields["virtual_stages"]], zero=[fields["zero"]])
    assert found.best.estimate.iteration_time_s <= reference.iteration_time_s * (1 + TOLERANCE)
