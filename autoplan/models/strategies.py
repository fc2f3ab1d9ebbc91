"""Which layouts each operator admits, taken from DTensor's own sharding strategies.

For one operator node of a unit graph and a tensor-parallel degree, ``node_strategies``
lists every valid combination of (output placements, input placements) on a 1-D mesh,
exactly as DTensor's sharding propagation would accept them:

1. operators with a *single-dim strategy* (pointwise ops, norms, embedding, convolution,
   ...): DTensor's rule for one mesh dimension, placeholders expanded to Shard(d);
2. operators with an *op strategy* (matmuls, views, reductions, attention kernels, ...):
   the strategy function is called with every candidate input placement;
3. composite operators (``aten.linear``, ``aten.scaled_dot_product_attention``,
   ``aten.layer_norm``, ...): DTensor's decomposition propagator runs the operator's
   decomposition on placement-tracking meta tensors for every candidate input placement
   and keeps the combinations that need no redistribution inside;
4. anything else runs replicated.

A strategy is dropped when it shards a batch dimension (the batch belongs to the
data-parallel axis), shards a dimension the degree does not divide, or uses a Partial
other than a sum. DTensor's ``_MaskPartial`` (a vocabulary-sharded embedding) counts as
'P' for the output it produces and as 'R' for the token ids it reads (masking them is local).

These are DTensor internals (``ShardingPropagator``); this module is the one place that
touches them, and ``tests/test_operator_layouts.py`` fails loudly if they change shape.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils import _pytree as pytree

from autoplan.models.graph import OpNode, TensorInfo, UnitGraph


@dataclass(frozen=True)
class Strategy:
    """One way to run an operator on the tensor-parallel ranks."""

    outputs: tuple[str | None, ...]
    """Placement of each output ('R', 'P', 'S<d>'; None where the output is not a tensor)."""
    inputs: tuple[str | None, ...]
    """Placement each tensor argument must have (None: an argument with no placement)."""
    collectives: tuple[tuple[str, float, str], ...] = ()
    """Collectives the operator runs inside (kind, full bytes per sample, phase): only the
    vocabulary-parallel loss has some (``loss_parallel``)."""

    @property
    def divides_work(self) -> bool:
        """Each rank does 1/degree of the operator's work (some tensor is sharded)."""
        return any(p is not None and p.startswith("S") for p in self.outputs + self.inputs)

    @property
    def replicated(self) -> bool:
        return all(p in (None, "R") for p in self.outputs + self.inputs)





def _mesh(degree: int):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", torch.arange(degree), _init_backend=False, _rank=0)


@lru_cache(maxsize=None)
def _mesh_cached(degree: int):
    return _mesh(degree)


def _placement_str(p, role: str) -> str | None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._ops._embedding_ops import _MaskPartial
    if p is None:
        return None
    if isinstance(p, _MaskPartial):
        return "P" if role == "out" else "R"
    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else "?"
    return "?"   # _StridedShard and anything newer: not offered


def _valid(placement: str | None, info: TensorInfo | None, degree: int) -> bool:
    if placement is None:
        return True
    if placement == "?":
        return False
    if info is None:
        return placement == "R"
    if placement.startswith("S"):
        d = int(placement[1:])
        return info.shardable(d, degree)
    return True


def _fx_node(graph: UnitGraph, name: str) -> torch.fx.Node:
    for n in graph.gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(name)


