"""Per-operator profiles: each operator measured at its shard shapes on the device at hand
(CPU here), stored, and preferred by the layout search's cost model over the roofline."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autoplan
from autoplan.models.graph import capture_model
from autoplan.models.opmeasure import op_cost
from autoplan.models.strategies import node_strategies
from autoplan.profiler.operators import OperatorProfile, profile_operators
from autoplan.profiler.timing import RepeatPolicy
from search.layouts import LayoutSettings, solve_chain

QUICK = RepeatPolicy(warmup=1, repeats=3, min_time_s=0.0)


class MLP(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                   nn.Linear(4 * d, d)) for _ in range(2)])

    def forward(self, x):
        for unit in self.layers:
            x = unit(x)
        return x


@pytest.fixture(scope="module")
def measured():
    graph = capture_model(MLP(), example_inputs=torch.randn(2, 8, 64), dtype="fp32")
    return graph, profile_operators(graph, degree=2, policy=QUICK)


def test_every_operator_and_layout_is_measured(measured):
    graph, prof = measured
    g = graph.graphs[0]
    linears = [n for n in g.nodes if n.op_name == "aten.linear.default"]
    for n in linears:
        for st in node_strategies(g, n, 2):
            assert any(k.startswith("aten.linear.default(") and k.endswith(f"|{','.join(p or '-' for p in st.inputs)}|mb=1")
                       for k in prof.entries)
    assert all(e["forward_ms"] > 0 for e in prof.entries.values())


def test_measured_saved_bytes_match_the_meta_measurement(measured):
    """What autograd keeps on the device equals what the planner counted on meta."""
    graph, prof = measured
    g = graph.graphs[0]
    from autoplan.models.opmeasure import op_key
    for n in g.nodes:
        if n.op_name != "aten.linear.default":
            continue
        for st in node_strategies(g, n, 2):
            meta = op_cost(g, n, st, 2)
            entry = prof.entries[f"{op_key(g, n, st, 2)}|mb=1"]
            assert entry["saved_bytes"] == pytest.approx(sum(meta.saved_inputs) + sum(meta.saved_outputs)
                                                         + meta.saved_internal)


def test_profile_round_trips_and_feeds_the_search(measured, tmp_path):
    graph, prof = measured
    prof.save(tmp_path / "ops.json")
    again = OperatorProfile.load(tmp_path / "ops.json")
    assert again.entries == prof.entries
    cluster = autoplan.Cluster.load("examples/clusters/cpu-4ranks.json")
    with_profile = solve_chain(graph, cluster, [(0, 1)], LayoutSettings(degree=2), again)
    roofline = solve_chain(graph, cluster, [(0, 1)], LayoutSettings(degree=2))
    assert with_profile.measured_ops > 0 and roofline.measured_ops == 0
    assert with_profile.time_s != roofline.time_s
