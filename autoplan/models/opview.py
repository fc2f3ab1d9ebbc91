"""The layer-level view of an operator-level plan: a ModelSpec whose units cost exactly
what their operator layouts cost.

A :class:`~autoplan.models.spec.LayerSpec` keeps every quantity as ``replicated +
sharded / tp``. Under an operator layout each operator either splits its work over the
tensor-parallel ranks (some tensor of its strategy is sharded) or does all of it, each
parameter is sharded or replicated, each saved activation is kept at its placement — so
the split is exact, and the redistributions the layout implies become the unit's
``tp_collectives``. The layer-level cost model and the pipeline/schedule search then
handle the view like any other model: operator layouts sit *below* the existing search.

The same functions say which collectives and which saved tensors a set of strategies
implies, so the layout search (``search.layouts``) and this view cannot disagree.

Co-shard and interlacing (see :mod:`autoplan.layouts`) change a unit's view:

* a unit co-sharded k ways runs its share as k chunks, each recomputed in the backward:
  it keeps only its input between forward and backward, its backward re-runs the forward,
  its matmuls are k times smaller and launch k times as often, and while one chunk is
  rebuilt only 1/k of its activations are alive (``transient_bytes``);
* an interlaced unit is sharded over every rank of the pipeline: each pipeline group runs
  1/pp of it, added to the first unit of its first stage, with the collectives that
  bring its input to all ranks and its result back (``scope='pipeline'``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoplan.errors import ConfigError
from autoplan.layouts import Layouts, UnitLayout, backward_target, grad_placement, redistribute_kind
from autoplan.models.graph import ModelGraph, TensorInfo, UnitGraph
from autoplan.models.opmeasure import ATTENTION_OPS, OpCost, op_cost
from autoplan.models.spec import ActivationBytes, Collective, Gemm, LayerSpec, ModelSpec, Split
from autoplan.models.strategies import Strategy, _fx_node, _vocab_parallel_loss


def resolve(graph: UnitGraph, ref: tuple[str, int]) -> tuple[str, int]:
    """Follow getitem nodes to the multi-output operator they pick from."""
    name, idx = ref
    node = graph.node(name)
    while node.kind == "getitem":
        name, idx = node.args[0]
        node = graph.node(name)
    return name, idx


def requires_grad(graph: UnitGraph) -> dict[str, bool]:
    """Which nodes' outputs carry a gradient (they depend on a parameter or the unit's input)."""
    out: dict[str, bool] = {}
    boundary = graph.input_nodes[0]
    for n in graph.nodes:
        if n.kind == "param":
            out[n.name] = n.tensor_out.dtype.is_floating_point
        elif n.kind == "input":
            out[n.name] = n.name == boundary and n.tensor_out.dtype.is_floating_point
        elif n.kind in ("op", "getitem"):
            out[n.name] = any(out.get(resolve(graph, a)[0], False) for a in n.args)
    return out


def readers(graph: UnitGraph) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Tensor (operator, output) -> [(operator reading it, argument position)]."""
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for n in graph.nodes:
        if n.kind == "op":
            for pos, ref in enumerate(n.args):
                out.setdefault(resolve(graph, ref), []).append((n.name, pos))
    return out


def output_tensor(graph: UnitGraph) -> tuple[str, int]:
    return resolve(graph, (graph.output_node, 0))


@dataclass(frozen=True)
class Redistribution:
    """A collective a layout implies, with the tensor it moves."""

    tensor: str
    src: str
    dst: str
    collective: Collective


