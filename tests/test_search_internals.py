"""The search's fast model agrees with the full cost model; its DP, bounds, in-flight
counts and CP-SAT placement do what they claim."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as hst

from autoplan import Cluster, Plan, models
from autoplan.plan import DeviceGroup, Stage
from autoplan.schedule import build_program
from autoplan.stacks import get_stack
from costmodel import EstimateOptions, estimate
from costmodel.comm import (collective_latency, collective_time, p2p_time, zero3_collectives, zero3_gather_passes,
                             zero3_rank_overhead)
from costmodel.estimate import stage_costs
from search.bounds import Bounds
from search.evaluate import (Setting, Skeleton, analyze, fits_memory, pipeline_time, simulated,
                             stage_figures, work_floor)
from search.inflight import inflight
from search.placement import PlacementStats, place, pool_kinds, sizings
from search.split import Splitter
from search.tables import RECOMPUTES, Kind, Tables

GPT = models.transformer(layers=6, hidden=1024, heads=16, seq_len=1024, vocab=32000)
MOE = models.transformer(layers=6, hidden=1024, heads=16, seq_len=1024, vocab=32000, arch="moe", num_experts=8,
                         top_k=2, ffn_hidden=2048, name="moe-6x1024")


def skeleton_of(plan: Plan, cluster: Cluster) -> Skeleton:
    return Skeleton.of_plan(plan, cluster)


def setting_of(plan: Plan, tables: Tables) -> Setting:
    return Setting.of_plan(plan, tables.stack)


def mixed_plan(cluster: Cluster, schedule: str, zero: int, recompute: str, sp: bool) -> Plan:
    """Two T4 groups (tp 2) then two V100 groups (tp 4... of 4 GPUs: tp 2, dp 2)."""
    groups = (DeviceGroup(ranks=(4, 5), tp=2), DeviceGroup(ranks=(6, 7), tp=2),
              DeviceGroup(ranks=(0, 1), tp=2), DeviceGroup(ranks=(2, 3), tp=2))
    v = 2 if schedule == "interleaved-1f1b" else 1
    bounds = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8)] if v == 2 else [(0, 1), (1, 2), (2, 5),
                                                                                            (5, 8)]
    stages = tuple(Stage(a, b, j % 4, recompute if j % 2 else "none") for j, (a, b) in enumerate(bounds))
    return Plan(groups=groups, stages=stages, micro_batch=2, num_micro_batches=8, schedule=schedule,
                virtual_stages=v, sequence_parallel=sp, zero=zero)


HOMOGENEOUS = {
    "1f1b-tp2-pp2-dp2": dict(tp=2, pp=2, dp=2, micro_batch=2, global_batch=32, schedule="1f1b"),
    "gpipe-zero1-selective": dict(tp=1, pp=4, dp=2, micro_batch=1, global_batch=16, schedule="gpipe", zero=1,
                                  recompute="selective"),
    "interleaved-sp": dict(tp=4, pp=2, dp=1, micro_batch=2, global_batch=16, schedule="interleaved-1f1b",
                           virtual_stages=2, sequence_parallel=True),
    "zero-bubble-zero3-full": dict(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, schedule="zero-bubble",
                                   zero=3, recompute="full"),
    "single-stage-zero2": dict(tp=8, pp=1, dp=2, micro_batch=4, global_batch=32, zero=2),
    "cp2-ring-pp2-zero1-selective": dict(tp=2, cp=2, pp=2, dp=2, micro_batch=1, global_batch=8, zero=1,
                                         recompute="selective"),
    "cp4-all-gather-zero3": dict(tp=2, cp=4, pp=1, dp=2, micro_batch=2, global_batch=8, zero=3,
                                 cp_comm="all_gather"),
    "cp4-a2a-sp-full": dict(tp=2, cp=4, pp=2, dp=1, micro_batch=1, global_batch=8, cp_comm="a2a",
                            sequence_parallel=True, recompute="full"),
    # autoplan's runtime runs this one with DDP under autocast (the stack's own traffic).
    "ddp-autocast-full": dict(tp=1, pp=1, dp=4, micro_batch=2, global_batch=16, zero=0, recompute="full"),
}
CLUSTER = Cluster.homogeneous("A100-80GB", 2, 8, inter_node_GBps=25)
MIXED = Cluster.load("examples/clusters/small-mixed-v100-t4.json")


# Expert parallelism: experts split over replicas inside a node, across nodes, with ZeRO.
EXPERT = {
    "moe-ep2-zero1": dict(tp=2, pp=2, dp=2, micro_batch=1, global_batch=8, schedule="1f1b", zero=1, ep=2),
    "moe-ep8-across-nodes-zero3": dict(tp=2, pp=1, dp=8, micro_batch=1, global_batch=8, zero=3, ep=8,
                                       recompute="full", sequence_parallel=True),
    "moe-ep8-one-node-of-16": dict(tp=1, pp=1, dp=16, micro_batch=1, global_batch=16, zero=1, ep=8),
    "moe-ep4-tp2-zero0": dict(tp=2, pp=1, dp=8, micro_batch=2, global_batch=16, zero=0, ep=4,
                              sequence_parallel=True),
    "moe-ep1": dict(tp=1, pp=2, dp=4, micro_batch=1, global_batch=8, zero=2),
}


def cases():
    out = {}
    for name, kw in HOMOGENEOUS.items():
        out[name] = (CLUSTER, Plan.uniform(GPT, CLUSTER, **kw), GPT)
    for sched, zero, rec, sp in [("1f1b", 0, "full", False), ("interleaved-1f1b", 2, "selective", True),
                                 ("zero-bubble", 3, "none", True), ("gpipe", 1, "full", True)]:
        out[f"mixed-{sched}-zero{zero}"] = (MIXED, mixed_plan(MIXED, sched, zero, rec, sp), GPT)
    for name, kw in EXPERT.items():
        out[name] = (CLUSTER, Plan.uniform(MOE, CLUSTER, **kw), MOE)
    return out


CASES = cases()


# name: (stack, overlapped) for ZeRO-2 stacks that reduce-scatter every micro-batch's gradients
EVERY_MICRO_BATCH = {
    "autoplan-fsdp2": ("autoplan", True),
    "deepspeed-zero2": ("deepspeed", True),
    "not-overlapped": ("autoplan", False),
}


@pytest.mark.parametrize("name", list(EVERY_MICRO_BATCH), ids=list(EVERY_MICRO_BATCH))
def test_zero2_reduce_scatter_every_micro_batch(name):
    """Where ZeRO-2 reduce-scatters every micro-batch's gradients (FSDP2, DeepSpeed's
    partitioned gradients) the backward carries the collective (all of it, or what its
    compute does not hide) and the step-end reduction is gone; the search's figures say
    the same as the cost model."""
    stack, overlapped = EVERY_MICRO_BATCH[name]
    options = EstimateOptions(stack=get_stack(stack), overlap_grad_reduce=overlapped)
    plan = Plan.uniform(GPT, CLUSTER, tp=1, pp=1, dp=16, micro_batch=1, global_batch=64, zero=2)
    once = stage_costs(GPT, CLUSTER, replace(plan, zero=1), options)[0]
    every = stage_costs(GPT, CLUSTER, plan, options)[0]
    assert once.grad_reduce > 0 and every.grad_reduce == 0
    scatter = every.backward - once.backward
    # (ZeRO-1's once-per-step reduction is the same reduce-scatter of the same bytes.)
    if overlapped:
        assert 0 <= scatter < once.grad_reduce
    else:
        assert scatter == pytest.approx(once.grad_reduce, rel=1e-12)
    tables = Tables(GPT, CLUSTER, options=options)
    figs = stage_figures(tables, skeleton_of(plan, CLUSTER), setting_of(plan, tables), [(0, GPT.num_layers)],
                         ["none"])
    assert figs[0].backward_input + figs[0].backward_weight == pytest.approx(every.backward, rel=1e-12)
    assert figs[0].grad_reduce == 0


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_stage_costs_and_memory_equal_the_cost_model(case):
    cluster, plan, model = CASES[case]
    plan.validate(model, cluster)
    tables = Tables(model, cluster)
    sk, st = skeleton_of(plan, cluster), setting_of(plan, tables)
    bounds = [(s.start, s.end) for s in plan.stages]
    rec = [s.recompute for s in plan.stages]
    analysis, figs = analyze(tables, sk, st, bounds, rec)
    est = estimate(model, cluster, plan)
    costs = stage_costs(model, cluster, plan, EstimateOptions())
    for f, c in zip(figs, costs):
        assert f.forward == pytest.approx(c.forward, rel=1e-12)
        assert f.backward == pytest.approx(c.backward, rel=1e-12)
        assert f.backward_input == pytest.approx(c.backward_input, rel=1e-12)
        assert f.send_forward == pytest.approx(c.send_forward, rel=1e-9, abs=1e-15)
        assert f.send_backward == pytest.approx(c.send_backward, rel=1e-9, abs=1e-15)
        assert f.grad_reduce == pytest.approx(c.grad_reduce, rel=1e-9, abs=1e-15)
        assert f.activation == pytest.approx(c.activation_bytes, rel=1e-12)
    for mine, theirs in zip(analysis.memory, est.memory_by_group):
        assert mine == pytest.approx(theirs.total, rel=1e-9)
    assert analysis.fits == est.fits
    # Short programs are simulated exactly; long ones use the closed form (checked below).
    if simulated(st, sk.pp):
        assert analysis.time_s == pytest.approx(est.iteration_time_s, rel=1e-9)


LONG = {
    "1f1b-m64": dict(tp=2, pp=4, dp=1, micro_batch=1, global_batch=64, schedule="1f1b"),
    "gpipe-m64": dict(tp=2, pp=4, dp=2, micro_batch=1, global_batch=128, schedule="gpipe", zero=1),
    "interleaved-m64": dict(tp=2, pp=2, dp=2, micro_batch=1, global_batch=128, schedule="interleaved-1f1b",
                            virtual_stages=3),
    "zero-bubble-m32": dict(tp=4, pp=4, dp=1, micro_batch=2, global_batch=64, schedule="zero-bubble",
                            recompute="selective"),
}


@pytest.mark.parametrize("case", LONG, ids=list(LONG))
def test_closed_form_is_close_to_the_simulation(case):
    plan = Plan.uniform(GPT, CLUSTER, **LONG[case])
    tables = Tables(GPT, CLUSTER)
    sk, st = skeleton_of(plan, CLUSTER), setting_of(plan, tables)
    figs = stage_figures(tables, sk, st, [(s.start, s.end) for s in plan.stages], [s.recompute for s in plan.stages])
    closed = pipeline_time(sk, st, figs, tables)
    est = estimate(GPT, CLUSTER, plan)
    assert closed == pytest.approx(est.iteration_time_s - est.breakdown.get("host", 0.0), rel=0.05)
    # ... and the host is charged on top as the estimate charges it.
    assert analyze(tables, sk, st, [(s.start, s.end) for s in plan.stages],
                   [s.recompute for s in plan.stages])[0].time_s == pytest.approx(est.iteration_time_s, rel=0.05)


# One GPU per node on a 1 GB/s network: each stage's sends take about as long as its work,
# so a micro-batch's round trip, not the busiest stage, sets the pipeline's period.
SLOW_LINKS = {
    "1f1b-m64": dict(schedule="1f1b"),
    "zero-bubble-m64": dict(schedule="zero-bubble"),
    "interleaved-m64": dict(schedule="interleaved-1f1b", virtual_stages=2),
}


@pytest.mark.parametrize("case", SLOW_LINKS, ids=list(SLOW_LINKS))
def test_closed_form_follows_the_round_trip_when_sends_are_slow(case):
    model = models.transformer(layers=12, hidden=1024, heads=16, seq_len=1024, vocab=32000)
    cluster = Cluster.homogeneous("A100", 4, 1, inter_node_GBps=1.0)
    plan = Plan.uniform(model, cluster, tp=1, pp=4, dp=1, micro_batch=4, global_batch=256, **SLOW_LINKS[case])
    tables = Tables(model, cluster)
    sk, st = skeleton_of(plan, cluster), setting_of(plan, tables)
    figs = stage_figures(tables, sk, st, [(s.start, s.end) for s in plan.stages], [s.recompute for s in plan.stages])
    assert not simulated(st, sk.pp)   # (long enough for the closed form)
    busiest = max(sum(f.forward + f.backward for f in figs[g::sk.pp]) for g in range(sk.pp))
    sends = sum(f.send_forward for f in figs)
    assert sends > 0.5 * busiest      # the regime this case is about
    closed = pipeline_time(sk, st, figs, tables, tables.options.blocking_p2p, tables.options.overlap_grad_reduce)
    est = estimate(model, cluster, plan)
    assert closed == pytest.approx(est.iteration_time_s - est.breakdown.get("host", 0.0), rel=0.1)


@pytest.mark.parametrize("case", list(CASES) + list(LONG), ids=list(CASES) + list(LONG))
def test_work_floor_and_memory_check_agree_with_the_analysis(case):
    """The search skips costing a split whose ranks' compute alone (work_floor) is too slow,
    and then asks only whether it fits (fits_memory): the floor must be below the fast
    model's time (closed form or simulation) and the full estimate's, and the check must
    say what analyze says, here under four memory sizes from roomy to none fitting."""
    if case in CASES:
        cluster, plan, model = CASES[case]
    else:
        cluster, plan, model = CLUSTER, Plan.uniform(GPT, CLUSTER, **LONG[case]), GPT
    tables = Tables(model, cluster)
    sk, st = skeleton_of(plan, cluster), setting_of(plan, tables)
    bounds, rec = [(s.start, s.end) for s in plan.stages], [s.recompute for s in plan.stages]
    analysis, _ = analyze(tables, sk, st, bounds, rec)
    floor = work_floor(tables, sk, st, bounds, rec)
    assert 0 < floor <= analysis.time_s * (1 + 1e-9)
    assert floor <= estimate(model, cluster, plan).iteration_time_s * (1 + 1e-9)
    verdicts = []
    for scale in (1.0, 0.5, 0.1, 0.001):
        limited = Tables(model, cluster)
        limited.capacity = lambda pool, cap=tables.capacity: cap(pool) * scale
        verdicts.append(fits_memory(limited, sk, st, bounds, rec))
        assert verdicts[-1] == analyze(limited, sk, st, bounds, rec)[0].fits
    assert verdicts[-1] is False and verdicts[0] is analysis.fits


# name: (stack, sequence parallel) -> (each tensor-parallel rank sends 1/t, receivers all-gather)
PIPELINE_SENDS = {
    "whole-tensor-per-rank": ("autoplan", False, (False, False)),
    "sequence-shards": ("autoplan", True, (True, False)),
    "megatron-core-whole": ("megatron-core", False, (False, False)),
    "scatter-gather": ("megatron-lm-2021", False, (True, True)),
    "deepspeed-partitioned": ("deepspeed", False, (True, True)),
    "scatter-gather-under-sp": ("megatron-lm-2021", True, (True, False)),
}


@pytest.mark.parametrize("send", list(PIPELINE_SENDS), ids=list(PIPELINE_SENDS))
@pytest.mark.parametrize("a,b", [((4,), (6,)), ((0, 1), (2, 3)), ((0, 1, 2, 3), (4, 5, 6, 7))],
                         ids=["one-pair-cross-type", "tp2-same-node", "tp4-cross-node"])
def test_p2p_equals_the_cost_model(a, b, send):
    """The search's transfer between pipeline groups is the cost model's: what each
    tensor-parallel rank sends as the stack passes it, and the receivers' all-gather where
    it scatters and gathers; with one rank per replica nothing is split or gathered."""
    stack, sp, (split, gather) = PIPELINE_SENDS[send]
    tables = Tables(GPT, MIXED, options=EstimateOptions(stack=get_stack(stack)))
    for tp in (1, len(a)):
        src, dst = DeviceGroup(ranks=a, tp=tp), DeviceGroup(ranks=b, tp=tp)
        assert tables.stack.pipeline_send_shape(tp, sp) == ((split, gather) if tp > 1 else (True, False))
        for nbytes in (1e6, 3e7):
            expected = p2p_time(MIXED, src.tp_groups(), dst.tp_groups(), nbytes, split or tp == 1)
            if gather and tp > 1:
                expected += max(collective_time(MIXED, g, nbytes, "all_gather") for g in dst.tp_groups())
            assert tables.p2p(src, dst, nbytes, sp) == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ in flight

def counted(schedule: str, pp: int, m: int, v: int) -> list[int]:
    """Largest number of micro-batch chunks each rank holds, counted on the full program."""
    groups = tuple(DeviceGroup(ranks=(g,), tp=1) for g in range(pp))
    stages = tuple(Stage(start=j, end=j + 1, group=j % pp) for j in range(pp * v))
    prog = build_program(Plan(groups=groups, stages=stages, micro_batch=1, num_micro_batches=m,
                              schedule=schedule, virtual_stages=v))
    release = "W" if prog.split_backward else "B"
    out = []
    for actions in prog.ranks:
        live = top = 0
        for act in actions:
            live += 1 if act.kind == "F" else -1 if act.kind == release else 0
            top = max(top, live)
        out.append(top)
    return out


@pytest.mark.parametrize("schedule,pp,m,v", [
    ("1f1b", 4, 16, 1), ("gpipe", 3, 5, 1), ("zero-bubble", 4, 32, 1), ("zero-bubble", 6, 48, 1),
    ("zero-bubble", 5, 3, 1), ("interleaved-1f1b", 2, 16, 2), ("interleaved-1f1b", 4, 32, 3),
    ("interleaved-1f1b", 3, 27, 2)], ids=lambda x: str(x))
def test_inflight_summaries_match_the_full_program(schedule, pp, m, v):
    fl = inflight(schedule, pp, m, v)
    full = counted(schedule, pp, m, v)
    # With equal chunks, the peak is the vector with the most micro-batches in all.
    assert [max(sum(vec) for vec in peaks) for peaks in fl.peaks] == full
    assert [sum(j) for j in fl.joint] == full


@pytest.mark.parametrize("pp,m,v", [
    (2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 4), (3, 6, 5), (8, 16, 3), (16, 32, 2), (6, 12, 8)],
    ids=lambda x: str(x))
def test_interleaved_counts_match_the_lowered_program(pp, m, v):
    """The interleaved schedule's counts, worked out from its order, are those read off the
    lowered program action by action (every field, warm-ups longer than the program included)."""
    from search.inflight import _from_program, _interleaved
    assert _interleaved(pp, m, v) == _from_program("interleaved-1f1b", pp, m, v)


# ---------------------------------------------------------------------- DP

def all_splits(L: int, S: int):
    for cuts in itertools.combinations(range(1, L), S - 1):
        b = (0,) + cuts + (L,)
        yield [(b[i], b[i + 1]) for i in range(S)]


SPLIT_CASES = {
    "1f1b-roomy": (40.0, Setting(2, 8, "1f1b", 1, 0, False), ("none",)),
    "1f1b-tight-recompute": (3.2, Setting(2, 8, "1f1b", 1, 0, False), ("none", "selective", "full")),
    "gpipe-tight": (3.6, Setting(1, 4, "gpipe", 1, 1, False), ("none", "full")),
    "zero-bubble-zero3": (3.0, Setting(2, 4, "zero-bubble", 1, 3, False), ("none", "full")),
    # The optimizer step's temporaries (4 bytes per parameter) outgrow the compute phase on
    # the embedding's stage: the split balanced for compute alone does not fit there.
    "optimizer-step-binds-pp4": (2.7, Setting(1, 16, "1f1b", 1, 0, False), ("none", "full"), 4),
    "optimizer-step-binds-none-fits": (3.4, Setting(1, 8, "1f1b", 1, 0, False), ("none", "full")),
}


@pytest.mark.parametrize("case", SPLIT_CASES, ids=list(SPLIT_CASES))
def test_dp_finds_the_smallest_period_that_fits(case):
    memory, st, modes, pp = (SPLIT_CASES[case] + (2,))[:4]
    cluster = Cluster.from_dict({"node_groups": [{"name": "n", "nodes": 1, "gpus_per_node": 4, "device": {
        "name": "toy", "memory_GiB": memory, "peak_TFLOPS": {"bf16": 100}, "memory_bandwidth_GBps": 1000}}]})
    tables = Tables(GPT, cluster)
    per = 4 // pp
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=tuple(range(g * per, (g + 1) * per)), tp=1) for g in range(pp)),
                  kinds=(Kind(0, 1),) * pp)
    split = Splitter(tables).split(sk, st, modes)
    best = None
    for bounds in all_splits(GPT.num_layers, pp):
        for rec in itertools.product(modes, repeat=pp):
            analysis, figs = analyze(tables, sk, st, bounds, rec)
            if analysis.fits:
                period = max(f.forward + f.backward for f in figs)
                best = period if best is None else min(best, period)
    if best is None:
        assert split is None
    else:
        assert split is not None and split.period == pytest.approx(best, rel=1e-12)
        analysis, _ = analyze(tables, sk, st, split.bounds, split.recompute)
        assert analysis.fits


def _every_candidate(costs, which, start, valid, L, period, slower, weight):
    """The DP's choice among candidate periods written plainly: every candidate tried."""
    from search.split import _minsum
    best_obj, best = float("inf"), None
    for tau in [period] + [float(x) for x in slower[:3]]:
        found = _minsum(costs, which, start, valid, L, tau)
        if found is None:
            continue
        total, picks = found
        real = max(float(costs[which[j]][d - 1, e]) for j, (e, d) in enumerate(picks))
        obj = weight * real + total if weight is not None else real
        if obj < best_obj * (1 - 1e-12):
            best_obj, best = obj, (total, picks, real)
    return best


