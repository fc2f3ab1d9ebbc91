"""The search: it finds the same optimum as brute-force enumeration under the same cost
model, returns well-formed results, explains them, fails helpfully, and its CLI works."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

import autoplan
from autoplan import Cluster, Plan, models
from autoplan.cli import main
from autoplan.errors import ConfigError, NoPlanFitsError
from autoplan.plan import DeviceGroup, Stage
from autoplan.stacks import get_stack
from costmodel import EstimateOptions, estimate
from search import search


def toy_device(name: str, memory_gib: float, tflops: float) -> dict:
    return {"name": name, "memory_GiB": memory_gib, "peak_TFLOPS": {"bf16": tflops},
            "memory_bandwidth_GBps": 1000, "compute_units": 80,
            "intra_node_link": {"bandwidth_GBps": 100, "latency_us": 5}}


def toy_cluster(memory_gib: float, nodes: int = 2, gpus_per_node: int = 2) -> Cluster:
    """Identical toy GPUs small enough that memory decides (1 GiB of each is overhead)."""
    return Cluster.from_dict({"name": "toy", "inter_node": {"bandwidth_GBps": 10, "latency_us": 10},
                              "node_groups": [{"name": "n", "nodes": nodes, "gpus_per_node": gpus_per_node,
                                               "device": toy_device("toy-gpu", memory_gib, 100)}]})


def toy_mixed(memory_fast: float, memory_slow: float, tflops_slow: float) -> Cluster:
    return Cluster.from_dict({"name": "toy-mixed", "inter_node": {"bandwidth_GBps": 5, "latency_us": 10},
                              "node_groups": [
                                  {"name": "fast", "nodes": 1, "gpus_per_node": 2,
                                   "device": toy_device("fast-gpu", memory_fast, 100)},
                                  {"name": "slow", "nodes": 1, "gpus_per_node": 2,
                                   "device": toy_device("slow-gpu", memory_slow, tflops_slow)}]})


MODELS = {
    "4x1024": dict(layers=4, hidden=1024, heads=16, seq_len=1024, vocab=32000),
    "5x512": dict(layers=5, hidden=512, heads=8, seq_len=512, vocab=16000),
    "3x2048": dict(layers=3, hidden=2048, heads=16, seq_len=512, vocab=32000),
    "moe-3x1024": dict(layers=3, hidden=1024, heads=16, seq_len=512, vocab=16000, arch="moe", num_experts=4,
                       top_k=2, ffn_hidden=4096),
}


def toy_model(name: str):
    return models.transformer(**MODELS[name])


def compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0,) + cuts + (n,)
        yield [(b[i], b[i + 1]) for i in range(k)]


def brute_force(model, cluster, gb, schedules, recompute, zero, sps, max_v=2):
    """Every valid uniform plan (Megatron rank order) with every split, every per-stage
    recompute assignment and every expert-parallel degree, under the full cost model:
    (best time, best plan, plans tried)."""
    n, L = cluster.num_gpus, model.num_layers
    gpn = cluster.groups[0].gpus_per_node
    best, count = None, 0
    for tp in model.tp_degrees(gpn):
        if gpn % tp:
            continue
        for pp, dp in itertools.product(range(1, L + 1), range(1, n + 1)):
            if tp * pp * dp > n or gb % dp:
                continue
            groups = tuple(DeviceGroup(ranks=tuple(range(p * tp * dp, (p + 1) * tp * dp)), tp=tp) for p in range(pp))
            for b in [x for x in range(1, gb // dp + 1) if (gb // dp) % x == 0]:
                m = gb // (dp * b)
                for sched in schedules:
                    vs = [1] if sched != "interleaved-1f1b" else \
                        [v for v in range(2, max_v + 1) if pp > 1 and pp * v <= L and m % pp == 0]
                    eps = [e for e in range(1, dp + 1)
                           if dp % e == 0 and (e == 1 or (model.num_experts and model.num_experts % e == 0))]
                    for v, z, sp, ep in itertools.product(vs, zero if dp > 1 else [min(zero)],
                                                          sps if tp > 1 else [min(sps)], eps):
                        for split in compositions(L, pp * v):
                            for rec in itertools.product(recompute, repeat=pp * v):
                                stages = tuple(Stage(a, e, j % pp, r) for j, ((a, e), r) in enumerate(zip(split, rec)))
                                plan = Plan(groups=groups, stages=stages, micro_batch=b, num_micro_batches=m,
                                            schedule=sched, virtual_stages=v, sequence_parallel=sp, zero=z, ep=ep)
                                est = estimate(model, cluster, plan)
                                count += 1
                                if est.fits and (best is None or (est.tight, est.iteration_time_s) < best[2]):
                                    # The search's order: plans with room first, then tight ones.
                                    best = (est.iteration_time_s, plan, (est.tight, est.iteration_time_s))
    return best, count


# name: (model, GiB per GPU, (nodes, GPUs per node), global batch, schedules, recompute, zero, sp)
BRUTE_CASES = {
    "tight-memory-mixed-recompute": ("4x1024", 1.6, (2, 2), 4, ["1f1b", "gpipe"], ["none", "full"], [0, 1],
                                     [False, True]),
    "interleaved-wins": ("5x512", 1.3, (2, 2), 8, ["interleaved-1f1b", "1f1b"], ["selective", "full"], [0], [True]),
    "zero-bubble-zero3": ("5x512", 6, (2, 2), 8, ["gpipe", "zero-bubble"], ["none", "full"], [0, 3], [False, True]),
    "one-node-four-gpus": ("4x1024", 6, (1, 4), 4, ["1f1b", "zero-bubble"], ["none", "selective"], [0], [False]),
    "four-nodes-pipeline": ("5x512", 6, (4, 1), 8, ["1f1b", "interleaved-1f1b"], ["selective", "full"], [0],
                            [True]),
    "gpipe-few-micro-batches": ("4x1024", 6, (4, 1), 8, ["gpipe"], ["selective", "full"], [0, 3], [False]),
    "nothing-fits": ("3x2048", 1.05, (2, 2), 4, ["1f1b"], ["full"], [3], [True]),
    # Experts are three quarters of this model: without ZeRO, data parallelism fits only with
    # the experts split over the replicas (ep=4), which beats the pipeline that also fits.
    "experts-must-be-split": ("moe-3x1024", 3.6, (1, 4), 8, ["1f1b"], ["none", "full"], [0], [False]),
}


@pytest.mark.parametrize("case", BRUTE_CASES, ids=list(BRUTE_CASES))
def test_search_finds_the_brute_force_optimum(case):
    name, mem, (nodes, gpn), gb, schedules, recompute, zero, sps = BRUTE_CASES[case]
    model, cluster = toy_model(name), toy_cluster(mem, nodes, gpn)
    best, count = brute_force(model, cluster, gb, schedules, recompute, zero, sps)
    assert count > 50, "the brute force must enumerate a real space"
    kwargs = dict(schedules=schedules, recompute=recompute, zero=zero, sequence_parallel=sps,
                  max_virtual_stages=2, progress=False)
    if best is None:
        with pytest.raises(NoPlanFitsError):
            search(model, cluster, gb, **kwargs)
        return
    result = search(model, cluster, gb, **kwargs)
    assert result.best.estimate.iteration_time_s == pytest.approx(best[0], rel=1e-9), \
        f"search {result.best.plan.describe()} vs brute force {best[1].describe()}"
    assert result.stats.estimates <= count


def brute_force_mixed(model, cluster, gb, schedules, recompute, zero):
    """Every pipeline the search's space holds on a mixed cluster (each node group one run
    of groups with one tp, runs in any order), every split and per-stage recompute."""
    L = model.num_layers
    pools = range(len(cluster.groups))
    best, count = None, 0
    for dp in (1, 2):
        options = []
        for k in pools:
            ng = cluster.groups[k]
            options.append([(0, 1)] + [(n, t) for t in model.tp_degrees(ng.gpus_per_node) if ng.gpus_per_node % t == 0
                                       for n in range(1, ng.num_gpus // (dp * t) + 1)])
        for choice in itertools.product(*options):
            used = [k for k in pools if choice[k][0]]
            for order in itertools.permutations(used):
                seq = [(k, choice[k][1]) for k in order for _ in range(choice[k][0])]
                if not seq or len(seq) > L:
                    continue
                offset = {k: cluster.group_ranks(k).start for k in pools}
                groups = []
                for k, t in seq:
                    groups.append(DeviceGroup(ranks=tuple(range(offset[k], offset[k] + dp * t)), tp=t))
                    offset[k] += dp * t
                for b in [x for x in range(1, gb // dp + 1) if (gb // dp) % x == 0]:
                    for sched, z in itertools.product(schedules, zero if dp > 1 else [min(zero)]):
                        for split in compositions(L, len(seq)):
                            for rec in itertools.product(recompute, repeat=len(seq)):
                                stages = tuple(Stage(a, e, j, r) for j, ((a, e), r) in enumerate(zip(split, rec)))
                                plan = Plan(groups=tuple(groups), stages=stages, micro_batch=b,
                                            num_micro_batches=gb // (dp * b), schedule=sched, zero=z)
                                est = estimate(model, cluster, plan)
                                count += 1
                                if est.fits and (best is None or (est.tight, est.iteration_time_s) < best[2]):
                                    # The search's order: plans with room first, then tight ones.
                                    best = (est.iteration_time_s, plan, (est.tight, est.iteration_time_s))
    return best, count


MIXED_CASES = {
    "slow-stage-takes-the-embedding": ("5x512", 4.0, 1.6, 25, 4, ["zero-bubble"], ["none"], [0, 3]),
    "both-types-tp2-gpipe": ("4x1024", 3.0, 2.6, 50, 2, ["gpipe"], ["none", "full"], [0]),
    "both-types-uneven-split": ("4x1024", 2.8, 2.8, 70, 4, ["1f1b"], ["none", "full"], [0]),
    "both-types-zero3": ("4x1024", 3.5, 3.0, 50, 4, ["1f1b"], ["none"], [0, 3]),
}


@pytest.mark.parametrize("case", MIXED_CASES, ids=list(MIXED_CASES))
def test_mixed_cluster_search_finds_the_brute_force_optimum(case):
    name, mem_fast, mem_slow, tflops_slow, gb, schedules, recompute, zero = MIXED_CASES[case]
    model, cluster = toy_model(name), toy_mixed(mem_fast, mem_slow, tflops_slow)
    best, count = brute_force_mixed(model, cluster, gb, schedules, recompute, zero)
    assert best is not None and count > 100
    result = search(model, cluster, gb, schedules=schedules, recompute=recompute, zero=zero,
                    sequence_parallel=[False], progress=False)
    assert result.best.estimate.iteration_time_s == pytest.approx(best[0], rel=1e-9), \
        f"search {result.best.plan.describe()} vs brute force {best[1].describe()}"
    # Clusters this small have every device-group pipeline enumerated (no CP-SAT needed).
    assert result.stats.placement is not None and result.stats.placement.enumerated == result.stats.skeletons > 0


# ----------------------------------------------------------------- the result

@pytest.fixture(scope="module")
def mixed_result():
    model = models.get("gpt3-1.3b")
    cluster = Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    return model, cluster, search(model, cluster, 64, progress=False)


def test_result_is_ranked_and_valid(mixed_result):
    model, cluster, result = mixed_result
    times = [rp.estimate.iteration_time_s for rp in result.ranked]
    assert times == sorted(times) and result.best is result.ranked[0]
    assert [rp.rank for rp in result.ranked] == list(range(1, len(result.ranked) + 1))
    for rp in result.ranked:
        rp.plan.validate(model, cluster)
        assert rp.estimate.fits and rp.gpus_used == rp.plan.num_gpus <= cluster.num_gpus
        # Every device group is one device type.
        for g in rp.plan.groups:
            assert len({cluster.slots[r].device.name for r in g.ranks}) == 1
        # The closed form that shortlisted the plan is close to the full cost model.
        assert rp.predicted_s == pytest.approx(rp.estimate.iteration_time_s, rel=0.15)


def test_stats_account_for_every_candidate(mixed_result):
    _, _, result = mixed_result
    s = result.stats
    assert s.candidates > 100 and s.skeletons > 1 and s.splits > 0
    assert s.pruned_memory_bound + s.pruned_time_bound + s.pruned_no_split + s.shortlisted <= s.candidates
    assert s.estimates >= len(result.ranked) and s.estimate_fit_mismatch == 0
    assert {"placement", "bounds", "split", "estimate"} <= set(s.phase_s)
    assert s.placement.enumerated == s.placement.skeletons == s.skeletons > 0
    assert "enumerated" in s.summary() and "pruned" in s.summary()
    assert s.optimality_gap == 0 and not s.stopped_at_time_limit and s.lower_bound_s > 0


def test_large_spaces_are_placed_by_cp_sat():
    """CP-SAT proposes the pipelines; its next-best alternatives are sought only for the
    data-parallel degrees whose optimum is within placement_alternatives_within of the best
    one's: with 0 only the best degree gets them, fewer pipelines are proposed (a part of
    the others), and the best plan is no faster."""
    model = models.get("gpt3-1.3b")
    cluster = Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    result = search(model, cluster, 64, max_exhaustive_pipelines=1, progress=False)
    p = result.stats.placement
    assert p.enumerated == 0 and p.solves > 0 and p.skeletons > 0 and "CP-SAT" in result.stats.summary()
    assert result.best.estimate.fits
    near = search(model, cluster, 64, max_exhaustive_pipelines=1, placement_alternatives_within=0.0, progress=False)
    assert near.stats.placement.solves < p.solves and near.stats.placement.skeletons < p.skeletons
    assert near.best.estimate.iteration_time_s >= result.best.estimate.iteration_time_s * (1 - 1e-9)


def test_table_and_explain(mixed_result):
    _, _, result = mixed_result
    table = result.table(3)
    assert "tokens/s" in table and "MFU" in table and "V100-SXM2-16GB" in table and "T4-16GB" in table
    assert len(table.splitlines()) == 2 + min(3, len(result.ranked))
    text = result.explain()
    assert "runner-up" in text and "biggest difference" in text and "breakdown" in text


def test_search_is_deterministic():
    model, cluster = toy_model("5x512"), toy_cluster(3, 2, 2)
    a = search(model, cluster, 8, progress=False)
    b = search(model, cluster, 8, progress=False)
    assert [rp.plan.to_dict() for rp in a.ranked] == [rp.plan.to_dict() for rp in b.ranked]


WINDOW_CASES = {
    # name: (model, cluster file, global batch, whether the window must spare splits)
    "gpt3-175b-on-1024-a100": ("gpt3-175b", "examples/clusters/selene-a100-128nodes.json", 1536, True),
    "gpt2-medium-on-v100-t4": ("gpt2-medium", "examples/clusters/small-mixed-v100-t4.json", 32, False),
    "llama3-8b-on-64-h100": ("llama3-8b", "examples/clusters/dgx-h100-8nodes.json", 512, False),
}


@pytest.mark.parametrize("name", WINDOW_CASES, ids=list(WINDOW_CASES))
def test_estimate_window_keeps_every_plan_the_search_ranks(name, monkeypatch):
    """The loop stops examining candidates the estimate phase could never rank (see
    search.core._estimate_window): on these cases the ranked plans and their estimates are
    exactly those of a search that fills the whole shortlist first (elsewhere a changed
    examination order may change the splits found further down), and on 1,024 GPUs it
    splits far fewer."""
    import search.core as core
    model_name, cluster_file, gb, spares = WINDOW_CASES[name]
    model, cluster = models.get(model_name), Cluster.load(cluster_file)
    windowed = search(model, cluster, gb, progress=False)
    monkeypatch.setattr(core, "_estimate_window", lambda *args: float("inf"))
    full = search(model, cluster, gb, progress=False)
    assert [(rp.plan.to_dict(), rp.estimate.iteration_time_s, rp.estimate.tight) for rp in windowed.ranked] == \
        [(rp.plan.to_dict(), rp.estimate.iteration_time_s, rp.estimate.tight) for rp in full.ranked]
    if spares:
        assert windowed.stats.splits < 0.8 * full.stats.splits


def test_time_limit_returns_the_best_so_far_with_a_bound():
    model = models.get("gpt2-medium")
    cluster = Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    full = search(model, cluster, 32, progress=False)
    quick = search(model, cluster, 32, time_limit=1e-3, progress=False)
    assert full.stats.optimality_gap == 0 and not full.stats.stopped_at_time_limit
    # No plan is faster than the lower bound; the complete search's best is one of them.
    assert quick.stats.lower_bound_s <= full.stats.lower_bound_s * (1 + 1e-9)
    assert quick.best.estimate.fits and quick.stats.optimality_gap >= 0
    if quick.stats.stopped_at_time_limit:
        assert quick.stats.unexplored > 0 and "time limit" in quick.stats.summary()
        assert quick.best.predicted_s <= quick.stats.lower_bound_s * (1 + quick.stats.optimality_gap) * (1 + 1e-9)


def test_fewer_gpus_are_reported_and_can_be_forbidden():
    # Global batch 2 cannot keep 4 GPUs busy with data parallelism alone.
    model, cluster = toy_model("5x512"), toy_cluster(6, 4, 1)
    free = search(model, cluster, 2, schedules=["1f1b"], progress=False)
    forced = search(model, cluster, 2, schedules=["1f1b"], use_all_gpus=True, progress=False)
    assert all(rp.gpus_used == cluster.num_gpus for rp in forced.ranked)
    assert free.best.estimate.iteration_time_s <= forced.best.estimate.iteration_time_s
    if free.best.gpus_used < cluster.num_gpus:
        assert f"of the cluster's {cluster.num_gpus} GPUs" in free.explain()


# -------------------------------------------------------------- constraints

@pytest.mark.parametrize("kwargs,field", [
    ({"tensor_parallel": 2}, "tensor_parallel"),
    ({"schedules": ["pipedream"]}, "schedules"),
    ({"zero": [4]}, "zero"),
    ({"tp": 0}, "tp"),
    ({"recompute": []}, "recompute"),
    ({"max_estimates": 0}, "max_estimates"),
    ({"ep": [0]}, "ep"),
    ({"placement_alternatives_within": -0.1}, "placement_alternatives_within"),
], ids=["unknown-keyword", "unknown-schedule", "bad-zero", "bad-tp", "empty-recompute", "bad-budget", "bad-ep",
        "negative-fraction"])
def test_bad_constraints_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        search(toy_model("5x512"), toy_cluster(3), 8, progress=False, **kwargs)
    assert err.value.field == field


def test_expert_parallel_degrees_follow_dp_and_the_experts():
    """Dense models get ep = 1 only; an MoE model gets the ep that divide dp and its experts,
    and an ep constraint narrows that."""
    moe, cluster = toy_model("moe-3x1024"), toy_cluster(8, 1, 4)
    free = search(moe, cluster, 8, schedules=["1f1b"], progress=False, max_estimates=40)
    assert {rp.plan.ep for rp in free.ranked} > {1}
    assert all(rp.plan.dp % rp.plan.ep == 0 and 4 % rp.plan.ep == 0 for rp in free.ranked)
    fixed = search(moe, cluster, 8, schedules=["1f1b"], ep=[1], progress=False)
    assert {rp.plan.ep for rp in fixed.ranked} == {1}
    dense = search(toy_model("5x512"), cluster, 8, schedules=["1f1b"], progress=False, max_estimates=40)
    assert {rp.plan.ep for rp in dense.ranked} == {1}


def test_constraints_narrow_the_space():
    model, cluster = toy_model("5x512"), toy_cluster(6, 2, 2)
    result = search(model, cluster, 8, tp=1, pp=[2], schedules="zero-bubble", zero=0, progress=False)
    for rp in result.ranked:
        assert {g.tp for g in rp.plan.groups} == {1} and rp.plan.pp == 2
        assert rp.plan.schedule == "zero-bubble" and rp.plan.zero == 0


def test_global_batch_must_be_positive():
    with pytest.raises(ConfigError):
        search(toy_model("5x512"), toy_cluster(3), 0, progress=False)


# ------------------------------------------------------------- nothing fits

def test_no_plan_fits_says_what_is_needed_per_device_type():
    model = models.get("gpt3-6.7b")
    cluster = Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    with pytest.raises(NoPlanFitsError) as err:
        search(model, cluster, 64, recompute=["none"], zero=[0], progress=False)
    text = str(err.value)
    assert "GiB per V100-SXM2-16GB GPU" in text and "GiB per T4-16GB GPU" in text
    assert "more GPUs" in text and "recompute" in text and "ZeRO" in text and "shorter sequence" in text


@pytest.mark.parametrize("cluster", ["examples/clusters/small-mixed-v100-t4.json", "examples/clusters/dgx-a100-1node.json"],
                         ids=["mixed", "homogeneous"])
def test_states_larger_than_the_cluster_are_refused_before_any_search(cluster, monkeypatch):
    """GPT-3 175B's weights, gradients and optimizer states outgrow these clusters' memory
    put together: the answer comes without enumerating a single candidate, and says so."""
    from search import core as search_core

    def enumerate_(*args, **kwargs):
        raise AssertionError("the branch and bound ran")
    monkeypatch.setattr(search_core._Search, "_best_first", enumerate_)
    with pytest.raises(NoPlanFitsError) as err:
        search(models.get("gpt3-175b"), Cluster.load(cluster), 64, progress=False)
    assert "optimizer states alone take" in str(err.value)


# ---------------------------------------------------------------------- CLI

def test_cli_search_writes_a_plan_estimate_accepts(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--cluster", "examples/clusters/small-mixed-v100-t4.json", "--model", "gpt2-medium"]
    code = main(["search", *args, "--global-batch", "16", "--top-k", "3", "--out", str(out), "--explain",
                 "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and "tokens/s" in printed and "runner-up" in printed and f"wrote {out}" in printed
    saved = json.loads(out.read_text())
    assert saved["estimate"]["fits"] is True
    plan = Plan.load(out)
    code = main(["estimate", *args, "--plan", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and f"{saved['estimate']['iteration_time_s']:.4g} s" in printed
    assert plan.global_batch == 16


def test_cli_search_no_fit_is_one_paragraph_and_exit_2(capsys):
    code = main(["search", "--cluster", "examples/clusters/small-mixed-v100-t4.json", "--model", "gpt3-6.7b",
                 "--global-batch", "64", "--recompute", "none", "--zero", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert "No plan fits in memory" in err and "Traceback" not in err
    assert "\n\n" not in err.strip()


def test_progress_bar_stays_off_when_not_a_terminal(capsys):
    search(toy_model("5x512"), toy_cluster(3), 8, progress=True)
    assert capsys.readouterr().err == ""


def test_public_api_entry_point():
    result = autoplan.search("gpt-tiny", Cluster.load("examples/clusters/cpu-4ranks.json"), 8, progress=False)
    assert result.best.estimate.fits


# name: (search keywords) -> whether the result notes that pipelined ZeRO-2/3 run as ZeRO-1
ZERO_NOTES = {
    "zero3-asked-with-pipelines": (dict(zero=[0, 3]), True),
    "every-stage-by-default": (dict(), True),
    "zero1-at-most": (dict(zero=[0, 1]), False),
    "no-pipelines": (dict(zero=[3], pp=[1]), False),
    "stack-that-shards-under-pipelining": (dict(zero=[0, 3], stack="megatron-core"), False),
    "torchtitan-on-the-same-pipelining": (dict(zero=[0, 3], stack="torchtitan"), True),
}


@pytest.mark.parametrize("name", list(ZERO_NOTES), ids=list(ZERO_NOTES))
def test_search_notes_the_zero_stages_its_stack_runs_lower(name):
    kwargs, noted = ZERO_NOTES[name]
    result = search(models.get("gpt-tiny"), Cluster.load("examples/clusters/cpu-4ranks.json"), 8,
                    progress=False, **kwargs)
    assert bool(result.notes) == noted
    if noted:
        assert "as ZeRO-1" in result.notes[0]
        assert all(rp.plan.zero <= 1 for rp in result.ranked if rp.plan.pp > 1)


def test_mixed_search_finds_a_plan_cp_sat_alone_misses():
    """GPT-3 175B's layer shape (94 blocks) on the 64-GPU three-type cluster, narrowed to dp=4,
    micro-batch 1, 1F1B, ZeRO-3 and CP-SAT placement: a plan with one H100, one A100 and one
    L4 device group (each node group whole, at its largest tp) fits with little room. The
    search must not say that nothing fits, and must find a plan at least as fast. (The 96-block model no longer fits
    this narrowed space at all since ZeRO-3's working set counts the gathered unit's
    gradient.) The case needs a pipeline that shards as ZeRO-3 does: autoplan's runtime (and
    torchtitan) run pipelined ZeRO-3 as ZeRO-1, where none of these pipelines fits, so here
    its stack keeps ZeRO-3 under pipelining."""
    data = json.loads(open("examples/clusters/mixed-three-types.json").read())
    cluster = Cluster.from_dict(data)
    model = models.transformer(layers=94, hidden=12288, heads=96, seq_len=2048, vocab=50257, name="gpt3-175b-94")
    groups = (DeviceGroup(ranks=tuple(range(0, 32)), tp=8), DeviceGroup(ranks=tuple(range(32, 48)), tp=4),
              DeviceGroup(ranks=tuple(range(48, 64)), tp=4))
    known = Plan(groups=groups, stages=(Stage(0, 71, 0, "full"), Stage(71, 87, 1, "full"), Stage(87, 96, 2, "full")),
                 micro_batch=1, num_micro_batches=384, schedule="1f1b", zero=3, sequence_parallel=True,
                 model=model.name, seq_len=model.seq_len)
    sharding = dataclasses.replace(get_stack("autoplan"), pipeline_max_zero=3)
    ref = estimate(model, cluster, known, stack=sharding)
    assert ref.fits, "the case needs a plan that fits"
    result = search(model, cluster, 1536, dp=4, micro_batch=1, schedules="1f1b", zero=3,
                    max_exhaustive_pipelines=1, progress=False, stack=sharding)
    assert result.best.estimate.fits
    assert result.best.estimate.iteration_time_s <= ref.iteration_time_s * 1.005


def test_mixed_tight_fallback_loses_nothing_to_a_search_without_margin():
    """GPT-3 175B on the 64-GPU three-type cluster, narrowed to dp=1, micro-batch 2,
    zero-bubble, ZeRO-0 and CP-SAT placement: no plan leaves the memory margin free, so the
    search looks again for plans that fit at all, on the pipelines it already placed and
    the leanest ones first. Its best (marked tight) must be as fast as that of a search
    run without any margin from the start (placed under those budgets)."""
    data = json.loads(open("examples/clusters/mixed-three-types.json").read())
    cluster, model = Cluster.from_dict(data), models.get("gpt3-175b")
    narrow = dict(dp=1, micro_batch=2, schedules="zero-bubble", zero=0, max_exhaustive_pipelines=1, progress=False)
    fallback = search(model, cluster, 1536, **narrow)
    assert fallback.stats.tight_fallback and fallback.best.estimate.tight
    no_margin = search(model, cluster, 1536, options=EstimateOptions(memory_margin=0.0), **narrow)
    assert not no_margin.stats.tight_fallback
    assert fallback.best.estimate.iteration_time_s <= no_margin.best.estimate.iteration_time_s * (1 + 1e-9)
