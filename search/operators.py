"""Operator-level plans: layouts per operator below the existing pipeline/schedule search.

``search_operator_plans(model, cluster, global_batch)``:

1. capture the model's operator graph (any ``nn.Module``, zoo name or config);
2. per tensor-parallel degree, solve every distinct unit's operator layouts with CP-SAT
   (:mod:`search.layouts`) — for the fastest layouts, and with memory priced in when
   ``memory_weights`` asks for leaner ones;
3. turn each solution into its layer-level view (:mod:`autoplan.models.opview`) and run the
   existing search on it (pipeline depth, data parallelism, ZeRO, recomputation,
   micro-batches, schedules), restricted to that degree;
4. try the transformations rule-based systems do not have on the best plans found:
   co-shard (each rank runs its share of a unit as k recomputed chunks) and interlaced
   embedding/head (sharded over every rank of the pipeline);
5. rank everything with the full cost model.

Every plan in the result carries its layouts (``plan.layouts``), so ``autoplan.estimate``
reproduces its figures and the runtime can run it.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from autoplan.cluster import Cluster
from autoplan.errors import ConfigError, NoPlanFitsError
from autoplan.layouts import Layouts, UnitLayout
from autoplan.limits import MAX_GPUS_PER_NODE, MAX_MICRO_BATCH, MAX_TOP_K
from autoplan.models.graph import ModelGraph, capture_model
from autoplan.models.opview import layout_spec, plan_view
from autoplan.plan import Plan, Stage
from costmodel import estimate as full_estimate
from search.core import search as layer_search
from search.layouts import ChainSolution, LayoutSettings, UnitProblem, solve_chain, unit_layout
from search.result import RankedPlan, SearchResult, SearchStats


@dataclass
class OperatorSearchResult(SearchResult):
    """A search result whose plans carry operator layouts, with what the layout search did."""

    model_graph: ModelGraph | None = None
    """The captured operator graph the layouts refer to."""
    chains: dict[int, ChainSolution] = field(default_factory=dict)
    """Per tensor-parallel degree, the fastest layouts of every unit."""
    layout_s: float = 0.0
    """Seconds spent capturing, measuring and solving layouts."""
    variants: list[tuple[str, RankedPlan]] = field(default_factory=list)
    """(label, plan) for every co-shard / interlaced variant estimated, fitting or not."""


def _ints(name: str, values, low: int, top: int) -> tuple[int, ...]:
    vals = tuple(values) if isinstance(values, (list, tuple, set, frozenset)) else (values,)
    for x in vals:
        if not isinstance(x, int) or isinstance(x, bool) or not low <= x <= top:
            raise ConfigError(name, f"must be integers in {low}..{top:,}, got {str(x)[:40]!r}")
    return tuple(sorted(set(vals)))


def _check_options(tp, coshard, memory_weights, layout_micro_batch, top_variants):
    """The operator search's own keywords, bounded like the layer-level constraints
    (search.space) so a bad value is one ConfigError, not a long or failing search."""
    if tp is not None:
        tp = _ints("tp", tp, 1, MAX_GPUS_PER_NODE)
    coshard = _ints("coshard", coshard, 2, MAX_MICRO_BATCH)
    weights = tuple(memory_weights) if isinstance(memory_weights, (list, tuple)) else (memory_weights,)
    if not weights:
        raise ConfigError("memory_weights", "must list at least one weight", "use (0.0,) for the fastest layouts")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1e6:
            raise ConfigError("memory_weights", f"must be numbers in [0, 1e6], got {str(w)[:40]!r}")
    if layout_micro_batch is not None:
        _ints("layout_micro_batch", layout_micro_batch, 1, MAX_MICRO_BATCH)
    _ints("top_variants", top_variants, 0, MAX_TOP_K)
    return tp, coshard, weights


def _tp_options(cluster: Cluster, tp) -> list[int]:
    if tp is not None:
        return sorted(tp)
    per_node = min(g.gpus_per_node for g in cluster.groups)
    return [t for t in (1, 2, 4, 8, 16) if t <= per_node and per_node % t == 0]


def _with_layouts(ranked: list[RankedPlan], layouts: Layouts) -> list[RankedPlan]:
    out = []
    for rp in ranked:
        plan = dataclasses.replace(rp.plan, layouts=layouts)
        est = dataclasses.replace(rp.estimate, plan=plan)
        out.append(dataclasses.replace(rp, plan=plan, estimate=est))
    return out


def search_operator_plans(model, cluster: Cluster, global_batch: int, *, example_inputs=None, loss_target=None,
                          loss=None, tp=None, coshard: tuple[int, ...] = (2, 4), interlace: bool = True,
                          memory_weights: tuple[float, ...] = (0.0,), layout_micro_batch: int | None = None,
                          operator_profiles=None, top_variants: int = 3, **constraints) -> OperatorSearchResult:
    """Best operator-level plans for ``model`` on ``cluster`` (see the module docstring).

    ``model`` is a zoo name or config, or an ``nn.Module`` with ``example_inputs`` (and
    ``loss``/``loss_target`` to put the loss in the last unit). Keyword ``constraints`` go to the
    layer-level search (``search.space.Constraints``); ``tp`` limits the degrees tried.
    Layouts are solved for ``layout_micro_batch`` samples (None: the smallest power of two
    giving at least LAYOUT_TOKENS tokens, at most the global batch per GPU): whether a matmul
    is worth sharding depends on how many rows it has."""
    start = time.perf_counter()
    tp, coshard, memory_weights = _check_options(tp, coshard, memory_weights, layout_micro_batch, top_variants)
    constraints.setdefault("progress", False)
    from search.space import Constraints
    options = Constraints.build(**constraints).estimate_options()
    stack = options.stack
    for bad in ("sequence_parallel",):
        if bad in constraints:
            raise ConfigError(bad, "is decided by the operator layouts", "leave it out")
    if constraints.get("cp") not in (None, 1, (1,), [1]):
        raise ConfigError("cp", "operator layouts cover the tensor-parallel axis only", "search layouts with cp=1")
    if constraints.get("target") not in (None, "autoplan"):
        raise ConfigError("target", f"per-operator layouts run on autoplan's runtime only, not {constraints['target']}",
                          "search without layouts for another engine")
    if isinstance(model, ModelGraph):
        mg = model
    else:
        mg = capture_model(model, example_inputs=example_inputs, target=loss_target, loss=loss)
    if layout_micro_batch is None:
        layout_micro_batch = _layout_micro_batch(mg, cluster, global_batch)
    chains: dict[int, ChainSolution] = {}
    ranked: list[RankedPlan] = []
    stats = SearchStats()
    variants: list[tuple[str, RankedPlan]] = []
    layout_s = 0.0
    first = cluster.groups[0]
    base_rank = 0
    for t in _tp_options(cluster, tp):
        if t > first.gpus_per_node:
            continue
        groups = [tuple(range(base_rank, base_rank + t))]
        for w in memory_weights:
            t0 = time.perf_counter()
            sol = solve_chain(mg, cluster, groups, LayoutSettings(degree=t, micro_batch=layout_micro_batch,
                                                                  memory_weight=w, stack=stack),
                              operator_profiles)
            layouts = sol.layouts(mg)
            if w == memory_weights[0]:
                chains[t] = sol
            view = layout_spec(mg, layouts, t)
            layout_s += time.perf_counter() - t0
            found = _layer_search(view, cluster, global_batch, t, constraints, stats)
            ranked += _with_layouts(found, layouts)
    ranked.sort(key=lambda rp: rp.estimate.iteration_time_s)
    # Transformations on the best plans: co-shard and interlaced embedding/head.
    seen_t = []
    for rp in ranked:
        t = rp.plan.tp
        if t in seen_t or len(seen_t) >= 1:
            continue
        seen_t.append(t)
        for k in coshard:
            lay = _coshard(rp.plan.layouts, mg, k)
            view = layout_spec(mg, lay, t)
            found = _layer_search(view, cluster, global_batch, t, constraints, stats)
            found = _with_layouts(found, lay)
            ranked += found
            if found:
                variants.append((f"co-shard {k}", found[0]))
    if interlace:
        done = set()
        for rp in list(ranked)[: 4 * top_variants]:
            p = rp.plan
            key = (p.pp, p.tp, p.dp, p.micro_batch, p.schedule, p.virtual_stages)
            if p.pp < 2 or key in done or p.layouts is None or p.layouts.interlaced:
                continue
            done.add(key)
            for units, label in (((0, mg.num_units - 1), "interlaced embedding+head"),
                                 ((mg.num_units - 1,), "interlaced head")):
                t0 = time.perf_counter()
                plan = _interlaced(p, mg, cluster, units, layout_micro_batch, operator_profiles, stack)
                layout_s += time.perf_counter() - t0
                if plan is None:
                    continue
                est = full_estimate(plan_view(mg, plan), cluster, plan, options)
                stats.estimates += 1
                entry = RankedPlan(rank=0, plan=plan, estimate=est, predicted_s=est.iteration_time_s,
                                   gpus_used=plan.num_gpus)
                variants.append((label, entry))
                if est.fits:
                    ranked.append(entry)
            if len(done) >= top_variants:
                break
    ranked = [rp for rp in ranked if rp.estimate.fits]
    ranked.sort(key=lambda rp: rp.estimate.iteration_time_s)
    ranked = [dataclasses.replace(rp, rank=i + 1) for i, rp in enumerate(ranked)]
    stats.total_s = time.perf_counter() - start
    stats.phase_s["layouts"] = layout_s
    if not ranked:
        raise NoPlanFitsError(f"no operator-level plan for {mg.name} fits on {cluster.name}: every layout's "
                              "memory exceeds the devices' (try more GPUs or a smaller global batch)")
    return OperatorSearchResult(ranked=ranked, stats=stats, cluster=cluster, model_name=mg.name,
                                global_batch=global_batch, model_graph=mg, chains=chains, layout_s=layout_s,
                                variants=variants)


LAYOUT_TOKENS = 2048
"""Tokens per micro-batch the layouts are solved for by default (a language model's sequence;
a vision transformer's 197 patches would otherwise make every matmul look too small to shard)."""


def _layout_micro_batch(model: ModelGraph, cluster: Cluster, global_batch: int) -> int:
    cap = max(1, global_batch // cluster.num_gpus)
    b = 1
    while b * model.tokens_per_sample < LAYOUT_TOKENS and 2 * b <= cap:
        b *= 2
    return b


def _layer_search(view, cluster, global_batch, t, constraints, stats: SearchStats) -> list[RankedPlan]:
    try:
        # Layouts cover the tensor-parallel axis only (Plan.validate refuses cp > 1 with them).
        res = layer_search(view, cluster, global_batch, **{**constraints, "tp": (t,), "sequence_parallel": (False,),
                                                            "cp": (1,)})
    except NoPlanFitsError:
        return []
    s = res.stats
    stats.candidates += s.candidates
    stats.skeletons += s.skeletons
    stats.splits += s.splits
    stats.estimates += s.estimates
    for k, v in s.phase_s.items():
        stats.phase_s[k] = stats.phase_s.get(k, 0.0) + v
    return res.ranked


def _coshard(layouts: Layouts, model: ModelGraph, k: int) -> Layouts:
    """``layouts`` with every block unit co-sharded ``k`` ways (the units whose activations
    dominate; embedding and head keep theirs)."""
    units = tuple(dataclasses.replace(u, coshard=k) if model.graphs[model.units[u.units[0]]].kind == "block"
                  else u for u in layouts.units)
    return dataclasses.replace(layouts, units=units)


def _interlaced(plan: Plan, model: ModelGraph, cluster: Cluster, units: tuple[int, ...], micro_batch: int,
                profiles, stack=None) -> Plan | None:
    """``plan`` with ``units`` sharded over all pp x tp ranks of each pipeline and the other
    units re-split evenly over the stages (the interlaced units no longer weigh on the first
    and last stage)."""
    lay = plan.layouts
    degree = plan.pp * plan.tp
    if any(g.tp != plan.tp for g in plan.groups):
        return None
    pipes = [sum((g.tp_groups()[d] for g in plan.groups), ()) for d in range(plan.dp)]
    new_units: list[UnitLayout] = []
    for u in lay.units:
        rest = tuple(i for i in u.units if i not in units)
        if rest:
            new_units.append(dataclasses.replace(u, units=rest))
    for i in units:
        g = model.graph_of(i)
        old = lay.for_unit(i)
        prob = UnitProblem(g, model.units[i], cluster, pipes,
                           LayoutSettings(degree=degree, micro_batch=micro_batch, stack=stack), model.dtype, profiles)
        pins, pouts = prob.boundary_choices()
        pin = old.input if old.input in pins else "R"
        pout = old.output if old.output in pouts else "R"
        sol = prob.solve(pin, pout)
        if sol is None:
            return None
        new_units.append(unit_layout(g, sol, (i,)))
    layouts = dataclasses.replace(lay, units=tuple(sorted(new_units, key=lambda u: u.units[0])),
                                  interlaced=tuple(sorted(units)))
    # Re-split: the interlaced units weigh nothing where they sit.
    n = len(plan.stages)
    inner = [i for i in range(model.num_units) if i not in units]
    per, extra = divmod(len(inner), n)
    if per == 0:
        return None
    bounds, pos = [], 0
    for s in range(n):
        take = per + (1 if s < extra else 0)
        chunk = inner[pos:pos + take]
        pos += take
        bounds.append([chunk[0], chunk[-1] + 1])
    bounds[0][0] = 0
    for s in range(n - 1):
        bounds[s][1] = bounds[s + 1][0]
    bounds[-1][1] = model.num_units
    stages = tuple(Stage(a, b, st.group, st.recompute) for (a, b), st in zip(bounds, plan.stages))
    new = dataclasses.replace(plan, stages=stages, layouts=layouts)
    new.validate()
    return new