@given(units=hst.integers(3, 9), stages=hst.integers(2, 6), parts=hst.integers(1, 3), width=hst.integers(1, 9),
       weight=hst.sampled_from([None, 0, 1, 3, 20]), seed=hst.integers(0, 2 ** 31), levels=hst.integers(2, 40))
@hsettings(max_examples=300, deadline=None)
def test_pruned_candidate_periods_give_the_plain_choice(units, stages, parts, width, weight, seed, levels):
    """_least_objective skips candidate periods that provably cannot win; on random stage
    costs (few levels, so ties abound, and some runs that do not fit) it returns what
    trying every candidate returns."""
    from search.split import _least_objective, _minmax
    L, S = units, min(stages, units)
    K = min(width, L - S + 1)
    rng = np.random.default_rng(seed)
    e = np.arange(L + 1)[None, :]
    s = e - np.arange(1, K + 1)[:, None]
    start, valid = np.maximum(s, 0), s >= 0
    costs = rng.integers(1, levels + 1, size=(parts, K, L + 1)).astype(float) / levels
    costs[rng.random(costs.shape) < 0.15] = np.inf
    costs[:, ~valid] = np.inf
    which = [int(x) for x in rng.integers(0, parts, size=S)]
    period = _minmax(costs, which, start, valid, L)
    if period is None:
        return
    slower = np.unique(costs[np.isfinite(costs) & (costs > period)])
    assert _least_objective(costs, which, start, valid, L, period, slower, weight) == \
        _every_candidate(costs, which, start, valid, L, period, slower, weight)


