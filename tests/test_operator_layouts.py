"""Operator-level layouts: DTensor's strategies, the CP-SAT layout search, the layer-level
view of a layout and the plan's layout section.

The central check: for the zoo's transformer blocks, with nothing but DTensor's sharding
strategies and the cost model, the search lays out the linears the way Megatron-LM's
hand-written recipe does (column-parallel q/k/v and up/gate, row-parallel output and down
projections) with one activation reduction per attention and per MLP sub-block.
"""
from __future__ import annotations

import json

import pytest

import autoplan
from autoplan.errors import ConfigError
from autoplan.layouts import Layouts, OpLayout, UnitLayout, grad_placement, redistribute_kind
from autoplan.models.graph import capture_model
from autoplan.models.opview import implied_collectives, layout_spec
from autoplan.models.presets import get_config
from autoplan.models.strategies import node_strategies
from search.layouts import LayoutSettings, UnitProblem, solve_chain

A100_NODE = "examples/clusters/dgx-a100-1node.json"


@pytest.fixture(scope="module")
def a100():
    return autoplan.Cluster.load(A100_NODE)


# ---------------------------------------------------------------- DTensor strategies
def test_linear_strategies_come_from_dtensor():
    """A linear layer offers column- and row-parallel strategies (what DTensor's decomposition
    propagation derives), and never shards the batch dimension."""
    mg = capture_model("gpt-tiny", dtype="fp32")
    block = mg.graphs[1]
    linear = next(n for n in block.nodes if n.op_name == "aten.linear.default")
    got = {(s.inputs, s.outputs) for s in node_strategies(block, linear, 4)}
    assert (("R", "S0", "S0"), ("S2",)) in got          # column parallel: weight rows split
    assert (("S2", "S1", "P"), ("P",)) in got            # row parallel: partial sums
    assert (("R", "R", "R"), ("R",)) in got
    assert not any(p == "S0" for ins, outs in got for p in outs)   # dim 0 is the batch


@pytest.mark.parametrize("src,dst,kind", [
    ("R", "S1", None), ("R", "P", None), ("S1", "R", "all_gather"), ("S1", "S2", "all_to_all"),
    ("P", "R", "all_reduce"), ("P", "S0", "reduce_scatter"), ("S2", "P", "all_gather"), ("S1", "S1", None),
], ids=lambda v: str(v))
def test_redistribution_kinds(src, dst, kind):
    assert redistribute_kind(src, dst) == kind


@pytest.mark.parametrize("required,replicated,grad", [
    ("S1", False, "S1"), ("P", False, "R"), ("R", False, "P"), ("R", True, "R")],
    ids=["shard", "partial", "replicated-in-split-op", "all-replicated"])
def test_gradient_placement_rule(required, replicated, grad):
    assert grad_placement(required, replicated) == grad


# ----------------------------------------------------------- Megatron, found alone
MEGATRON = {
    # name -> (zoo preset, overrides at a size where tensor parallelism is used)
    "gpt": ("gpt-tiny", dict(hidden=4096, heads=32, seq_len=2048, vocab=32000)),
    "llama-gqa-swiglu-rope": ("llama-tiny", dict(hidden=4096, heads=32, kv_heads=8, seq_len=2048, vocab=32000)),
}
MEGATRON_SLOW = {
    "bert-post-norm": ("bert-tiny", dict(hidden=4096, heads=32, seq_len=2048, vocab=30720)),
    "moe-experts": ("moe-tiny", dict(hidden=4096, heads=32, kv_heads=8, ffn_hidden=8192, seq_len=2048, vocab=32000)),
}
COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "mlp.w1.weight", "mlp.w3.weight",
           "w1.weight", "w3.weight")
ROWWISE = ("attention.wo.weight", "mlp.w2.weight", "w2.weight")


def _block_solution(a100, preset, overrides, pin="R", pout="R"):
    mg = capture_model(get_config(preset, **overrides))
    block = mg.graphs[mg.units[1]]
    prob = UnitProblem(block, mg.units[1], a100, [tuple(range(8))], LayoutSettings(degree=8), mg.dtype)
    return block, prob.solve(pin, pout)


def _check_megatron(block, sol, comm_pattern: bool):
    params = {n.param: sol.strategies[n.name].outputs[0] for n in block.nodes if n.kind == "param"}
    matrices = {k: v for k, v in params.items() if len(block.node(next(
        n.name for n in block.nodes if n.param == k)).tensor_out.shape) == 2 and "gate" not in k}
    assert matrices, "no weight matrices found"
    for name, p in matrices.items():
        if name.endswith(COLWISE):
            assert p == "S0", f"{name} should be column-parallel (Shard(0) of [out, in]), got {p}"
        elif name.endswith(ROWWISE):
            assert p == "S1", f"{name} should be row-parallel (Shard(1)), got {p}"
    if comm_pattern:
        acts = [c for c in sol.collectives if c.batch_scaled]
        reductions = ("all_reduce", "reduce_scatter")
        fwd = [c.kind for c in acts if c.phase == "forward"]
        bwd = [c.kind for c in acts if c.phase == "backward"]
        # One reduction after the attention and one after the MLP, in the forward and in the
        # backward: an all-reduce each, or (where the cost model finds it faster to keep the
        # norms and residuals sequence-sharded, Megatron's sequence parallelism) a
        # reduce-scatter with the all-gathers that go with it. Nothing else.
        assert sum(k in reductions for k in fwd) == 2, fwd
        assert sum(k in reductions for k in bwd) == 2, bwd
        assert "all_to_all" not in fwd + bwd