def implied_collectives(graph: UnitGraph, strategies: dict[str, Strategy], pout: str) -> list[Redistribution]:
    """Every redistribution a choice of strategies implies: forward, where a consumer (or the
    unit's output, ``pout``) needs a tensor in another placement than it was produced in —
    once per (tensor, placement) — and backward, where a gradient arrives in another
    placement than its tensor's producer needs — once per (tensor, gradient placement)."""
    grads = requires_grad(graph)
    out: list[Redistribution] = []
    reads = readers(graph)
    final = output_tensor(graph)
    tensors = sorted(set(reads) | {final})
    for tensor in tensors:
        producer, j = tensor
        info: TensorInfo = graph.node(producer).outputs[j]
        p = strategies[producer].outputs[j]
        needs: set[str] = set()
        grad_in: set[str] = set()
        for consumer, pos in reads.get(tensor, []):
            st = strategies[consumer]
            q = st.inputs[pos]
            if q is None:
                continue
            needs.add(q)
            if grads.get(producer) and info.dtype.is_floating_point:
                grad_in.add(grad_placement(q, st.replicated))
        if tensor == final:
            needs.add(pout)
            if grads.get(producer) and info.dtype.is_floating_point:
                grad_in.add(pout)
        scaled = bool(info.batch_dims)
        for q in sorted(needs):
            kind = redistribute_kind(p, q)
            if kind:
                out.append(Redistribution(producer, p, q, Collective(kind, info.nbytes, "forward", scaled)))
        target = backward_target(p)
        for g in sorted(grad_in):
            kind = redistribute_kind(g, target)
            if kind:
                out.append(Redistribution(producer, g, target, Collective(kind, info.nbytes, "backward", scaled)))
    # Collectives inside operators (the vocabulary-parallel loss).
    for n in graph.nodes:
        st = strategies.get(n.name)
        if n.kind == "op" and st is not None:
            for kind, nbytes, phase in st.collectives:
                out.append(Redistribution(n.name, st.inputs[0], st.outputs[0], Collective(kind, nbytes, phase, True)))
    return out


def saved_activations(graph: UnitGraph, strategies: dict[str, Strategy], costs: dict[str, OpCost]
                      ) -> list[tuple[tuple[str, int], str, float, bool]]:
    """(tensor, placement, full bytes per sample, counted once) for every activation autograd
    keeps under these strategies; a tensor read by several operators in one placement is
    one storage. Parameters are not activations."""
    reads = readers(graph)
    kept: dict[tuple[tuple[str, int], str], float] = {}
    for tensor, users in reads.items():
        producer, j = tensor
        node = graph.node(producer)
        if storage_root(graph, tensor) in params_of(graph):
            continue
        for consumer, pos in users:
            st, c = strategies[consumer], costs[consumer]
            q = st.inputs[pos]
            if q is not None and pos < len(c.saved_inputs) and c.saved_inputs[pos] > 0:
                key = storage_key(graph, tensor, q, strategies)
                if key[0] not in params_of(graph):
                    kept[key] = max(kept.get(key, 0.0), graph.node(key[0][0]).outputs[key[0][1]].nbytes)
    for n in graph.nodes:
        if n.kind != "op":
            continue
        st, c = strategies[n.name], costs[n.name]
        for j, p in enumerate(st.outputs):
            if p is not None and j < len(c.saved_outputs) and c.saved_outputs[j] > 0:
                key = storage_key(graph, (n.name, j), p, strategies)
                kept[key] = max(kept.get(key, 0.0), graph.node(key[0][0]).outputs[key[0][1]].nbytes)
    return [(t, p, b, True) for (t, p), b in sorted(kept.items())]


def storage_root(graph: UnitGraph, tensor: tuple[str, int]) -> tuple[str, int]:
    info = graph.node(tensor[0]).outputs[tensor[1]]
    return info.root if info is not None and info.root is not None else tensor


def params_of(graph: UnitGraph) -> set[tuple[str, int]]:
    return {(n.name, 0) for n in graph.nodes if n.kind == "param"}


def storage_key(graph: UnitGraph, tensor: tuple[str, int], placement: str,
                strategies: dict[str, Strategy]) -> tuple[tuple[str, int], str]:
    """The storage a tensor kept in ``placement`` occupies, as (tensor owning it, its
    placement): a redistributed copy owns its storage; a view of a tensor that was not
    redistributed on the way is its base's storage (a saved attention output and the
    reshaped view the next projection saves are one storage)."""
    def produced(t):
        return strategies[t[0]].outputs[t[1]]
    if placement != produced(tensor):
        return (tensor, placement)
    cur = tensor
    while True:
        info = graph.node(cur[0]).outputs[cur[1]]
        if info is None or info.root is None:
            return (cur, produced(cur))
        node = graph.node(cur[0])
        view = graph.node(node.args[0][0]) if node.kind == "getitem" else node
        base = resolve(graph, view.args[0])
        if strategies[view.name].inputs[0] != produced(base):
            return (cur, produced(cur))   # a view of a redistributed copy
        cur = base