# The DP keeps band views, shortest-run tables, chunk shares and memory-free splits
# across runs: a splitter that has answered many questions must give the answers a
# fresh one gives (every cache key is complete).
WARM_SKELETONS = {
    "homogeneous-pp4": (CLUSTER, Skeleton(groups=tuple(DeviceGroup(ranks=(4 * g, 4 * g + 1, 4 * g + 2, 4 * g + 3),
                                                                   tp=2) for g in range(4)),
                                          kinds=(Kind(0, 2),) * 4)),
    "mixed-t4-v100": (MIXED, Skeleton(groups=mixed_plan(MIXED, "1f1b", 0, "none", False).groups,
                                      kinds=(Kind(1, 2),) * 2 + (Kind(0, 2),) * 2)),
    # Memory binds here: the constrained DPs (and their caches) do the work.
    "tight-toy": (Cluster.from_dict({"node_groups": [{"name": "n", "nodes": 1, "gpus_per_node": 4, "device": {
        "name": "toy", "memory_GiB": 3.4, "peak_TFLOPS": {"bf16": 100}, "memory_bandwidth_GBps": 1000}}]}),
                  Skeleton(groups=tuple(DeviceGroup(ranks=(g * 2, g * 2 + 1), tp=1) for g in range(2)),
                           kinds=(Kind(0, 1),) * 2)),
}
WARM_SETTINGS = [Setting(b, 16 // b, sched, v, zero, b == 1) for b in (1, 4) for sched, v in
                 (("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2)) for zero in (0, 3)]


@pytest.mark.parametrize("name", WARM_SKELETONS, ids=list(WARM_SKELETONS))
def test_warm_splitter_answers_as_a_fresh_one(name):
    cluster, sk = WARM_SKELETONS[name]
    tables = Tables(GPT, cluster, options=EstimateOptions(memory_margin=0.0))
    warm = Splitter(tables)
    modes = ("none", "selective", "full")
    asked = recomputed = 0
    for st in WARM_SETTINGS:
        free = warm.free_period(sk, st, modes)
        for limit in (float("inf"), free * 1.5, free * 1.01):
            for objective, joint in (("time", False), ("time", True), ("memory", False)):
                if joint and st.virtual_stages == 1:
                    continue
                got = warm.split(sk, st, modes, objective=objective, period_limit=limit, joint=joint)
                fresh = Splitter(tables).split(sk, st, modes, objective=objective, period_limit=limit, joint=joint)
                assert (got is None) == (fresh is None), (st, limit, objective)
                if got is not None:
                    assert (got.bounds, got.recompute, got.period, got.total) == \
                        (fresh.bounds, fresh.recompute, fresh.period, fresh.total), (st, limit, objective)
                    asked += 1
                    recomputed += any(r != "none" for r in got.recompute)
    assert asked > 0
    if name.startswith("tight"):
        assert recomputed > 0   # the case exercises the memory-constrained DP


def _toy(memory_GiB: float) -> Cluster:
    return Cluster.from_dict({"node_groups": [{"name": "n", "nodes": 1, "gpus_per_node": 4, "device": {
        "name": "toy", "memory_GiB": memory_GiB, "peak_TFLOPS": {"bf16": 100}, "memory_bandwidth_GBps": 1000}}]})


# (model, cluster, skeleton, settings) the DP must answer the same with and without the
# no-split test. In "head-binds" the head's unit fits only the last stages: a stage that
# cannot take a unit where its predecessors could reach may still end before it.
REACH_CASES = {
    "homogeneous-pp4": (GPT,) + WARM_SKELETONS["homogeneous-pp4"] + (WARM_SETTINGS,),
    "tight-toy": (GPT,) + WARM_SKELETONS["tight-toy"] + (WARM_SETTINGS,),
    "head-binds": (models.transformer(layers=14, hidden=1024, heads=16, seq_len=1024, vocab=128000), _toy(5.75),
                   Skeleton(groups=tuple(DeviceGroup(ranks=(g,), tp=1) for g in range(4)), kinds=(Kind(0, 1),) * 4),
                   [Setting(1, 16, sched, v, zero, False) for sched, v in
                    (("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2)) for zero in (0, 3)]),
}


@pytest.mark.parametrize("name", REACH_CASES, ids=list(REACH_CASES))
def test_no_split_test_never_rules_out_a_split_the_dp_finds(name, monkeypatch):
    """Splitter._out_of_reach spares DPs it proves fruitless: every answer must be the one
    the DP gives when it always runs."""
    model, cluster, sk, settings = REACH_CASES[name]
    tables = Tables(model, cluster, options=EstimateOptions(memory_margin=0.0))
    modes = ("none", "selective", "full")
    checked, always = Splitter(tables), Splitter(tables)
    monkeypatch.setattr(always, "_out_of_reach", lambda *args: False)
    for st in settings:
        free = checked.free_period(sk, st, modes)
        for limit in (float("inf"), free * 1.5, free * 1.01):
            for joint in ((False, True) if st.virtual_stages > 1 else (False,)):
                got = checked.split(sk, st, modes, period_limit=limit, joint=joint)
                want = always.split(sk, st, modes, period_limit=limit, joint=joint)
                assert (got is None) == (want is None), (st, limit)
                if got is not None:
                    assert (got.bounds, got.recompute, got.period, got.total) == \
                        (want.bounds, want.recompute, want.period, want.total), (st, limit)
    assert always.unreached == 0
    if name != "homogeneous-pp4":
        assert checked.unreached > 0   # the test fired, and spared DPs that found nothing


# -------------------------------------------------------------------- bounds

@pytest.mark.parametrize("schedule,b,zero,memory,network,tightness", [
    ("1f1b", 1, 0, 40.0, 10, 0.3), ("1f1b", 2, 1, 5.0, 10, 0.3), ("gpipe", 1, 0, 6.0, 10, 0.3),
    ("zero-bubble", 1, 3, 4.5, 10, 0.3), ("interleaved-1f1b", 1, 2, 40.0, 10, 0.3),
    # ZeRO-3 on a slow network: the two gathers and the scatter of every stage decide, and
    # the bound counts them all (counting one gather, it stayed near 0.54 of the best split).
    ("1f1b", 1, 3, 40.0, 0.5, 0.7), ("interleaved-1f1b", 1, 3, 40.0, 0.5, 0.7)], ids=lambda x: str(x))
def test_time_bound_is_below_every_split(schedule, b, zero, memory, network, tightness):
    cluster = Cluster.from_dict({"inter_node": {"bandwidth_GBps": network}, "node_groups": [
        {"name": "n", "nodes": 2, "gpus_per_node": 2, "device": {
            "name": "toy", "memory_GiB": memory, "peak_TFLOPS": {"bf16": 100}, "memory_bandwidth_GBps": 1000}}]})
    tables = Tables(GPT, cluster)
    modes = tuple(RECOMPUTES)
    bounds_ = Bounds(tables, modes, global_batch=16)
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=(2 * g, 2 * g + 1), tp=1) for g in range(2)), kinds=(Kind(0, 1),) * 2)
    v = 2 if schedule == "interleaved-1f1b" else 1
    st = Setting(b, 16 // (2 * b), schedule, v, zero, False)
    lower = bounds_.time_bound(0, sk, st)
    times = []
    for bounds in all_splits(GPT.num_layers, 2 * v):
        for rec in itertools.product(("none", "full"), repeat=2 * v):
            analysis, _ = analyze(tables, sk, st, bounds, rec)
            if analysis.fits:
                times.append(analysis.time_s)
    assert times, "the case must have fitting plans"
    assert lower <= min(times) * (1 + 1e-9)
    assert lower >= tightness * min(times), "a bound this loose would prune nothing"


ITEM_CASES = {
    # name: (cluster, skeleton, global batch)
    "homogeneous-pp2": (CLUSTER, Skeleton(groups=tuple(DeviceGroup(ranks=tuple(range(8 * g, 8 * g + 8)), tp=2)
                                                       for g in range(2)), kinds=(Kind(0, 2),) * 2), 64),
    "homogeneous-pp4": WARM_SKELETONS["homogeneous-pp4"] + (32,),
    "mixed-t4-v100": WARM_SKELETONS["mixed-t4-v100"] + (32,),
    "tight-toy": WARM_SKELETONS["tight-toy"] + (16,),
}


@pytest.mark.parametrize("name", ITEM_CASES, ids=list(ITEM_CASES))
def test_item_bound_is_below_every_setting_of_the_item(name):
    """Bounds.item_bound stands for every setting of a skeleton at one micro-batch size and
    sequence-parallel setting (every schedule, virtual-stage count and ZeRO stage the
    search tries there): never above any of their time bounds, and, counting the
    pipeline's fill, tighter than micro_batch_bound somewhere."""
    from search.core import _Search
    from search.space import Constraints
    cluster, sk, gb = ITEM_CASES[name]
    s = _Search(GPT, cluster, gb, Constraints.build(progress=False))
    s.modes = tuple(RECOMPUTES)
    bounds_ = Bounds(s.tables, s.modes, gb)
    tighter = 0
    for b in s.mb_options(sk.dp):
        for sp in s.sequence_parallel(sk):
            item = bounds_.item_bound(0, sk, b, sp, list(s._pipelinings(sk.pp, sk.dp, b)),
                                      max(s.zero_options(sk.shards)))
            each = [bounds_.time_bound(0, sk, replace(st, zero=z))
                    for st, zs in s.settings(sk, b, sp) for z in zs]
            assert item <= min(each, default=float("inf")), (b, sp)
            tighter += item > bounds_.micro_batch_bound(0, sk, b, sp) * (1 + 1e-9)
    assert tighter > 0


DEEP = models.transformer(layers=10, hidden=1024, heads=16, seq_len=1024, vocab=2048, name="deep-10x1024")
"""Blocks dominate (a small vocabulary): memory_period's relaxation bites."""
DEVICE_ONLY = EstimateOptions(stack=replace(get_stack("autoplan"), host_s_per_kernel=0.0, host_s_per_step=0.0))
"""The default stack without its host costs (costmodel.host)."""


MEMORY_PERIOD_CASES = {
    # name: (schedule, virtual stages, micro-batch, ZeRO, GiB per GPU, recompute modes, memory binds)
    "1f1b-roomy": ("1f1b", 1, 2, 1, 40.0, ("none", "selective", "full"), False),
    "1f1b-tight": ("1f1b", 1, 2, 0, 3.2, ("none", "selective", "full"), True),
    "gpipe-tight": ("gpipe", 1, 1, 0, 3.5, ("none", "selective", "full"), True),
    "zero-bubble-tight": ("zero-bubble", 1, 2, 0, 3.2, ("none", "selective", "full"), True),
    "zero-bubble-zero3": ("zero-bubble", 1, 1, 3, 4.5, ("none", "selective", "full"), False),
    "interleaved-tight": ("interleaved-1f1b", 2, 2, 0, 3.2, ("none", "full"), True),
    "interleaved-roomy": ("interleaved-1f1b", 2, 1, 2, 40.0, ("none", "full"), False),
    # Two device kinds (the second slower, with its own memory): each rank's own line.
    "mixed-1f1b-tight": ("1f1b", 1, 2, 0, (3.2, 4.0), ("none", "selective", "full"), True),
    "mixed-gpipe-tight": ("gpipe", 1, 1, 0, (4.0, 3.5), ("none", "selective", "full"), True),
    "mixed-zero-bubble-zero1": ("zero-bubble", 1, 2, 1, (3.6, 3.2), ("none", "full"), True),
    "mixed-1f1b-roomy": ("1f1b", 1, 2, 1, (40.0, 20.0), ("none", "selective", "full"), False),
}


@pytest.mark.parametrize("name", MEMORY_PERIOD_CASES, ids=list(MEMORY_PERIOD_CASES))
def test_memory_period_is_below_every_fitting_split(name):
    """Bounds.memory_period never exceeds the busiest rank's work of a split that fits, and
    the time bound floored by it never exceeds the split's time (every split and
    recomputation enumerated); where memory binds, it tightens the time bound."""
    schedule, v, b, zero, memory, modes, binds = MEMORY_PERIOD_CASES[name]
    sizes = memory if isinstance(memory, tuple) else (memory,)
    cluster = Cluster.from_dict({"inter_node": {"bandwidth_GBps": 10}, "node_groups": [
        {"name": f"n{i}", "nodes": 2 // len(sizes), "gpus_per_node": 2, "device": {
            "name": f"toy{i}", "memory_GiB": gib, "peak_TFLOPS": {"bf16": 100 - 40 * i}, "memory_bandwidth_GBps": 1000}}
        for i, gib in enumerate(sizes)]})
    # (Device time only: on these toy GPUs the stack's host would dwarf what memory forces.)
    tables = Tables(DEEP, cluster, options=DEVICE_ONLY)
    bounds_ = Bounds(tables, modes, global_batch=16)
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=(2 * g, 2 * g + 1), tp=1) for g in range(2)),
                  kinds=tuple(Kind(g if len(sizes) > 1 else 0, 1) for g in range(2)))
    st = Setting(b, 16 // (2 * b), schedule, v, zero, False)
    floor = bounds_.memory_period(sk, st)
    timed = bounds_.time_bound(0, sk, st, period_floor=floor)
    busiest, times = [], []
    for split in all_splits(DEEP.num_layers, 2 * v):
        for rec in itertools.product(modes, repeat=2 * v):
            analysis, figs = analyze(tables, sk, st, split, rec)
            if analysis.fits:
                busiest.append(max(sum(f.forward + f.backward for f in figs[g::2]) for g in range(2)))
                times.append(analysis.time_s)
    assert times, "the case must have fitting plans"
    assert 0.0 < floor <= min(busiest) * (1 + 1e-9)
    assert timed <= min(times) * (1 + 1e-9)
    unfloored = bounds_.time_bound(0, sk, st)
    assert timed > unfloored * 1.01 if binds else timed >= unfloored


SHARE_PERIOD_CASES = {
    # name: (virtual stages, micro-batch, ZeRO, GiB per GPU, recompute modes, memory binds)
    "v2-tight": (2, 2, 0, 3.6, ("none", "selective", "full"), True),
    "v2-zero1": (2, 1, 1, 3.2, ("none", "selective", "full"), True),
    "v3-tight": (3, 2, 0, 3.6, ("none", "full"), True),
    "v3-zero1": (3, 1, 1, 3.2, ("none", "full"), True),
    "v2-roomy": (2, 1, 2, 40.0, ("none", "full"), False),
    "v2-no-split": (2, 2, 0, 3.2, ("none", "selective", "full"), None),
    "v2-mixed": (2, 2, 0, (3.6, 4.4), ("none", "selective", "full"), True),
    "v3-mixed-zero1": (3, 1, 1, (3.2, 4.0), ("none", "full"), True),
}


@pytest.mark.parametrize("name", SHARE_PERIOD_CASES, ids=list(SHARE_PERIOD_CASES))
def test_share_period_is_below_every_split_within_chunk_budgets(name):
    """Bounds.share_period never exceeds the busiest rank's work of an interleaved split whose
    every chunk fits the budget the DP gives it (every split and per-chunk recomputation
    enumerated, for both in-flight counts the DP uses); where memory binds, it is tighter
    than memory_period and the memory-free work; where no split fits, it is INF."""
    v, b, zero, memory, modes, binds = SHARE_PERIOD_CASES[name]
    # (Two memory sizes: a pipeline of two device kinds, the second one slower.)
    sizes = memory if isinstance(memory, tuple) else (memory,)
    cluster = Cluster.from_dict({"inter_node": {"bandwidth_GBps": 10}, "node_groups": [
        {"name": f"n{i}", "nodes": 2 // len(sizes), "gpus_per_node": 2, "device": {
            "name": f"toy{i}", "memory_GiB": gib, "peak_TFLOPS": {"bf16": 100 - 40 * i}, "memory_bandwidth_GBps": 1000}}
        for i, gib in enumerate(sizes)]})
    tables = Tables(DEEP, cluster, options=DEVICE_ONLY)   # (device periods against the time bound)
    bounds_, splitter = Bounds(tables, modes, global_batch=16), Splitter(tables)
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=(2 * g, 2 * g + 1), tp=1) for g in range(2)),
                  kinds=tuple(Kind(g if len(sizes) > 1 else 0, 1) for g in range(2)))
    st = Setting(b, 16 // (2 * b), "interleaved-1f1b", v, zero, False)
    qs = [RECOMPUTES.index(m) for m in modes]
    S = 2 * v
    for joint in (True, False):
        counts, budgets = splitter.chunk_budgets(sk, st, modes, joint)
        floor = bounds_.share_period(sk, st, counts, budgets)
        busiest = []
        for split in all_splits(DEEP.num_layers, S):
            # Per stage, the modes in which it fits its chunk's budget (as the DP checks).
            fitting = []
            for j, (a, e) in enumerate(split):
                g, chunk = j % 2, j // 2
                base, act = splitter._states_mats(sk, g, st)
                fitting.append([q for q in qs if base[q][a, e] + counts[g][chunk] * act[q][a, e] <= budgets[g][chunk]])
            for rec in itertools.product(*fitting):
                work = [0.0, 0.0]
                for j, ((a, e), q) in enumerate(zip(split, rec)):
                    work[j % 2] += float(splitter._time_mats(sk, j % 2, st)[q][a, e])
                busiest.append(max(work))
        found = splitter.split(sk, st, modes, joint=joint)
        if binds is None:
            # No split within the budgets: the bound says so, and so does the DP.
            assert not busiest and found is None and floor == float("inf")
            continue
        assert busiest, "the case must have splits within the chunk budgets"
        assert found is not None
        assert 0.0 < floor <= min(busiest) * (1 + 1e-9)
        if binds:
            assert floor > bounds_.memory_period(sk, st) * 1.01   # (0 on mixed pipelines)
            assert floor > min(bounds_.time_bound(0, sk, st) / st.num_micro_batches, splitter.free_period(
                sk, st, modes) * v)


def test_skipping_chunk_dps_keeps_the_search_result(monkeypatch):
    """Interleaved candidates whose DP splits the share bound rules out skip their DPs; the
    search returns the same plans as with every DP run."""
    import search as search_pkg
    model = models.get("llama2-13b")
    cluster = Cluster.homogeneous("A100-80GB", 4, 8, inter_node_GBps=25)
    fast = search_pkg.search(model, cluster, 256, progress=False)
    assert fast.stats.skipped_chunk_dps > 0, "the case must exercise the skip"
    monkeypatch.setattr(Bounds, "share_period", lambda self, sk, st, counts, budgets: 0.0)
    full = search_pkg.search(model, cluster, 256, progress=False)
    assert full.stats.skipped_chunk_dps == 0
    assert [p.plan for p in fast.ranked] == [p.plan for p in full.ranked]
    assert [p.estimate.iteration_time_s for p in fast.ranked] == [p.estimate.iteration_time_s for p in full.ranked]


def test_memory_period_says_when_nothing_fits():
    """Too little memory for the states and one micro-batch anywhere: INF, and no split fits."""
    cluster = Cluster.from_dict({"node_groups": [{"name": "n", "nodes": 1, "gpus_per_node": 2, "device": {
        "name": "toy", "memory_GiB": 1.0, "peak_TFLOPS": {"bf16": 100}, "memory_bandwidth_GBps": 1000}}]})
    tables = Tables(GPT, cluster)
    modes = tuple(RECOMPUTES)
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=(g,), tp=1) for g in range(2)), kinds=(Kind(0, 1),) * 2)
    st = Setting(1, 8, "1f1b", 1, 0, False)
    assert Bounds(tables, modes, global_batch=8).memory_period(sk, st) == float("inf")
    assert not any(analyze(tables, sk, st, split, rec)[0].fits for split in all_splits(GPT.num_layers, 2)
                   for rec in itertools.product(modes, repeat=2))