@pytest.mark.parametrize("case", list(MEGATRON), ids=list(MEGATRON))
def test_search_recovers_megatron_recipe(a100, case):
    block, sol = _block_solution(a100, *MEGATRON[case])
    _check_megatron(block, sol, comm_pattern=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MEGATRON_SLOW), ids=list(MEGATRON_SLOW))
def test_search_recovers_megatron_recipe_other_families(a100, case):
    block, sol = _block_solution(a100, *MEGATRON_SLOW[case])
    # The MoE block's routing (top-k, gathers, index_add) has its own traffic; its expert
    # MLPs and attention still come out as Megatron shards them.
    _check_megatron(block, sol, comm_pattern=case != "moe-experts")


def test_sequence_parallel_boundary_is_megatron_sp(a100):
    """With the residual stream free to be sharded along the sequence, the block becomes
    Megatron's sequence parallelism: each all-reduce turns into reduce-scatter + all-gather."""
    block, sol = _block_solution(a100, *MEGATRON["gpt"], pin="S1", pout="S1")
    acts = [c for c in sol.collectives if c.batch_scaled and c.phase == "forward"]
    assert sorted(c.kind for c in acts) == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]


# ------------------------------------------------------ repeated blocks, chain DP
def test_identical_blocks_are_solved_once(a100):
    """A 96-block model is three distinct units; CP-SAT runs once per distinct unit and
    boundary pair (not per block), and every block in the middle gets the same layout: the
    cost of the search does not grow with depth."""
    deep = capture_model(get_config("gpt-tiny", layers=96))
    assert len(deep.graphs) == 3 and deep.num_units == 98
    problems: dict = {}
    b = solve_chain(deep, a100, [(0, 1)], LayoutSettings(degree=2), problems=problems)
    per_unit = [len(p.boundary_choices()[0]) * len(p.boundary_choices()[1]) for p in problems.values()]
    assert b.solves == sum(per_unit)
    assert len(b.units) == 98
    middle = {id(u) for u in b.units[2:-2]}
    assert len(middle) == 1


# -------------------------------------------------------------- the layer-level view
def test_view_matches_the_measured_model(a100):
    """Under the searched layouts the view has the zoo spec's FLOPs and parameters, and its
    blocks' collectives move as many bytes as Megatron's two all-reduces."""
    name = "gpt-tiny"
    cfg = get_config(name, hidden=512, heads=8, seq_len=256, vocab=8192)
    mg = capture_model(cfg)
    sol = solve_chain(mg, a100, [tuple(range(8))], LayoutSettings(degree=8))
    view = layout_spec(mg, sol.layouts(mg), 8)
    base = autoplan.models.get(cfg)
    assert view.flops_per_sample() == pytest.approx(base.flops_per_sample(), rel=1e-6)
    assert view.num_params == pytest.approx(base.num_params, rel=1e-6)
    block = view.layers[2]
    if {c.kind for c in block.tp_collectives if c.batch_scaled} == {"all_reduce"}:
        fwd = sum(c.nbytes for c in block.tp_collectives if c.phase == "forward" and c.batch_scaled)
        assert fwd == pytest.approx(base.layers[2].tp_allreduces_fwd * base.layers[2].output_bytes)


def test_estimate_of_a_layout_plan_is_reproducible(a100):
    """autoplan.estimate on a plan with layouts equals what the operator search ranked it by,
    and the plan survives a JSON round trip."""
    from search.operators import search_operator_plans
    res = search_operator_plans("gpt-tiny", a100, 16, tp=(2,), coshard=(), interlace=False,
                                max_micro_batch=2, zero=(0,), schedules=("1f1b",))
    best = res.best
    again = autoplan.Plan.from_dict(json.loads(json.dumps(best.plan.to_dict())))
    assert again == best.plan
    est = autoplan.estimate("gpt-tiny", a100, again)
    assert est.iteration_time_s == pytest.approx(best.estimate.iteration_time_s, rel=1e-9)


# ------------------------------------------------------------------- plan section
def _layouts(**kw) -> Layouts:
    unit = UnitLayout(units=(1, 2), signature="abc", input="R", output="S1", params=(("w", "S0"),),
                      ops=(OpLayout("linear", "aten.linear.default", ("R", "S0", None), ("S2",)),))
    return Layouts(units=(unit,), **kw)


