"""What one operator costs under one layout: measured on ``meta`` at the shard shapes.

For an operator node and a strategy (see :mod:`autoplan.models.strategies`) the operator
is run forward and backward on meta tensors shaped as one tensor-parallel rank holds them
(Shard(d) divides dimension d by the degree; Replicate and Partial tensors are full size)
under ``FlopCounterMode`` and the dispatch census of :mod:`autoplan.models.extract`:
FLOPs, every matmul's shape, fused-attention FLOPs, bytes moved by bandwidth-bound
kernels, kernel launches, and autograd's saved tensors attributed to the operator's
inputs, its outputs or its own temporaries. Running it at micro-batch 1 and 2 tells which
matmul dimension grows with the micro-batch. Everything is per sample.

Where the operator cannot run at local shapes (views and reshapes carry global sizes as
arguments), its full-size cost is divided by the degree when the strategy divides the
work. ``aten.scaled_dot_product_attention`` is measured as the fused FlashAttention
kernel a GPU runs (no s x s scores saved), as the zoo's ``attention='flash'`` is.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autoplan.errors import ConfigError
from autoplan.models.extract import _CensusMode, _fused_kernel
from autoplan.models.graph import OpNode, TensorInfo, UnitGraph
from autoplan.models.spec import Gemm
from autoplan.models.strategies import Strategy, _fx_node

_aten = torch.ops.aten
_ATTENTION = {_aten.scaled_dot_product_attention.default, _aten._scaled_dot_product_flash_attention.default,
              _aten._scaled_dot_product_efficient_attention.default}
ATTENTION_OPS = frozenset(str(op) for op in _ATTENTION)
_FUSED_OPS = {_aten._fused_rms_norm.default}
"""Operators that make up an attention core (what selective recomputation re-runs)."""


@dataclass(frozen=True)
class OpCost:
    """Per-sample cost of one operator on one tensor-parallel rank."""

    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    gemms_fwd: tuple[Gemm, ...] = ()
    gemms_bwd: tuple[Gemm, ...] = ()
    attention_flops_fwd: float = 0.0
    attention_flops_bwd: float = 0.0
    memory_bytes_fwd: float = 0.0
    memory_bytes_bwd: float = 0.0
    kernels_fwd: int = 0
    kernels_bwd: int = 0
    saved_inputs: tuple[float, ...] = ()
    """Bytes autograd keeps of each tensor argument (0 where it keeps none)."""
    saved_outputs: tuple[float, ...] = ()
    """Bytes kept of each output."""
    saved_internal: float = 0.0
    """Bytes kept of the operator's own temporaries (e.g. attention's log-sum-exp)."""
    local: bool = True
    """Measured at the shard shapes (False: the full-size cost divided by the degree)."""
    causal: bool = False
    """A causal attention kernel: a fused kernel skips the masked half of its FLOPs."""

    def scaled(self, k: float) -> "OpCost":
        g = lambda gs: tuple(Gemm(x.m * (k if x.batch_dim == "m" else 1), x.n, x.k * (k if x.batch_dim == "k" else 1),
                                  x.count * (k if x.batch_dim == "count" else 1), x.shard_dim, x.batch_dim,
                                  x.in_core) for x in gs)
        return OpCost(self.flops_fwd * k, self.flops_bwd * k, g(self.gemms_fwd), g(self.gemms_bwd),
                      self.attention_flops_fwd * k, self.attention_flops_bwd * k, self.memory_bytes_fwd * k,
                      self.memory_bytes_bwd * k, self.kernels_fwd, self.kernels_bwd,
                      tuple(x * k for x in self.saved_inputs), tuple(x * k for x in self.saved_outputs),
                      self.saved_internal * k, self.local, self.causal)


def local_shape(info: TensorInfo, placement: str | None, degree: int, batch: int) -> tuple[int, ...]:
    shape = [s * batch if d in info.batch_dims else s for d, s in enumerate(info.shape)]
    if placement is not None and placement.startswith("S"):
        d = int(placement[1:])
        shape[d] //= degree
    return tuple(shape)


class _Saved:
    def __init__(self):
        self.saved: list[torch.Tensor] = []

    def pack(self, t):
        self.saved.append(t)
        return t


def _key_of(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _run(target, args, kwargs, flash: bool):
    if flash:
        q, k, v = args[:3]
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
    return target(*args, **kwargs)


def _flash_ok(target, args, kwargs) -> bool:
    if target != _aten.scaled_dot_product_attention.default:
        return False
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return mask is None and not dropout and args[0].dim() == 4


def _census(target, fx_args, fx_kwargs, tensors: list[torch.Tensor]) -> dict:
    """Run the operator once forward and backward on ``tensors`` (its tensor arguments in order)."""
    it = iter(tensors)

    def fill(a):
        return next(it) if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else a
    args = pytree.tree_map(fill, list(fx_args))
    kwargs = {k: (v if not isinstance(v, torch.fx.Node) else v.meta.get("val")) for k, v in fx_kwargs.items()}
    if "device" in kwargs:
        kwargs["device"] = torch.device("meta")
    flash = _flash_ok(target, args, kwargs)
    # A fused kernel (RMSNorm) is one kernel reading its inputs and writing its outputs, as
    # the layer-level measurement charges it, not the meta decomposition's fp32 steps.
    fused = target in _FUSED_OPS
    saved = _Saved()
    cf = _CensusMode()
    with FlopCounterMode(display=False) as fc_f, cf, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        if fused:
            with _fused_kernel(*tensors) as written:
                out = _run(target, args, kwargs, flash)
                written += [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        else:
            out = _run(target, args, kwargs, flash)
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    grad_outs = [o for o in outs if o.requires_grad and o.is_floating_point()]
    needs = [t for t in tensors if t.requires_grad]
    cb = _CensusMode()
    flops_b = 0.0
    if grad_outs and needs:
        # The incoming gradients exist before the backward runs: made outside the census.
        ones = [torch.ones_like(o) for o in grad_outs]
        with FlopCounterMode(display=False) as fc_b, cb:
            if fused:
                with _fused_kernel(*ones, *tensors) as written:
                    got = torch.autograd.grad(grad_outs, needs, ones, allow_unused=True)
                    written += [g for g in got if g is not None]
            else:
                torch.autograd.grad(grad_outs, needs, ones, allow_unused=True)
        flops_b = float(fc_b.get_total_flops())
    # Attribute every saved storage once: to an input, an output, or the operator itself.
    in_keys = {}
    for i, t in enumerate(tensors):
        in_keys.setdefault(_key_of(t), i)
    out_keys = {}
    for j, o in enumerate(pytree.tree_leaves(out)):
        if isinstance(o, torch.Tensor):
            out_keys.setdefault(_key_of(o), j)
    saved_in = [0.0] * len(tensors)
    n_out = len(pytree.tree_leaves(out))
    saved_out = [0.0] * n_out
    internal = 0.0
    seen = set()
    for t in saved.saved:
        k = _key_of(t)
        if k in seen:
            continue
        seen.add(k)
        nbytes = float(t.untyped_storage().nbytes())
        if k in in_keys:
            saved_in[in_keys[k]] = float(tensors[in_keys[k]].untyped_storage().nbytes())
        elif k in out_keys:
            saved_out[out_keys[k]] = nbytes
        else:
            internal += nbytes
    return dict(flops_f=float(fc_f.get_total_flops()), flops_b=flops_b, fwd=cf.census, bwd=cb.census,
                saved_in=saved_in, saved_out=saved_out, internal=internal)


def _inputs(graph: UnitGraph, node: OpNode, strategy: Strategy, degree: int, batch: int) -> list[torch.Tensor]:
    out = []
    for (src, idx), p in zip(node.args, strategy.inputs):
        producer = graph.node(src)
        info = producer.outputs[idx]
        t = torch.empty(local_shape(info, p, degree, batch), dtype=info.dtype, device="meta")
        if info.dtype.is_floating_point:
            t.requires_grad_(True)
        out.append(t)
    return out


def _gemms(base: list, batch2: list, core: bool) -> tuple[Gemm, ...]:
    names = ("m", "n", "k", "count")
    out = []
    for g1, g2 in zip(base, batch2):
        grown = [d for d, a, b in zip(names, g1[:4], g2[:4]) if b > a]
        out.append(Gemm(m=float(g1[0]), n=float(g1[1]), k=float(g1[2]), count=float(g1[3]),
                        batch_dim=grown[0] if grown else "m", in_core=core))
    return tuple(out)


_CACHE: dict = {}


def op_cost(graph: UnitGraph, node: OpNode, strategy: Strategy, degree: int) -> OpCost:
    """Per-sample cost of ``node`` run as ``strategy`` on one of ``degree`` ranks (cached)."""
    fx = _fx_node(graph, node.name)
    in_infos = tuple(graph.node(s).outputs[i] for s, i in node.args)
    key = (str(fx.target), repr((fx.args, fx.kwargs)) if not in_infos else
           repr([a if not isinstance(a, torch.fx.Node) else "T" for a in pytree.tree_leaves((list(fx.args), dict(fx.kwargs)))]),
           tuple((i.shape, str(i.dtype), tuple(sorted(i.batch_dims))) if i else None for i in in_infos),
           strategy.inputs, strategy.divides_work, degree)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    core = str(fx.target) in ATTENTION_OPS
    try:
        m1 = _census(fx.target, fx.args, fx.kwargs, _inputs(graph, node, strategy, degree, 1))
        m2 = _census(fx.target, fx.args, fx.kwargs, _inputs(graph, node, strategy, degree, 2))
        local = True
    except Exception:   # global sizes in the arguments (views, reshapes): measure the traced call
        m1 = _traced(fx, graph.micro_batch)
        m2 = None
        local = False
    cost = OpCost(
        flops_fwd=m1["flops_f"], flops_bwd=m1["flops_b"],
        gemms_fwd=_gemms(m1["fwd"].gemms, (m2 or m1)["fwd"].gemms, core),
        gemms_bwd=_gemms(m1["bwd"].gemms, (m2 or m1)["bwd"].gemms, core),
        attention_flops_fwd=m1["fwd"].attention_flops, attention_flops_bwd=m1["bwd"].attention_flops,
        memory_bytes_fwd=m1["fwd"].memory_bytes, memory_bytes_bwd=m1["bwd"].memory_bytes,
        kernels_fwd=m1["fwd"].kernels, kernels_bwd=m1["bwd"].kernels,
        saved_inputs=tuple(m1["saved_in"]), saved_outputs=tuple(m1["saved_out"]),
        saved_internal=m1["internal"], local=local, causal=core and _is_causal(fx))
    if not local:
        share = 1.0 / graph.micro_batch / (degree if strategy.divides_work else 1)
        cost = cost.scaled(share)
    _CACHE[key] = cost
    return cost


def _is_causal(fx: torch.fx.Node) -> bool:
    if fx.target == _aten.scaled_dot_product_attention.default:
        return bool(fx.kwargs.get("is_causal", fx.args[5] if len(fx.args) > 5 else False))
    if fx.target == _aten._scaled_dot_product_flash_attention.default:
        return bool(fx.kwargs.get("is_causal", fx.args[4] if len(fx.args) > 4 else False))
    return False


def _traced(fx: torch.fx.Node, micro_batch: int) -> dict:
    tensors = []
    for a in pytree.tree_leaves(list(fx.args)):
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            v = a.meta["val"]
            t = torch.empty(v.shape, dtype=v.dtype, device="meta")
            if v.is_floating_point():
                t.requires_grad_(True)
            tensors.append(t)
    try:
        return _census(fx.target, fx.args, fx.kwargs, tensors)
    except Exception as e:   # noqa: BLE001 - any failure of the op on meta; costing it at zero would hide it
        raise ConfigError(f"operator {fx.name} ({fx.target})",
                          f"cannot be run on meta to measure its cost ({type(e).__name__}: {e})",
                          "search without --layouts, which measures whole layers") from e


def op_key(graph: UnitGraph, node: OpNode, strategy: Strategy, degree: int) -> str:
    """The key an operator profile stores a measurement under: operator, shard shapes, dtype."""
    shapes = []
    for (src, idx), p in zip(node.args, strategy.inputs):
        info = graph.node(src).outputs[idx]
        shapes.append(f"{'x'.join(map(str, local_shape(info, p, degree, 1)))}:{info.dtype}".replace("torch.", ""))
    return f"{node.op_name}({','.join(shapes)})|{','.join(p or '-' for p in strategy.inputs)}"