# ----------------------------------------------------------------- placement

def test_placement_is_deterministic_and_respects_the_cluster():
    model = models.get("gpt3-1.3b")
    cluster = Cluster.load("examples/clusters/mixed-v100-t4.json")
    tables = Tables(model, cluster)
    runs = []
    for _ in range(2):
        stats = PlacementStats()
        proposals = place(tables, dp=2, micro_batch=1, num_micro_batches=32, sequence_parallel=True,
                          kinds=pool_kinds(tables, 2, [1, 2, 4, 8]), zeros=[0, 1, 2, 3], modes=["none", "full"],
                          max_stages=32, use_all_gpus=False, alternatives=3, det_time_limit=1.0, seed=0,
                          stats=stats)
        # One model sized for ZeRO-2 (the leanest short of 3) and one for ZeRO-3.
        assert len(proposals) == 2
        found = []
        for props in proposals:
            first = list(props.found)
            more = props.more()
            # The optimum's sequences come first; the alternatives add to them.
            assert first and more[:len(first)] == first and props.estimate_s > 0
            found += more
        runs.append([(sk.groups, sk.kinds) for sk in found])
        assert 2 <= stats.solves <= 6 and stats.skeletons == len(found) > 0
    assert runs[0] == runs[1]
    for groups, kinds in runs[0]:
        used = {}
        for g, k in zip(groups, kinds):
            assert {cluster.slots[r].group for r in g.ranks} == {k.pool}   # one device type per group
            assert g.dp == 2 and cluster.groups[k.pool].gpus_per_node % g.tp == 0
            used[k.pool] = used.get(k.pool, 0) + len(g.ranks)
        assert all(n <= cluster.groups[p].num_gpus for p, n in used.items())
        assert len({r for g in groups for r in g.ranks}) == sum(len(g.ranks) for g in groups)