def unit_strategies(graph: UnitGraph, layout: UnitLayout | None) -> dict[str, Strategy]:
    """Strategies of every node from a unit layout (None: everything replicated). Raises
    ConfigError when the layout was made for a different graph."""
    params = layout.param_placements() if layout is not None else {}
    out: dict[str, Strategy] = {}
    for n in graph.nodes:
        if n.kind == "param":
            out[n.name] = Strategy((params.get(n.param, "R"),), ())
        elif n.kind == "input":
            p = layout.input if layout is not None and n.name == graph.input_nodes[0] else "R"
            out[n.name] = Strategy((p,), ())
        elif n.kind == "op":
            if layout is None:
                out[n.name] = Strategy(tuple(None if o is None else "R" for o in n.outputs), tuple("R" for _ in n.args))
                continue
            op = layout.op(n.name)
            if op is None or op.op != n.op_name:
                raise ConfigError("layouts", f"unit {graph.name}: node {n.name!r} ({n.op_name}) has no matching "
                                  "layout", "the layouts were made for a different model or torch version; search again")
            st = Strategy(tuple(op.outputs), tuple(op.inputs))
            internal = _vocab_parallel_loss(graph, n, _fx_node(graph, n.name),
                                            [graph.node(a).outputs[i] for a, i in n.args], 1)
            if internal is not None and internal.inputs == st.inputs and internal.outputs == st.outputs:
                st = internal
            out[n.name] = st
    return out


def _split(values: list[tuple[float, bool]]) -> Split:
    rep = sum(v for v, sharded in values if not sharded)
    sh = sum(v for v, sharded in values if sharded)
    return Split(replicated=rep, sharded=sh)


def _sharded_gemms(local: tuple[Gemm, ...], full: tuple[Gemm, ...], degree: int) -> tuple[Gemm, ...]:
    """Full-size gemms, each marked with the dimension the layout divides (by comparing the
    shard-shape measurement with the full-size one)."""
    out = []
    for g_loc, g_full in zip(local, full):
        shard = ""
        for d in ("m", "n", "k", "count"):
            if getattr(g_loc, d) < getattr(g_full, d) and degree > 1:
                shard = d
                break
        out.append(dataclasses.replace(g_full, shard_dim=shard))
    return tuple(out)