def test_layouts_json_round_trip():
    lay = _layouts(interlaced=(0,))
    assert Layouts.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["units"][0].update(input="S"), "layouts.units[0].input"),
    (lambda d: d["units"][0]["ops"][0].update(inputs=["Q"]), "layouts.units[0].ops[0].inputs[0]"),
    (lambda d: d["units"][0].update(coshard=0), "layouts.units[0].coshard"),
    (lambda d: d.update(mesh_axis="dp"), "layouts.mesh_axis"),
    (lambda d: d["units"].append(dict(d["units"][0])), "layouts.units[1].units"),
    (lambda d: d["units"][0].update(units=[10**6]), "layouts.units[0].units[0]"),
    (lambda d: d["units"][0].update(coshard=10**9), "layouts.units[0].coshard"),
    (lambda d: d["units"][0]["ops"][0].update(inputs=["R"] * 10**4), "layouts.units[0].ops[0].inputs"),
    (lambda d: d.update(objective_s=float("1e300")), "layouts.objective_s"),
], ids=["bad-placement", "bad-op-placement", "coshard-zero", "wrong-axis", "unit-twice", "unit-index-huge",
        "coshard-huge", "too-many-inputs", "objective-huge"])
def test_layouts_errors_name_the_field(mutate, field):
    d = _layouts().to_dict()
    mutate(d)
    with pytest.raises(ConfigError) as e:
        Layouts.from_dict(d)
    assert e.value.field == field


@pytest.mark.parametrize("keyword,value", [
    ("tp", (0,)), ("tp", (3.5,)), ("coshard", (1,)), ("coshard", (10**9,)), ("memory_weights", ()),
    ("memory_weights", (float("nan"),)), ("layout_micro_batch", 0), ("top_variants", -1),
], ids=["tp-zero", "tp-float", "coshard-one", "coshard-huge", "no-weights", "weight-nan", "layout-mb-zero",
        "top-variants-negative"])
def test_operator_search_keywords_are_checked_first(a100, keyword, value):
    """A bad keyword of the operator search is one ConfigError naming it, before any capture."""
    from search.operators import search_operator_plans
    with pytest.raises(ConfigError) as e:
        search_operator_plans("gpt-tiny", a100, 16, **{keyword: value})
    assert e.value.field == keyword


def test_layouts_and_sequence_parallel_exclude_each_other():
    from autoplan.plan import DeviceGroup, Plan, Stage
    plan = Plan(groups=(DeviceGroup((0, 1), 2),), stages=(Stage(0, 4, 0),), micro_batch=1, num_micro_batches=1,
                sequence_parallel=True, layouts=_layouts())
    with pytest.raises(ConfigError) as e:
        plan.validate()
    assert e.value.field == "sequence_parallel"


def test_implied_collectives_count_once_per_tensor_and_placement():
    """Three projections reading one replicated tensor as replicated need nothing; the
    gradient they return (partial) is all-reduced once, not three times."""
    mg = capture_model("gpt-tiny", dtype="fp32")
    block = mg.graphs[1]
    from autoplan.models.opview import unit_strategies
    strategies = unit_strategies(block, None)
    # Column-parallel q, k, v; everything else as the replicated default.
    for n in block.nodes:
        if n.op_name == "aten.linear.default" and n.name in ("linear", "linear_1", "linear_2"):
            from autoplan.models.strategies import Strategy
            strategies[n.name] = Strategy(("S2",), ("R", "S0", "S0"))
    back = [r for r in implied_collectives(block, strategies, "R")
            if r.collective.phase == "backward" and r.tensor == "layer_norm"]
    assert [r.collective.kind for r in back] == ["all_reduce"]


def test_an_operator_that_cannot_run_on_meta_is_named_not_costed_at_zero():
    """Its cost would be unknown: the search says which operator, rather than pricing it at
    nothing and picking layouts around a free operator."""
    import torch

    from autoplan.models.opmeasure import _traced

    def no_meta_kernel(t):
        raise RuntimeError("no meta kernel")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 2, device="meta")
    node = graph.call_function(no_meta_kernel, (x,))
    with pytest.raises(ConfigError, match="no_meta_kernel.*cannot be run on meta"):
        _traced(node, 1)


@pytest.mark.parametrize("fp32_loss,loss_dtype", [(True, "torch.float32"), (False, "torch.bfloat16")],
                         ids=["upcast", "half-precision"])
def test_captured_head_takes_the_loss_in_the_stacks_precision(fp32_loss, loss_dtype):
    # The operator graph's head ends in the same loss the layer spec measures
    # (autoplan.models.zoo.measured_loss_fn): on an fp32 copy of the logits, or on them.
    import dataclasses
    graph = capture_model(dataclasses.replace(get_config("gpt-tiny"), fp32_loss=fp32_loss))
    head = graph.graphs[graph.units[-1]]
    assert head.has_loss
    final = next(n for n in head.nodes if n.name == head.output_node)
    assert str(final.outputs[0].dtype) == loss_dtype