@pytest.mark.parametrize("name,dp,zeros,fits", [
    ("gpt3-1.3b", 1, [0], True),
    ("gpt3-1.3b", 2, [0, 1, 2, 3], True),
    ("gpt3-13b", 4, [1, 3], True),
    ("gpt3-175b", 2, [0, 3], False),
], ids=["1.3b-dp1", "1.3b-dp2-both-sizings", "13b-dp4-both-sizings", "175b-holds-nowhere"])
def test_placement_floor_is_below_its_optimum(name, dp, zeros, fits):
    """The floor a model knows before any solve (it decides which models go unsolved)
    never exceeds its optimum, and is infinite where the devices cannot hold the model."""
    tables = Tables(models.get(name), Cluster.load("examples/clusters/mixed-v100-t4.json"))
    for props in sizings(tables, dp=dp, micro_batch=1, num_micro_batches=64 // dp, sequence_parallel=True,
                         kinds=pool_kinds(tables, dp, [1, 2, 4, 8]), zeros=zeros, modes=["none", "full"],
                         max_stages=32, use_all_gpus=False, alternatives=1, det_time_limit=1.0, seed=0,
                         stats=PlacementStats()):
        assert props.first() == fits
        if fits:
            assert 0 < props.floor_s <= props.estimate_s
        else:
            assert props.floor_s == float("inf") and props.estimate_s is None