def layer_spec(graph: UnitGraph, layout: UnitLayout | None, degree: int, name: str | None = None) -> LayerSpec:
    """The LayerSpec of one unit under ``layout`` (measured at shard shapes for ``degree``)."""
    strategies = unit_strategies(graph, layout)
    replicated = unit_strategies(graph, None)
    costs: dict[str, OpCost] = {}
    full: dict[str, OpCost] = {}
    for n in graph.nodes:
        if n.kind == "op":
            costs[n.name] = op_cost(graph, n, strategies[n.name], degree)
            full[n.name] = op_cost(graph, n, replicated[n.name], degree)
    grads = requires_grad(graph)
    params, flops_f, flops_b, attn_f, attn_b, mem_f, mem_b, core_mem = ([] for _ in range(8))
    gemms_f, gemms_b = [], []
    kernels_f = kernels_b = 0
    causal = False
    core_saved: list[tuple[float, bool]] = []
    internal: list[tuple[float, bool]] = []
    for n in graph.nodes:
        if n.kind == "param" and n.tensor_out.dtype.is_floating_point:
            numel = n.tensor_out.nbytes / n.tensor_out.dtype.itemsize
            params.append((numel, strategies[n.name].outputs[0].startswith("S")))
        if n.kind != "op":
            continue
        st, c, f = strategies[n.name], costs[n.name], full[n.name]
        div = st.divides_work and degree > 1
        back = grads.get(n.name, False)
        flops_f.append((f.flops_fwd, div))
        attn_f.append((f.attention_flops_fwd, div))
        mem_f.append((f.memory_bytes_fwd, div))
        gemms_f += _sharded_gemms(c.gemms_fwd, f.gemms_fwd, degree)
        kernels_f += f.kernels_fwd
        core = n.op_name in ATTENTION_OPS
        causal = causal or (core and c.causal)
        if core:
            core_mem.append((f.memory_bytes_fwd, div))
            core_saved.append((sum(f.saved_outputs) + f.saved_internal, div))
        internal.append((f.saved_internal, div))
        if back:
            flops_b.append((f.flops_bwd, div))
            attn_b.append((f.attention_flops_bwd, div))
            mem_b.append((f.memory_bytes_bwd, div))
            gemms_b += _sharded_gemms(c.gemms_bwd, f.gemms_bwd, degree)
            kernels_b += f.kernels_bwd
    # Gradients of a tensor read by several operators are summed: one add per extra reader.
    for tensor, users in readers(graph).items():
        info = graph.node(tensor[0]).outputs[tensor[1]]
        k = sum(1 for consumer, pos in users if strategies[consumer].inputs[pos] is not None)
        if k > 1 and grads.get(tensor[0]) and info.dtype.is_floating_point and graph.node(tensor[0]).kind != "param":
            sharded = (strategies[tensor[0]].outputs[tensor[1]] or "R").startswith("S") and degree > 1
            mem_b.append(((k - 1) * 3 * info.nbytes, sharded))
            kernels_b += k - 1
    saved = [(b, p.startswith("S")) for _, p, b, _ in saved_activations(graph, strategies, costs)]
    none = _split(saved + internal)
    core = _split(core_saved)
    selective = Split(max(none.replicated - core.replicated, 0.0), max(none.sharded - core.sharded, 0.0))
    pin = layout.input if layout is not None else "R"
    in_info = graph.input_info()
    full_act = Split(sharded=in_info.nbytes) if pin.startswith("S") else Split(replicated=in_info.nbytes)
    if not in_info.dtype.is_floating_point:
        full_act = Split()
    pout = layout.output if layout is not None else "R"
    colls = tuple(r.collective for r in implied_collectives(graph, strategies, pout))
    out_info = graph.output_info()
    return LayerSpec(
        name=name or graph.name, kind=graph.kind if not graph.has_loss else "head",
        params=_split(params), flops_fwd=_split(flops_f), flops_bwd=_split(flops_b),
        gemms_fwd=tuple(gemms_f), gemms_bwd=tuple(gemms_b),
        attention_flops_fwd=_split(attn_f), attention_flops_bwd=_split(attn_b),
        memory_bytes_fwd=_split(mem_f), memory_bytes_bwd=_split(mem_b), core_memory_bytes_fwd=_split(core_mem),
        kernels_fwd=kernels_f, kernels_bwd=kernels_b,
        activation_bytes=ActivationBytes(none=none, selective=selective, full=full_act),
        output_bytes=0.0 if graph.has_loss else out_info.nbytes, tp_allreduces_fwd=0, causal=causal,
        tp_collectives=colls)