def _tensor_meta(t: torch.Tensor):
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _raw_rows(fx: torch.fx.Node, degree: int, excluded: dict[str, frozenset]) -> list[tuple[tuple, tuple]]:
    """(output placements, input placements) as DTensor objects, for every strategy DTensor has."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy

    op = fx.target
    prop = DTensor._op_dispatcher.sharding_propagator
    mesh = _mesh_cached(degree)
    tensors = [a for a in pytree.tree_leaves(fx.args) if _is_tensor_node(a)]
    n_in = len(tensors)
    val = fx.meta.get("val")
    outs = (val,) if isinstance(val, torch.Tensor) else tuple(val) if isinstance(val, (tuple, list)) else (val,)
    n_out = len(outs)

    def candidates(a: torch.fx.Node):
        # Candidate input placements: batch dimensions are never sharded (``excluded``
        # lists them) and integer tensors (token ids, targets) are never partial. A
        # parameter is stored replicated or sharded, but an operator may still read it as
        # Partial (a bias added on one rank only: a local redistribution).
        t = a.meta["val"]
        skip = excluded.get(a.name, frozenset())
        partial = [Partial()] if t.is_floating_point() else []
        return [Replicate()] + partial + [Shard(d) for d in range(t.dim()) if d not in skip]

    rows: list[tuple[tuple, tuple]] = []
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    if op == torch.ops.aten.scaled_dot_product_attention.default and n_in == 3 and flash in prop.op_strategy_funcs:
        # Composite attention: its decomposition builds a causal mask from scratch, which
        # DTensor cannot propagate; the fused kernel it lowers to has a strategy (shard
        # batch or heads of q, k, v alike), and that is what runs.
        def to_strategy(a):
            tm = _tensor_meta(a.meta["val"])
            return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tm)) for p in candidates(a)])
        causal = fx.kwargs.get("is_causal", fx.args[5] if len(fx.args) > 5 else False)
        schema = OpSchema(flash, tuple(to_strategy(a) for a in tensors) + (0.0, causal), {})
        for spec in prop.op_strategy_funcs[flash](schema).strategies:
            o = spec.output_specs
            o = o if isinstance(o, tuple) else (o,)
            ins = tuple(x.placements[0] for x in spec.input_specs[:3])
            if o[0] is not None:
                rows.append(((o[0].placements[0],), ins))
        return rows
    if op in prop.op_single_dim_strategy_funcs:
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
        info = prop.op_single_dim_strategy_funcs[op]
        args = pytree.tree_map(lambda a: _tensor_meta(a.meta["val"]) if _is_tensor_node(a) else a, fx.args)
        kwargs = pytree.tree_map(lambda a: _tensor_meta(a.meta["val"]) if _is_tensor_node(a) else a, fx.kwargs)
        single = info.func(op, args, kwargs)
        for row in single:
            row = [Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in row]
            k = len(row) - n_in
            rows.append((tuple(row[:k]), tuple(row[k:])))
        rows.append(((Replicate(),) * n_out, (Replicate(),) * n_in))
    elif op in prop.op_strategy_funcs:
        def to_strategy(a):
            if not _is_tensor_node(a):
                return a
            tm = _tensor_meta(a.meta["val"])
            return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), tm)) for p in candidates(a)])
        from torch.distributed.tensor._op_schema import TupleStrategy

        def wrap(a):
            # A list of tensors (cat, stack) is one TupleStrategy argument, as DTensor wraps it.
            if isinstance(a, (list, tuple)) and a and all(_is_tensor_node(x) for x in a):
                return TupleStrategy(tuple(to_strategy(x) for x in a))
            return to_strategy(a)
        schema = OpSchema(op, tuple(wrap(a) for a in fx.args), {})
        strategy = prop.op_strategy_funcs[op](schema)
        if not isinstance(strategy, OpStrategy):
            return rows
        for spec in strategy.strategies:
            o = spec.output_specs
            o = o if isinstance(o, tuple) else (o,)
            outs_p = tuple(s.placements[0] if s is not None else None for s in o)
            ins = spec.input_specs or ((spec.output_specs,) * n_in if not isinstance(spec.output_specs, tuple) else ())
            ins_p = tuple(s.placements[0] if s is not None else None for s in ins)
            if len(ins_p) != n_in:
                continue
            rows.append((outs_p, ins_p))
    elif prop.decomp_strategy.has_decomp(op):
        decomp = prop.decomp_strategy
        fake = decomp._get_fake_mesh("cpu")
        def spec(a):
            if not _is_tensor_node(a):
                return a
            return DTensorSpec(mesh, (Replicate(),), _tensor_meta(a.meta["val"]))
        schema = OpSchema(op, tuple(pytree.tree_map(spec, list(fx.args))),
                          {k: v for k, v in fx.kwargs.items() if not isinstance(v, torch.fx.Node)})
        # One candidate list per leaf of the arguments (None for the non-tensor ones).
        leaves = pytree.tree_leaves(list(fx.args))
        per_leaf = [candidates(a) if _is_tensor_node(a) else [None] for a in leaves]
        tensor_leaf = [_is_tensor_node(a) for a in leaves]
        for combo in itertools.product(*per_leaf):
            try:
                out = decomp._propagate_through_decomp(schema, combo, fake)
            except Exception:   # DTensor signals "would need a redistribution" by raising
                continue
            out = out if isinstance(out, tuple) else (out,)
            rows.append((tuple(out), tuple(p for p, is_t in zip(combo, tensor_leaf) if is_t)))
    if not rows:
        rows.append(((Replicate(),) * n_out, (Replicate(),) * n_in))
    return rows


_ROWS_CACHE: dict = {}


def _key(fx: torch.fx.Node, degree: int, excluded: dict[str, frozenset]):
    """Cache key of an operator's raw strategies. Decomposition rules depend on tensor
    ranks, on which dimensions are singletons and on the non-tensor arguments, not on
    sizes or the degree, so one linear of each rank signature is propagated once."""
    from torch.distributed.tensor import DTensor
    prop = DTensor._op_dispatcher.sharding_propagator
    by_rule = (fx.target not in prop.op_single_dim_strategy_funcs and fx.target not in prop.op_strategy_funcs)

    def k(a):
        if _is_tensor_node(a):
            t = a.meta["val"]
            shape = tuple(1 if s == 1 else -1 for s in t.shape) if by_rule else tuple(t.shape)
            return ("T", shape, str(t.dtype), tuple(sorted(excluded.get(a.name, ()), key=str)))
        if isinstance(a, torch.fx.Node):
            return ("N",)
        return repr(a)
    return (str(fx.target), None if by_rule else degree,
            repr(pytree.tree_map(k, (list(fx.args), dict(fx.kwargs)))))


def node_strategies(graph: UnitGraph, node: OpNode, degree: int) -> list[Strategy]:
    """Every valid strategy of an operator node on ``degree`` tensor-parallel ranks
    (always including the all-replicated one). Deterministic order, no duplicates."""
    if node.kind != "op":
        raise ValueError(f"{node.name} is not an operator node")
    if degree == 1:
        return [_replicated(node)]
    fx = _fx_node(graph, node.name)
    excluded = {}
    for src, idx in node.args:
        producer = graph.node(src)
        info = producer.outputs[idx]
        excluded[src] = (frozenset({"param"}) if producer.kind == "param" else frozenset()) | \
            (info.batch_dims if info is not None else frozenset())
    key = _key(fx, degree, excluded)
    rows = _ROWS_CACHE.get(key)
    if rows is None:
        try:
            raw = _raw_rows(fx, degree, excluded)
        except Exception:   # an operator DTensor cannot describe runs replicated
            raw = []
        rows = [(tuple(_placement_str(p, "out") for p in o), tuple(_placement_str(p, "in") for p in i))
                for o, i in raw]
        _ROWS_CACHE[key] = rows
    in_infos = [graph.node(src).outputs[idx] for src, idx in node.args]
    out: list[Strategy] = []
    seen = set()
    for outs, ins in rows:
        outs = tuple(outs[j] if j < len(outs) else None for j in range(len(node.outputs)))
        outs = tuple(None if node.outputs[j] is None else p for j, p in enumerate(outs))
        if len(ins) != len(in_infos):
            continue
        if not all(_valid(p, info, degree) for p, info in zip(outs, node.outputs)):
            continue
        if not all(_valid(p, info, degree) for p, info in zip(ins, in_infos)):
            continue
        s = Strategy(outs, tuple(ins))
        if s not in seen:
            seen.add(s)
            out.append(s)
    rep = _replicated(node)
    if rep not in seen:
        out.insert(0, rep)
    vocab = _vocab_parallel_loss(graph, node, fx, in_infos, degree)
    if vocab is not None:
        out.append(vocab)
    return out


def _vocab_parallel_loss(graph: UnitGraph, node: OpNode, fx: torch.fx.Node, in_infos, degree: int) -> Strategy | None:
    """Cross-entropy over logits sharded along the classes, as DTensor's ``loss_parallel``
    (and Megatron's vocabulary-parallel loss) computes it: each rank reduces its share of
    the classes and three all-reduces of one float per token (max, sum of exponentials,
    the target's logit) combine them; the backward is local."""
    if fx.target != torch.ops.aten.cross_entropy_loss.default or len(in_infos) != 2:
        return None
    args = list(fx.args) + [None] * 6
    weight, reduction, ignore, smoothing = args[2], args[3], args[4], args[5]
    if weight is not None or reduction not in (None, 1) or (smoothing not in (None, 0.0)) \
            or fx.kwargs.get("label_smoothing", 0.0) or (ignore not in (None, -100)):
        return None
    logits = in_infos[0]
    if logits is None or len(logits.shape) != 2 or not logits.shardable(1, degree):
        return None
    tokens = logits.shape[0] * 4.0
    comm = tuple(("all_reduce", tokens, "forward") for _ in range(3))
    return Strategy(("R",), ("S1", "R"), comm)


def _replicated(node: OpNode) -> Strategy:
    return Strategy(tuple(None if o is None else "R" for o in node.outputs), tuple("R" for _ in node.args))


def tensor_choices(info: TensorInfo, degree: int, partial: bool = False) -> list[str]:
    """Placements a standalone tensor (a parameter or a unit input) may take."""
    out = ["R"] + [f"S{d}" for d in range(len(info.shape)) if info.shardable(d, degree)]
    if partial:
        out.append("P")
    return out
