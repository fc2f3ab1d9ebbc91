"""Timeline and memory figures: what they draw matches the estimate they are drawn from."""
from __future__ import annotations

from functools import cache

import pytest

import autoplan
from autoplan.cluster import Cluster
from autoplan.plan import Plan
from autoplan.plots import plot_memory, plot_memory_grid, plot_timeline, plot_timelines, timeline_data
from autoplan.units import GiB

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
A100x8 = Cluster.homogeneous("A100", 1, 8)


@cache
def spec(name="gpt3-350m"):
    return autoplan.models.get(name)


def est(cluster=A100x8, name="gpt3-350m", **kw):
    kw.setdefault("micro_batch", 1)
    plan = Plan.uniform(spec(name), cluster, **kw)
    return autoplan.estimate(spec(name), cluster, plan)


TIMELINES = {
    "1f1b-pp4": dict(kw=dict(tp=1, pp=4, dp=2, global_batch=16), kinds={"F", "B", "optimizer"},
                     p2p=True, reduce=True, tp=False),
    "gpipe-pp2-tp2": dict(kw=dict(tp=2, pp=2, dp=2, global_batch=8, schedule="gpipe"),
                          kinds={"F", "B", "optimizer"}, p2p=True, reduce=True, tp=True),
    "zero-bubble-pp4": dict(kw=dict(tp=2, pp=4, dp=1, global_batch=8, schedule="zero-bubble"),
                            kinds={"F", "I", "W", "optimizer"}, p2p=True, reduce=False, tp=True),
    "interleaved-pp2-v2": dict(kw=dict(tp=1, pp=2, dp=4, global_batch=16, schedule="interleaved-1f1b",
                                       virtual_stages=2), kinds={"F", "B", "optimizer"}, p2p=True, reduce=True,
                               tp=False),
    "data-parallel-only": dict(kw=dict(tp=1, pp=1, dp=8, global_batch=16), kinds={"F", "B", "optimizer"},
                               p2p=False, reduce=True, tp=False),
}


@pytest.mark.parametrize("case", TIMELINES.values(), ids=list(TIMELINES))
def test_timeline_rows_match_the_simulation(case, tmp_path):
    e = est(**case["kw"])
    plan = e.plan
    data = plot_timeline(e, tmp_path / "t.png", "test")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    assert data.ranks == plan.pp and set(data.compute) == set(range(plan.pp))
    kinds = {k for rows in data.compute.values() for k, *_ in rows}
    assert kinds == case["kinds"]
    # Every compute action of the program appears once on its own rank.
    per_mb = 3 if "I" in kinds else 2
    for g in range(plan.pp):
        actions = [r for r in data.compute[g] if r[0] != "optimizer"]
        assert len(actions) == per_mb * plan.num_micro_batches * plan.virtual_stages
        assert all(plan.stages[s].group == g for _, s, *_ in actions)
        # Busy plus idle covers the rank up to its last compute action: bubbles are explicit.
        last = max(b for *_, b in actions)
        busy = sum(b - a for *_, a, b in actions)
        assert busy + data.idle_time(g) == pytest.approx(last, rel=1e-9)
    comm = {k for rows in data.comm.values() for k, *_ in rows}
    assert ("p2p" in comm) == case["p2p"]
    assert ("reduce" in comm) == case["reduce"]
    assert any(data.tp_comm.values()) == case["tp"]
    if plan.pp > 1:
        # The first rank waits for the pipeline to fill and drain: it has a bubble.
        assert data.idle_time(0) > 0


def test_bubble_shrinks_with_more_micro_batches():
    few = timeline_data(est(tp=1, pp=4, dp=2, global_batch=8))
    many = timeline_data(est(tp=1, pp=4, dp=2, global_batch=64))
    assert few.idle_time(0) / few.end > many.idle_time(0) / many.end


def test_stacked_timelines_share_one_axis(tmp_path):
    a, b = est(tp=1, pp=4, dp=2, global_batch=16), est(tp=1, pp=1, dp=8, global_batch=16)
    out = plot_timelines([(a, "searched"), (b, "baseline")], tmp_path / "two.png")
    assert [d.ranks for d in out] == [4, 1]
    assert (tmp_path / "two.png").stat().st_size > 0


MIXED = Cluster.load("examples/clusters/mixed-three-types.json")  # 32 H100, 16 A100-40GB, 16 L4

MEMORY = {
    "homogeneous-fits": dict(cluster=A100x8, name="gpt3-350m", kw=dict(tp=1, pp=2, dp=4, global_batch=16),
                             capacities=[79, 79], fits=True),   # usable GiB of an A100 80GB
    "mixed-capacity-per-group": dict(cluster=MIXED, name="gpt3-350m", kw=dict(tp=1, pp=4, dp=16, global_batch=64),
                                     capacities=[79, 79, 40, 24], fits=True),
    "too-big-does-not-fit": dict(cluster=A100x8, name="gpt3-6.7b", kw=dict(tp=1, pp=1, dp=8, global_batch=16),
                                 capacities=[79], fits=False),
}


@pytest.mark.parametrize("case", MEMORY.values(), ids=list(MEMORY))
def test_memory_bars_against_device_capacity(case, tmp_path):
    e = est(case["cluster"], case["name"], **case["kw"])
    bars = plot_memory(e, case["cluster"], tmp_path / "m.png", "test")
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG_MAGIC
    assert [round(b.capacity / GiB) for b in bars] == case["capacities"]
    for b, g in zip(bars, e.memory_by_group):
        assert b.total == pytest.approx(g.total)
    assert all(b.fits for b in bars) == case["fits"] == e.fits


def test_memory_grid_draws_one_panel_per_plan(tmp_path):
    a, b = est(tp=1, pp=2, dp=4, global_batch=16), est(tp=2, pp=1, dp=4, global_batch=16)
    out = plot_memory_grid([(a, "a"), (b, "b")], A100x8, tmp_path / "g.png")
    assert [len(x) for x in out] == [2, 1]