def coshard_spec(layer: LayerSpec, k: int) -> LayerSpec:
    """``layer`` run as k sequential chunks per rank, each recomputed in the backward."""
    if k <= 1:
        return layer

    def chunk(gs):
        return tuple(dataclasses.replace(g, m=g.m / k, count=g.count * k) if g.batch_dim == "m" else g for g in gs)
    keep = layer.activation_bytes.full
    return dataclasses.replace(
        layer, gemms_fwd=chunk(layer.gemms_fwd),
        # The backward re-runs the forward chunk by chunk before its own work.
        gemms_bwd=chunk(layer.gemms_fwd) + chunk(layer.gemms_bwd),
        flops_bwd=layer.flops_bwd + layer.flops_fwd,
        attention_flops_bwd=layer.attention_flops_bwd + layer.attention_flops_fwd,
        memory_bytes_bwd=layer.memory_bytes_bwd + layer.memory_bytes_fwd,
        kernels_fwd=layer.kernels_fwd * k, kernels_bwd=(layer.kernels_bwd + layer.kernels_fwd) * k,
        autocast_kernels_fwd=layer.autocast_kernels_fwd * k,
        autocast_kernels_bwd=(layer.autocast_kernels_bwd + layer.autocast_kernels_fwd) * k,
        activation_bytes=ActivationBytes(none=keep, selective=keep, full=keep),
        transient_bytes=layer.activation_bytes.none.scaled(1.0 / k),
        # Its collectives run once per chunk on 1/k of the data (the same volume, charged
        # as one); the recomputed forward repeats the forward ones.
        tp_collectives=layer.tp_collectives + tuple(dataclasses.replace(c, phase="backward")
                                                   for c in layer.tp_collectives if c.phase == "forward"))


def _merge(host: LayerSpec, extra: LayerSpec) -> LayerSpec:
    """``host`` also running ``extra`` every micro-batch (an interlaced share)."""
    a, b = host.activation_bytes, extra.activation_bytes
    return dataclasses.replace(
        host, params=host.params + extra.params, flops_fwd=host.flops_fwd + extra.flops_fwd,
        flops_bwd=host.flops_bwd + extra.flops_bwd, gemms_fwd=host.gemms_fwd + extra.gemms_fwd,
        gemms_bwd=host.gemms_bwd + extra.gemms_bwd,
        attention_flops_fwd=host.attention_flops_fwd + extra.attention_flops_fwd,
        attention_flops_bwd=host.attention_flops_bwd + extra.attention_flops_bwd,
        memory_bytes_fwd=host.memory_bytes_fwd + extra.memory_bytes_fwd,
        memory_bytes_bwd=host.memory_bytes_bwd + extra.memory_bytes_bwd,
        kernels_fwd=host.kernels_fwd + extra.kernels_fwd, kernels_bwd=host.kernels_bwd + extra.kernels_bwd,
        # Under autocast the merged unit is measured only if both parts are (0: unmeasured).
        autocast_kernels_fwd=(host.autocast_kernels_fwd + extra.autocast_kernels_fwd
                              if host.autocast_kernels_fwd and extra.autocast_kernels_fwd else 0),
        autocast_kernels_bwd=(host.autocast_kernels_bwd + extra.autocast_kernels_bwd
                              if host.autocast_kernels_fwd and extra.autocast_kernels_fwd else 0),
        tp_collectives=host.tp_collectives + extra.tp_collectives,
        # An interlaced share's activations live only between its own forward and backward,
        # which run back to back: a temporary of the host, not an activation in flight.
        transient_bytes=host.transient_bytes + b.none + extra.transient_bytes,
        activation_bytes=a)


def _interlaced_share(layer: LayerSpec, pp: int, input_bytes: float, output_bytes: float,
                      input_float: bool) -> LayerSpec:
    """One pipeline group's share of an interlaced unit sharded over all pp x tp ranks: the
    sharded parts divided by pp (the cost model divides by tp), its collectives over the
    whole pipeline, plus bringing its input to every rank and its output back."""
    def sh(s: Split) -> Split:
        return Split(s.replicated, s.sharded / pp)

    def gm(gs):
        return tuple(dataclasses.replace(g, **{g.shard_dim: getattr(g, g.shard_dim) / pp}) if g.shard_dim else g
                     for g in gs)
    colls = tuple(dataclasses.replace(c, scope="pipeline") for c in layer.tp_collectives)
    # The unit's input lives on one stage: all ranks of the pipeline need it (forward) and
    # its gradient, summed over them, goes back (backward); the output likewise.
    if input_bytes:
        colls += (Collective("all_gather", input_bytes, "forward", True, "pipeline"),)
        if input_float:
            colls += (Collective("reduce_scatter", input_bytes, "backward", True, "pipeline"),)
    if output_bytes:
        colls += (Collective("reduce_scatter", output_bytes, "forward", True, "pipeline"),
                  Collective("all_gather", output_bytes, "backward", True, "pipeline"))
    a = layer.activation_bytes
    return dataclasses.replace(
        layer, params=sh(layer.params), flops_fwd=sh(layer.flops_fwd), flops_bwd=sh(layer.flops_bwd),
        gemms_fwd=gm(layer.gemms_fwd), gemms_bwd=gm(layer.gemms_bwd),
        attention_flops_fwd=sh(layer.attention_flops_fwd), attention_flops_bwd=sh(layer.attention_flops_bwd),
        memory_bytes_fwd=sh(layer.memory_bytes_fwd), memory_bytes_bwd=sh(layer.memory_bytes_bwd),
        activation_bytes=ActivationBytes(sh(a.none), sh(a.selective), sh(a.full)),
        transient_bytes=sh(layer.transient_bytes), tp_collectives=colls)