def test_placement_can_be_forced_to_use_every_gpu():
    model = models.get("gpt3-1.3b")
    cluster = Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    tables = Tables(model, cluster)
    found = place(tables, dp=2, micro_batch=1, num_micro_batches=8, sequence_parallel=False,
                  kinds=pool_kinds(tables, 2, [1, 2]), zeros=[0], modes=["none", "full"], max_stages=8,
                  use_all_gpus=True, alternatives=2, det_time_limit=1.0, seed=0, stats=PlacementStats())[0].more()
    assert found and all(sk.num_gpus == cluster.num_gpus for sk in found)


def _toy_mixed(big_GiB: float, small_GiB: float) -> Cluster:
    device = lambda name, mem: {"name": name, "memory_GiB": mem, "peak_TFLOPS": {"bf16": 100},  # noqa: E731
                                "memory_bandwidth_GBps": 1000}
    return Cluster.from_dict({"inter_node": {"bandwidth_GBps": 10}, "node_groups": [
        {"name": "big", "nodes": 1, "gpus_per_node": 4, "device": device("toy-big", big_GiB)},
        {"name": "small", "nodes": 1, "gpus_per_node": 4, "device": device("toy-small", small_GiB)}]})


@pytest.mark.parametrize("big,small", [(2.4, 1.6), (4.0, 1.2)], ids=lambda x: f"{x}GiB")
def test_mixed_memory_prune_never_drops_a_split_that_fits(big, small):
    """runs_cover() prunes a mixed pipeline's setting before any DP: only where no split
    (over every recompute choice) fits."""
    from search.core import _Search
    from search.space import Constraints
    cluster = _toy_mixed(big, small)
    s = _Search(GPT, cluster, 12, Constraints.build(progress=False))
    sk = Skeleton(groups=(DeviceGroup(ranks=(0, 1), tp=1), DeviceGroup(ranks=(4, 5), tp=1),
                          DeviceGroup(ranks=(2, 3), tp=1)), kinds=(Kind(0, 1), Kind(1, 1), Kind(0, 1)))
    modes = ("none", "full")
    s.modes = modes
    pruned = kept = 0
    for b, (sched, v), zero in itertools.product((1, 2), (("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1),
                                                        ("interleaved-1f1b", 2)), (0, 3)):
        st = Setting(b, 12 // b, sched, v, zero, False)
        if s.runs_cover(sk, st):
            kept += 1
            continue
        pruned += 1
        for bounds in all_splits(GPT.num_layers, 3 * v):
            for rec in itertools.product(modes, repeat=3 * v):
                assert not analyze(s.tables, sk, st, bounds, rec)[0].fits, (st, bounds, rec)
    assert pruned > 0 and kept > 0, "the case must exercise both outcomes"


COVER_MEMORY = {"roomy": (6.0, 4.0), "tight": (2.4, 1.6), "lopsided": (4.0, 1.2), "scarce": (1.6, 1.0)}


def test_zero_stages_that_cover_are_found_by_bisection():
    """_covering_zeros() asks runs_cover() about fewer ZeRO stages than there are, trusting
    that from stage 0 to 2 a stage that covers leaves every higher one covering: the
    answer equals asking about each stage, and the trust holds on clusters from roomy to
    scarce (with data parallelism, so the stages really shard)."""
    from search.core import _Search
    from search.space import Constraints
    partial = 0
    for name, (big, small) in COVER_MEMORY.items():
        s = _Search(GPT, _toy_mixed(big, small), 12, Constraints.build(progress=False))
        s.modes = ("none", "full")
        sk = Skeleton(groups=(DeviceGroup(ranks=(0, 1), tp=1), DeviceGroup(ranks=(4, 5), tp=1)),
                      kinds=(Kind(0, 1), Kind(1, 1)))
        for b, (sched, v) in itertools.product((1, 3), (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2))):
            st = Setting(b, 6 // b, sched, v, 0, False)
            each = {z: s.runs_cover(sk, replace(st, zero=z)) for z in (0, 1, 2, 3)}
            assert [each[z] for z in (0, 1, 2)] == sorted(each[z] for z in (0, 1, 2)), (name, st, each)
            partial += len({each[0], each[2]}) > 1
            for zeros in ((0, 1, 2, 3), (0, 1, 2), (1, 2), (2,), (0, 3), (3,)):
                expected = tuple(z if each[z] else None for z in zeros)
                assert s._covering_zeros(sk, st, zeros) == expected, (name, st, zeros)
    assert partial > 0, "some case must cover under a higher ZeRO stage only"


def test_setting_replace_keeps_other_fields():
    st = Setting(1, 8, "1f1b", 1, 0, False)
    assert replace(st, zero=3).zero == 3 and replace(st, zero=3).num_micro_batches == 8


# ------------------------------------------------------- collectives by shape

SHAPE_CLUSTERS = {
    "homogeneous-8-per-node": Cluster.homogeneous("A100-80GB", 4, 8, inter_node_GBps=25),
    "mixed-v100-t4": Cluster.load("examples/clusters/mixed-v100-t4.json"),
}


@pytest.mark.parametrize("name", SHAPE_CLUSTERS, ids=list(SHAPE_CLUSTERS))
def test_collectives_read_by_shape_equal_the_cost_model(name):
    """Tables asks collective_time once per group shape; every group of that shape must
    cost what the cost model says for it (evenly spaced groups, odd ones, across node groups)."""
    from costmodel.comm import collective_time
    cluster = SHAPE_CLUSTERS[name]
    tables = Tables(GPT, cluster)
    n = cluster.num_gpus
    groups = [tuple(range(s, n, step))[:count] for s in range(0, 12, 3) for step in (1, 2, 4, 8)
              for count in (2, 3, 4, 8) if len(range(s, n, step)) >= count]
    groups += [(0, 5, 6, 19), (1, 2, 17, 30), (n - 1, 0), tuple(range(n))]
    for ranks in groups:
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            alpha, beta = tables.affine(ranks, kind)
            for nbytes in (1e6, 7e8):
                assert alpha + beta * nbytes == pytest.approx(collective_time(cluster, ranks, nbytes, kind),
                                                              rel=1e-9), (ranks, kind)


def test_progress_bar_ticks_during_a_long_step():
    """While one step runs long (a CP-SAT solve), the bar is redrawn with the elapsed
    time, so it never looks frozen; after close() nothing more is written."""
    import io
    import time

    from search import progress as P

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = P.Progress(True, stream=stream)
    bar.phase("placement", 3)
    # No step() meanwhile. Waits for the redraws with room to spare (a busy machine delays
    # the ticker thread; it must not make the test fail).
    deadline = time.monotonic() + 40 * P.TICK_S
    while stream.getvalue().count("\rsearch placement") < 3 and time.monotonic() < deadline:
        time.sleep(P.TICK_S / 5)
    draws = stream.getvalue().count("\rsearch placement")
    bar.close()
    assert draws >= 3, stream.getvalue()
    assert "s" in stream.getvalue().split("0/3")[-1]
    after = stream.getvalue()
    time.sleep(2 * P.TICK_S)
    assert stream.getvalue() == after


# name: (stack, recompute, what ZeRO-3 gathers at a time, whether its collectives overlap the
# compute, gathers per micro-batch)
ZERO3_ENGINES = {
    "fsdp-overlapped-layer-gathers": ("autoplan", "none", "layer", True, 2),
    "fsdp-recomputed-inside-the-backward-gather": ("autoplan", "full", "layer", True, 2),
    "deepspeed-2021-serial-module-gathers": ("deepspeed-2021", "none", "module", False, 2),
    "deepspeed-2021-recompute-gathers-again": ("deepspeed-2021", "full", "module", False, 3),
}


@pytest.mark.parametrize("name", list(ZERO3_ENGINES), ids=list(ZERO3_ENGINES))
def test_zero3_gathers_as_the_stack_runs_them(name):
    """ZeRO-3 per stack: an engine that synchronizes the device around its gathers
    (DeepSpeed of 2021) pays every gather and reduce-scatter on top of the compute, one
    that prefetches hides them where it can. Each gather unit is a collective of its own,
    paying the latency again and the stack's own work per rank of the group; DeepSpeed
    gathers a module again for its recomputed forward. The working set is two gathers of
    what it gathers at a time. The search's figures and memory equal the cost model's."""
    stack_name, recompute, unit, overlapped, passes = ZERO3_ENGINES[name]
    stack = get_stack(stack_name)
    assert (stack.zero3_gather_unit, stack.overlap_zero3) == (unit, overlapped)
    assert zero3_gather_passes(stack, recompute) == passes
    options = EstimateOptions(stack=stack)
    plan = Plan.uniform(GPT, CLUSTER, tp=1, pp=1, dp=16, micro_batch=1, global_batch=64, zero=3, recompute=recompute)
    zero3 = stage_costs(GPT, CLUSTER, plan, options)[0]
    zero1 = stage_costs(GPT, CLUSTER, replace(plan, zero=1), options)[0]
    params = sum(layer.params.at(1) for layer in GPT.layers)
    dp_group = plan.groups[0].dp_groups()[0]
    gathers, scatters = zero3_collectives(GPT.layers, stack)
    # Per module: every weight matrix gathered, every parameter tensor (biases and norm
    # scales too) reduce-scattered on its own; per unit: one of each.
    if unit == "module":
        assert gathers == sum(layer.weight_tensors() for layer in GPT.layers)
        assert scatters == sum(layer.param_tensors for layer in GPT.layers) > gathers
    else:
        assert gathers == scatters == len(GPT.layers)
    per_rank = 16 * zero3_rank_overhead(stack, CLUSTER.groups[0].device)
    assert (per_rank > 0) == (stack_name == "deepspeed-2021")
    gather = (collective_time(CLUSTER, dp_group, params * stack.gathered_weights_bytes_per_param, "all_gather")
              + (gathers - 1) * collective_latency(CLUSTER, dp_group, "all_gather") + gathers * per_rank)
    scatter = (collective_time(CLUSTER, dp_group, params * stack.grad_reduce_bytes_per_param, "reduce_scatter")
               + (scatters - 1) * collective_latency(CLUSTER, dp_group, "reduce_scatter") + scatters * per_rank)
    if overlapped:
        assert zero3.forward == pytest.approx(max(zero1.forward, gather), rel=1e-12)
    else:
        assert zero3.forward == pytest.approx(zero1.forward + gather, rel=1e-12)
        assert zero3.backward >= zero1.backward + (passes - 1) * gather + scatter
    tables = Tables(GPT, CLUSTER, options=options)
    analysis, figs = analyze(tables, skeleton_of(plan, CLUSTER), setting_of(plan, tables), [(0, GPT.num_layers)],
                             [recompute])
    assert figs[0].forward == pytest.approx(zero3.forward, rel=1e-12)
    assert figs[0].backward == pytest.approx(zero3.backward, rel=1e-12)
    est = estimate(GPT, CLUSTER, plan, stack=stack)
    assert analysis.memory[0] == pytest.approx(est.memory_by_group[0].total, rel=1e-9)
    assert analysis.time_s == pytest.approx(est.iteration_time_s, rel=1e-9)
    # The working set: two of the largest gathers.
    gathered = max(layer.largest_weight(1) if unit == "module" else layer.params.at(1) for layer in GPT.layers)
    sharded = est.memory_by_group[0].weights - 2 * gathered * stack.gathered_weights_bytes_per_param
    assert sharded == pytest.approx(params / 16 * stack.weights_bytes_per_param, rel=1e-9)


# DeepSpeed's BF16 optimizer (stack megatron-deepspeed): its kept bf16 gradients and the bf16
# copy its gradient all-reduce makes. Full recomputation keeps the activations small, so
# the copy after the backward sets the peak where there is a reduction to make.
GRADIENT_COPY_CASES = {
    "dp2-zero1-copy-sets-the-peak": dict(tp=1, pp=1, dp=2, zero=1, recompute="full"),
    "dp1-nothing-to-reduce": dict(tp=1, pp=1, dp=1, zero=0, recompute="full"),
    "dp2-zero2-scatters-in-buckets": dict(tp=1, pp=1, dp=2, zero=2, recompute="full"),
    "tp2-pp2-dp2-activations-set-the-peak": dict(tp=2, pp=2, dp=2, zero=1, recompute="none"),
}


@pytest.mark.parametrize("name", list(GRADIENT_COPY_CASES), ids=list(GRADIENT_COPY_CASES))
def test_gradient_copies_weigh_alike_in_search_and_estimate(name):
    case = GRADIENT_COPY_CASES[name]
    stack = get_stack("megatron-deepspeed")
    cluster = Cluster.homogeneous("A100-SXM4-80GB", 1, 8)
    plan = Plan.uniform(GPT, cluster, micro_batch=1, global_batch=16, **case)
    options = EstimateOptions(stack=stack)
    tables = Tables(GPT, cluster, options=options)
    sk, st = skeleton_of(plan, cluster), setting_of(plan, tables)
    analysis, _ = analyze(tables, sk, st, [(s.start, s.end) for s in plan.stages], [s.recompute for s in plan.stages])
    est = estimate(GPT, cluster, plan, stack=stack)
    for mine, theirs in zip(analysis.memory, est.memory_by_group):
        assert mine == pytest.approx(theirs.total, rel=1e-9)
    group = est.memory_by_group[0]
    params = sum(layer.params.at(plan.groups[0].tp) for layer in GPT.layers[plan.stages[0].start:plan.stages[0].end])
    copy = params * stack.grad_reduce_copy_bytes_per_param
    if name == "dp2-zero1-copy-sets-the-peak":
        assert group.transient + group.activations == pytest.approx(copy, rel=1e-9)
    elif name == "tp2-pp2-dp2-activations-set-the-peak":
        assert group.transient + group.activations > copy
    else:
        assert group.transient + group.activations < copy
    # The bf16 gradients the optimizer keeps sit beside its fp32 buffer until ZeRO-2 shards both.
    shards = plan.zero >= 2 and plan.groups[0].dp or 1
    assert group.gradients == pytest.approx(params * 6 / shards, rel=1e-9)