def layout_spec(model: ModelGraph, layouts: Layouts | None, degree: int, stage_starts: tuple[int, ...] = (0,),
                pp: int = 1) -> ModelSpec:
    """The ModelSpec of ``model`` under ``layouts`` for tensor-parallel ``degree``.

    ``stage_starts`` (the first unit of each pipeline group's first stage) and ``pp`` place
    interlaced units' shares; without interlaced units they are not needed."""
    if layouts is not None:
        layouts.validate(model.num_units)
    specs = []
    cache: dict = {}
    for i in range(model.num_units):
        g = model.graph_of(i)
        u = layouts.for_unit(i) if layouts is not None else None
        if u is not None and u.signature and u.signature != g.signature:
            raise ConfigError(f"layouts.units[{layouts.units.index(u)}].signature",
                              f"was made for another graph of unit {i} ({u.signature} vs {g.signature})",
                              "search the layouts again for this model")
        key = (model.units[i], id(u))
        if key not in cache:
            spec = layer_spec(g, u, degree)
            cache[key] = coshard_spec(spec, u.coshard) if u is not None else spec
        specs.append(dataclasses.replace(cache[key], name=f"{g.kind}.{i}"))
    if layouts is not None and layouts.interlaced:
        shares = []
        for i in layouts.interlaced:
            g = model.graph_of(i)
            first = i == 0
            in_bytes = 0.0 if first else g.input_info().nbytes
            out_bytes = 0.0 if g.has_loss or i == model.num_units - 1 else g.output_info().nbytes
            shares.append(_interlaced_share(specs[i], pp, in_bytes, out_bytes,
                                            g.input_info().dtype.is_floating_point))
            specs[i] = _empty(specs[i])
        hosts = sorted(set(stage_starts))
        for h in hosts:
            host = specs[h]
            for s in shares:
                host = _merge(host, s)
            specs[h] = host
    tied = getattr(model.config, "tie_embeddings", False)
    return ModelSpec(name=model.name, layers=tuple(specs), seq_len=model.seq_len, dtype=model.dtype,
                     tokens_per_sample=model.tokens_per_sample, config=model.config, tp_shardable=True,
                     vocab=getattr(model.config, "vocab", 0), hidden=getattr(model.config, "hidden", 0),
                     shared_params=float(model.config.vocab * model.config.hidden) if tied else 0.0)


def _empty(layer: LayerSpec) -> LayerSpec:
    """A unit whose work moved elsewhere (interlaced): it only passes its activation on."""
    return LayerSpec(name=layer.name, kind=layer.kind, params=Split(), flops_fwd=Split(), flops_bwd=Split(),
                     output_bytes=layer.output_bytes)



def plan_view(model: ModelGraph, plan) -> ModelSpec:
    """The ModelSpec a plan with operator layouts is estimated on: the view of ``model``
    under ``plan.layouts`` at the plan's tensor-parallel degree, interlaced shares on the
    first stage of each pipeline group."""
    starts = tuple(plan.stages[g].start for g in range(plan.pp))
    return layout_spec(model, plan.layouts, max(g.tp for g in plan.groups), starts, plan.pp)
