"""Measure a ModelSpec from real ``nn.Module``s on the ``meta`` device.

Each distinct pipeline unit is run forward and backward on meta tensors (no memory
is allocated, so a 405B model is fine on a laptop) under

* ``FlopCounterMode`` for forward and backward FLOPs,
* a dispatch census recording every matmul's shape, every fused-attention call and
  the bytes moved by bandwidth-bound kernels,
* autograd saved-tensor hooks for the activation bytes kept for backward.

Tensor-parallel sharding is separated from replicated cost by measuring the unit a
second time with heads, kv heads and MLP width doubled (what one rank of TP=t runs is
the same module with those counts divided by t); everything a layer costs is linear
in those counts, so two measurements give ``replicated + sharded / t`` exactly.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from autoplan.errors import ConfigError
from autoplan.models.autocast import AutocastEmulation
from autoplan.models.spec import ActivationBytes, ExpertSpec, Gemm, LayerSpec, ModelSpec, RecomputePrefix, Split

_aten = torch.ops.aten
_GEMMS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
# Ops that allocate or reinterpret without moving activation data through HBM.
_NO_TRAFFIC = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
               "detach", "lift_fresh", "_local_scalar_dense", "scalar_tensor", "arange",
               "sym_size", "sym_stride", "copy_", "_unsafe_view", "_reshape_alias")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class _Census:
    """What one forward or backward pass ran."""

    gemms: list = field(default_factory=list)        # (m, n, k, count, in_core, in_experts)
    attention_flops: float = 0.0
    memory_bytes: float = 0.0
    core_memory_bytes: float = 0.0
    kernels: int = 0

    def so_far(self) -> tuple[int, float, float, int]:
        """(GEMMs, attention FLOPs, bytes moved, kernels) recorded until now."""
        return len(self.gemms), self.attention_flops, self.memory_bytes, self.kernels


class _CensusMode(TorchDispatchMode):
    """Records matmul shapes, fused attention FLOPs and bandwidth-bound traffic."""

    active: list["_CensusMode"] = []

    def __enter__(self):
        _CensusMode.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _CensusMode.active.remove(self)
        return super().__exit__(*exc)

    def __init__(self, expert_nodes: "_ExpertNodes | None" = None):
        super().__init__()
        self.census = _Census()
        self.in_core = False
        self.in_experts = False
        self.expert_nodes = expert_nodes
        """In backward: tells which autograd nodes belong to routed experts (forward sets
        ``in_experts`` from module hooks instead)."""

    def _expert_op(self) -> bool:
        if self.in_experts:
            return True
        return self.expert_nodes is not None and self.expert_nodes.running()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _FUSED.depth:
            return out  # inside a fused kernel: charged once by _charge_fused
        c = self.census
        name = func.overloadpacket.__name__
        if func in _GEMMS:
            a, b = (args[1], args[2]) if func in (_aten.addmm.default, _aten.baddbmm.default) else args[:2]
            expert = self._expert_op()
            if a.dim() == 2:
                c.gemms.append((a.shape[0], b.shape[1], a.shape[1], 1, self.in_core, expert))
            else:
                c.gemms.append((a.shape[1], b.shape[2], a.shape[2], a.shape[0], self.in_core, expert))
            c.kernels += 1
        elif "scaled_dot_product" in name:
            c.attention_flops += flop_registry[func.overloadpacket](*args, out_val=out, **kwargs)
            c.kernels += 1
        elif not func.is_view and name not in _NO_TRAFFIC:
            moved = sum(t.nbytes for t in _tensors((args, kwargs, out)))
            c.memory_bytes += moved
            if self.in_core:
                c.core_memory_bytes += moved
            c.kernels += 1
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


class _FlashAttention(torch.autograd.Function):
    """The fused attention kernel a GPU run uses, for meta-device measurement.

    Eager SDPA on meta decomposes into the math path and would save the s x s score
    matrix; FlashAttention saves only q, k, v, the output and the log-sum-exp, and its
    backward recomputes the scores. This reproduces exactly that footprint and the
    kernel's FLOP count (grouped-query k/v are saved unrepeated, as FlashAttention-2 does)."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        group = q.shape[1] // k.shape[1]
        kr, vr = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if group > 1 else (k, v)
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        g = ctx.group
        kr, vr = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
        s = q.shape[2]
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            grad, q, kr, vr, out, lse, None, None, s, s, 0.0, ctx.causal,
            torch.empty(2, dtype=torch.uint64, device=q.device),
            torch.empty((), dtype=torch.uint64, device=q.device))
        if g > 1:
            b, h, s_, d = dk.shape
            dk = dk.view(b, h // g, g, s_, d).sum(2)
            dv = dv.view(b, h // g, g, s_, d).sum(2)
        return dq, dk, dv, None


class _FlashCore(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return _FlashAttention.apply(q, k, v, self.causal)


class _FusedState:
    """Depth of fused-kernel regions being run (their inner ops are not separate kernels)."""
    depth = 0


_FUSED = _FusedState()


@contextmanager
def _fused_kernel(*tensors: torch.Tensor):
    """Run a fused kernel's reference ops without charging them one by one; charge the
    kernel once: it reads its inputs and writes its outputs."""
    _FUSED.depth += 1
    result: list = []
    try:
        yield result
    finally:
        _FUSED.depth -= 1
    moved = sum(t.nbytes for t in _tensors((tensors, result)))
    for mode in _CensusMode.active:
        mode.census.memory_bytes += moved
        if mode.in_core:   # (a fused kernel inside the attention core is recomputed with it)
            mode.census.core_memory_bytes += moved
        mode.census.kernels += 1


class _FusedRMSNormFn(torch.autograd.Function):
    """RMSNorm as the fused GPU kernel runs it (PyTorch's ``_fused_rms_norm``, Apex and
    Transformer Engine alike): one kernel that saves the bf16 input and the per-token
    rstd. On meta, ``nn.RMSNorm`` decomposes into fp32 elementwise ops that would save
    fp32 copies of the input and the normalized output instead."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        with _fused_kernel(x, weight) as outputs:
            out, rstd = _aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
            outputs += [out, rstd]
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        with _fused_kernel(grad, x, rstd, weight) as outputs:
            dx, dw = _aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, [True, True])
            outputs += [dx, dw]
        return dx, dw, None


class _FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.bfloat16).eps

    def forward(self, x):
        return _FusedRMSNormFn.apply(x, self.weight, self.eps)


class _DropoutFn(torch.autograd.Function):
    """Dropout as CUDA runs it (``native_dropout``): one kernel that keeps a one-byte bool
    mask for the backward. On meta, ``native_dropout`` returns its mask in the input's
    dtype, which would count two bytes per element.

    With ``residual``, the dropout and the add of the branch to the residual stream are one
    kernel (Megatron-LM's bias-dropout-add fusion): it also reads the stream, and the stream's
    gradient passes through untouched."""

    @staticmethod
    def forward(ctx, x, p, residual=None):
        with _fused_kernel(*((x,) if residual is None else (residual, x))) as outputs:
            mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
            out = x * (1.0 / (1.0 - p))
            if residual is not None:
                out = residual + out
            outputs += [out, mask]
        ctx.save_for_backward(mask)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.has_residual = residual is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        with _fused_kernel(grad, mask) as outputs:
            dx = grad * ctx.scale
            outputs.append(dx)
        return dx, None, (grad if ctx.has_residual else None)


class _Dropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return _DropoutFn.apply(x, self.p)


class _FusedDropoutAdd(nn.Module):
    """``x + dropout(y)`` in the one kernel of _DropoutFn with a residual."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x, y):
        return _DropoutFn.apply(y, self.p, x)


class _ScaleMaskSoftmaxFn(torch.autograd.Function):
    """Scale, causal mask and softmax of the attention scores as one kernel each way
    (Megatron-LM's FusedScaleMaskSoftmax, on unless --no-masked-softmax-fusion): the
    forward reads the scores and writes the probabilities, which it saves; the backward
    reads their gradient and the probabilities and writes the scores' gradient. The mask is
    generated inside the kernel."""

    @staticmethod
    def forward(ctx, scores, scale, causal):
        with _fused_kernel(scores) as outputs:
            scaled = scores * scale
            if causal:
                s = scores.shape[-1]
                future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
                scaled = scaled.masked_fill(future, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            outputs.append(probs)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        with _fused_kernel(grad, probs) as outputs:
            d = torch.ops.aten._softmax_backward_data(grad, probs, -1, probs.dtype) * ctx.scale
            outputs.append(d)
        return d, None, None


class _FusedSoftmaxCore(nn.Module):
    """Explicit attention with the fused scale-mask-softmax (see _ScaleMaskSoftmaxFn)."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.causal, self.scale, self.dropout = core.causal, core.scale, core.dropout

    def forward(self, q, k, v):
        from autoplan.models.zoo.transformer import repeat_kv
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        probs = _ScaleMaskSoftmaxFn.apply(q @ k.transpose(-2, -1), scale, self.causal)
        return self.dropout(probs) @ v


class _GatedActFn(torch.autograd.Function):
    """A gated MLP's activation as one fused kernel each way (Megatron-Core's bias_swiglu
    and bias_geglu fusions, megatron/core/fusions/fused_bias_swiglu.py SwiGLUFunction): the
    forward reads the up and gate projections and writes their product, saving only those
    two inputs; the backward reads them with the gradient and recomputes the activation.
    The eager ``up * act(gate)`` also keeps ``act(gate)``: one more FFN-wide tensor."""

    @staticmethod
    def forward(ctx, up, gate, kind):
        with _fused_kernel(up, gate) as outputs:
            act = F.silu(gate) if kind == "swiglu" else F.gelu(gate, approximate="tanh")
            out = up * act
            outputs.append(out)
        ctx.save_for_backward(up, gate)
        ctx.kind = kind
        return out

    @staticmethod
    def backward(ctx, grad):
        up, gate = ctx.saved_tensors
        with _fused_kernel(grad, up, gate) as outputs:
            if ctx.kind == "swiglu":
                d_up = grad * F.silu(gate)
                d_gate = _aten.silu_backward(grad * up, gate)
            else:
                d_up = grad * F.gelu(gate, approximate="tanh")
                d_gate = _aten.gelu_backward(grad * up, gate, approximate="tanh")
            outputs += [d_up, d_gate]
        return d_up, d_gate, None


class _FusedGatedMLP(nn.Module):
    """A gated MLP whose activation is the fused kernel of _GatedActFn; the same linears."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.kind, self.w1, self.w3, self.w2 = mlp.kind, mlp.w1, mlp.w3, mlp.w2
        self._plan = mlp.tp_plan()

    def forward(self, x):
        return self.w2(_GatedActFn.apply(self.w1(x), self.w3(x), self.kind))

    def tp_plan(self):
        return dict(self._plan)


def _fuse_qkv(attention: nn.Module) -> None:
    """Give ``attention`` one q/k/v projection in place of three (Megatron-LM's and
    AA-Scaling's query_key_value linear): one GEMM forward, and in the backward one
    input-gradient GEMM where three separate projections need their three gradients added."""
    wq, wk, wv = attention.wq, attention.wk, attention.wv
    widths = [wq.out_features, wk.out_features, wv.out_features]
    fused = nn.Linear(wq.in_features, sum(widths), bias=wq.bias is not None,
                      device=wq.weight.device, dtype=wq.weight.dtype)
    del attention.wq, attention.wk, attention.wv
    attention.wqkv = fused

    def project(x):
        return attention.wqkv(x).split(widths, dim=-1)
    attention.project = project


@dataclass
class _Measurement:
    params: float
    flops_fwd: float
    flops_bwd: float
    fwd: _Census
    bwd: _Census
    saved_bytes: float
    core_saved_bytes: float
    expert_params: float
    expert_saved_bytes: float
    dispatch_bytes: float
    input_bytes: float
    output_bytes: float
    output: torch.Tensor
    last_save: tuple = (0, 0.0, 0.0, 0)
    """The forward's census at its last save (``_Census.so_far``), loss excluded."""
    saved_tensors: int = 0
    """Tensors autograd saved in the forward (parameters included)."""


def _cores(unit: nn.Module) -> list[nn.Module]:
    return [m for name, m in unit.named_modules() if name.endswith("attention.core")]


def _routed_experts(unit: nn.Module) -> list[nn.Module]:
    from autoplan.models.zoo.moe import GroupedExperts
    return [m for m in unit.modules() if isinstance(m, GroupedExperts)]


class _ExpertNodes:
    """The autograd nodes the routed experts' forward created (a range of sequence numbers
    per call), so that backward kernels can be attributed to the experts too: in backward
    no module hook runs, but ``torch._C._current_autograd_node()`` names the node running."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []
        self.input_bytes = 0.0
        """Bytes of the token slots the experts received (the dispatch buffer)."""
        self._start = 0

    def enter(self, x: torch.Tensor) -> None:
        # A throwaway view creates the next autograd node: its number bounds the range.
        self._start = x.view_as(x).grad_fn._sequence_nr() if x.requires_grad else 0
        self.input_bytes += x.nbytes

    def exit(self, out: torch.Tensor) -> None:
        if out.grad_fn is not None:
            self.ranges.append((self._start, out.grad_fn._sequence_nr()))

    def running(self) -> bool:
        node = torch._C._current_autograd_node()
        if node is None:
            return False
        n = node._sequence_nr()
        return any(a < n <= b for a, b in self.ranges)


@contextmanager
def _flag_experts(unit: nn.Module, flags: list, nodes: _ExpertNodes):
    """Sets ``in_experts`` on every object in ``flags`` while routed experts run forward, and
    records their autograd nodes in ``nodes``."""
    handles = []
    for experts in _routed_experts(unit):
        def pre(_m, args):
            nodes.enter(args[0])
            for f in flags:
                f.in_experts = True

        def post(_m, _a, out):
            nodes.exit(out)
            for f in flags:
                f.in_experts = False
        handles += [experts.register_forward_pre_hook(pre), experts.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _flag_cores(unit: nn.Module, flags: list):
    """Sets every object in ``flags``' ``in_core`` attribute while an attention core runs."""
    handles = []
    for core in _cores(unit):
        def pre(_m, args):
            for f in flags:
                f.in_core = True
                if hasattr(f, "core_inputs"):
                    f.core_inputs.update(t.untyped_storage()._cdata for t in _tensors(args))

        def post(_m, _a, _o):
            for f in flags:
                f.in_core = False
        handles += [core.register_forward_pre_hook(pre), core.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _SavedBytes:
    """Counts distinct storages autograd saves, skipping parameters, and notes how much of the
    forward had run at the last save (what an early-stopping checkpoint re-runs: autograd
    saves an op's inputs before the op runs, its outputs after)."""

    def __init__(self, param_storages: set, census: _Census):
        self.params = param_storages
        self.census = census
        self.last_save = (0, 0.0, 0.0, 0)
        self.packs = 0
        self.seen: dict[int, int] = {}
        self.core: dict[int, int] = {}
        self.experts: dict[int, int] = {}
        self.core_inputs: set[int] = set()
        self.in_core = False
        self.in_experts = False

    def pack(self, t: torch.Tensor):
        self.packs += 1
        self.last_save = self.census.so_far()
        key = t.untyped_storage()._cdata
        if key not in self.params:
            nbytes = t.untyped_storage().nbytes()
            self.seen.setdefault(key, nbytes)
            if self.in_core:
                self.core.setdefault(key, nbytes)
            if self.in_experts:
                self.experts.setdefault(key, nbytes)
        return t


def _measure(unit: nn.Module, x: torch.Tensor, loss=None, autocast: bool = False) -> _Measurement:
    """Run one unit forward and backward on meta and record what it costs; ``autocast``:
    with the forward (and loss) in an autocast region (:mod:`autoplan.models.autocast`),
    as autoplan's runtime runs a unit on fp32 weights."""
    params = float(sum(p.numel() for p in unit.parameters()))
    param_storages = {p.untyped_storage()._cdata for p in unit.parameters()}
    xs = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t
               for t in (x if isinstance(x, tuple) else (x,)))
    census_f = _CensusMode()
    saved = _SavedBytes(param_storages, census_f.census)
    nodes = _ExpertNodes()
    with _flag_cores(unit, [saved, census_f]), _flag_experts(unit, [saved, census_f], nodes):
        with FlopCounterMode(display=False) as fc_f, (AutocastEmulation() if autocast else nullcontext()):
            with census_f, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                out = unit(*xs)
                scalar = loss(out) if loss is not None else out.float().sum()
    # Inputs of the core (q, k, v) stay saved when the core is recomputed.
    core_saved = sum(n for k, n in saved.core.items() if k not in saved.core_inputs)
    census_b = _CensusMode(nodes)
    with FlopCounterMode(display=False) as fc_b, census_b:
        scalar.backward()
    expert_params = float(sum(p.numel() for e in _routed_experts(unit) for p in e.parameters()))
    return _Measurement(
        params=params, flops_fwd=float(fc_f.get_total_flops()), flops_bwd=float(fc_b.get_total_flops()),
        fwd=census_f.census, bwd=census_b.census, saved_bytes=float(sum(saved.seen.values())),
        core_saved_bytes=float(core_saved), expert_params=expert_params,
        expert_saved_bytes=float(sum(saved.experts.values())), dispatch_bytes=float(nodes.input_bytes),
        input_bytes=float(sum(t.nbytes for t in xs)),
        output_bytes=float(out.nbytes) if loss is None else 0.0, output=out.detach(),
        last_save=saved.last_save, saved_tensors=saved.packs)


def _measure_last(unit: nn.Module, x: torch.Tensor, loss, autocast: bool = False) -> _Measurement:
    """The last unit with its loss: kernels, FLOPs and traffic include the loss, but the
    saved bytes are the unit's own and the output is the logits. What the loss keeps (an
    fp32 softmax, a fused kernel's statistics, ...) depends on the training stack, which
    the cost model adds per logit (``autoplan.stacks.Stack.loss_saved_bytes_per_logit``)."""
    with_loss = _measure(unit, x, loss=loss, autocast=autocast)
    own = _measure(unit, x, autocast=autocast)
    return dataclasses.replace(with_loss, saved_bytes=own.saved_bytes, core_saved_bytes=own.core_saved_bytes,
                               output_bytes=own.output_bytes, last_save=own.last_save,
                               saved_tensors=own.saved_tensors)


def _split(base: float, wide: float) -> Split:
    """Replicated/sharded parts from a measurement at TP shapes 1 and 1/2."""
    sharded = max(wide - base, 0.0)
    return Split(replicated=max(base - sharded, 0.0), sharded=sharded)


def _gemms(base: list, wide: list | None, batch2: list) -> tuple[Gemm, ...]:
    out = []
    for i, g in enumerate(base):
        m, n, k, c, in_core, expert = g
        dims = {"m": m, "n": n, "k": k, "count": c}
        names = ("m", "n", "k", "count")
        shard = ""
        if wide is not None:
            w = dict(zip(names, wide[i][:4]))
            grown = [d for d in names if w[d] > dims[d]]
            shard = grown[0] if grown else ""
        b2 = dict(zip(names, batch2[i][:4]))
        grown = [d for d in names if b2[d] > dims[d]]
        batch_dim = grown[0] if grown else "m"
        out.append(Gemm(m=float(m), n=float(n), k=float(k), count=float(c), shard_dim=shard,
                        batch_dim=batch_dim, in_core=in_core, expert=expert))
    return tuple(out)


def unit_kind(unit: nn.Module) -> str:
    """A unit's kind from its class name: embedding, head, or (anything else) block."""
    name = type(unit).__name__.lower()
    if "embed" in name:
        return "embedding"
    if "head" in name:
        return "head"
    return "block"


def _tp_allreduces(unit: nn.Module) -> int:
    """Row-parallel outputs are all-reduced: one per attention/MLP sub-module."""
    plan = unit.tp_plan() if hasattr(unit, "tp_plan") else {}
    parents = {fqn.split(".")[0] for fqn, style in plan.items() if style == "rowwise"}
    # A vocabulary-parallel embedding all-reduces its output; a vocabulary-parallel head
    # all-reduces its input gradient in backward (counted here, as the model is symmetric).
    return len(parents) + sum(1 for s in plan.values() if s in ("embedding", "output"))


def _layer_spec(name: str, unit: nn.Module, base: _Measurement, wide: _Measurement | None,
                batch2: _Measurement, causal: bool, sharded: bool, kind: str | None = None,
                capacity_factor: float | None = None, autocast: _Measurement | None = None) -> LayerSpec:
    def sp(attr_base, attr_wide):
        return _split(attr_base, attr_wide) if wide is not None else Split(replicated=attr_base)

    w = wide if wide is not None else base
    none = sp(base.saved_bytes, w.saved_bytes)
    core = sp(base.core_saved_bytes, w.core_saved_bytes)
    selective = Split(max(none.replicated - core.replicated, 0.0), max(none.sharded - core.sharded, 0.0))
    full = Split(replicated=base.input_bytes)
    experts = None
    moe = getattr(unit, "moe", None)
    if moe is not None and base.expert_params:
        experts = ExpertSpec(num_experts=moe.num_experts, top_k=moe.top_k,
                             params=sp(base.expert_params, w.expert_params),
                             activation_bytes=sp(base.expert_saved_bytes, w.expert_saved_bytes),
                             dispatch_bytes=base.dispatch_bytes, capacity_factor=capacity_factor)
    return LayerSpec(
        name=name, kind=kind or unit_kind(unit),
        params=sp(base.params, w.params),
        flops_fwd=sp(base.flops_fwd, w.flops_fwd), flops_bwd=sp(base.flops_bwd, w.flops_bwd),
        gemms_fwd=_gemms(base.fwd.gemms, wide.fwd.gemms if wide else None, batch2.fwd.gemms),
        gemms_bwd=_gemms(base.bwd.gemms, wide.bwd.gemms if wide else None, batch2.bwd.gemms),
        attention_flops_fwd=sp(base.fwd.attention_flops, w.fwd.attention_flops),
        attention_flops_bwd=sp(base.bwd.attention_flops, w.bwd.attention_flops),
        memory_bytes_fwd=sp(base.fwd.memory_bytes, w.fwd.memory_bytes),
        memory_bytes_bwd=sp(base.bwd.memory_bytes, w.bwd.memory_bytes),
        core_memory_bytes_fwd=sp(base.fwd.core_memory_bytes, w.fwd.core_memory_bytes),
        kernels_fwd=base.fwd.kernels, kernels_bwd=base.bwd.kernels,
        autocast_kernels_fwd=autocast.fwd.kernels if autocast else 0,
        autocast_kernels_bwd=autocast.bwd.kernels if autocast else 0,
        activation_bytes=ActivationBytes(none=none, selective=selective, full=full),
        output_bytes=base.output_bytes,
        tp_allreduces_fwd=_tp_allreduces(unit) if sharded else 0,
        causal=causal, experts=experts, recompute_prefix=_recompute_prefix(base, w, autocast),
        param_tensors=sum(1 for _ in unit.parameters()))


def _recompute_prefix(base: _Measurement, wide: _Measurement, autocast: _Measurement | None = None) -> RecomputePrefix:
    gemms, attention, moved, kernels = base.last_save
    return RecomputePrefix(
        gemms=gemms, attention_share=attention / base.fwd.attention_flops if base.fwd.attention_flops else 0.0,
        memory_bytes=_split(moved, wide.last_save[2]) if wide is not base else Split(replicated=moved),
        kernels=kernels, saved_tensors=base.saved_tensors,
        autocast_kernels=autocast.last_save[3] if autocast else 0)


def _swap(unit: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in place of ``unit``'s submodule ``name``."""
    parent, _, attr = name.rpartition(".")
    setattr(unit.get_submodule(parent) if parent else unit, attr, module)


def _prepare(model: nn.Module, dtype: torch.dtype, flash: bool, causal: bool, cfg=None) -> nn.Module:
    """Put the GPU kernels' memory behaviour into the meta model (see the classes above);
    ``cfg`` says which of the stack's fused kernels to measure (its ``fused_*`` fields)."""
    from autoplan.models.zoo.transformer import MLP, Attention, DropoutAdd, MathAttentionCore

    def fused(kernel: str) -> bool:
        return getattr(cfg, kernel, kernel == "fused_norm")   # (norms are fused unless told)
    model = model.to(dtype)
    for unit in model.layers:
        # The stack's own fusions first: the dropout a fused core keeps is then replaced
        # below like any other.
        for name, m in list(unit.named_modules()):
            if isinstance(m, DropoutAdd) and fused("fused_dropout_add") and isinstance(m.dropout, nn.Dropout):
                _swap(unit, name, _FusedDropoutAdd(m.dropout.p))
            elif isinstance(m, MathAttentionCore) and fused("fused_softmax") and not m.window and not m.softcap:
                _swap(unit, name, _FusedSoftmaxCore(m))
            elif isinstance(m, Attention) and fused("fused_qkv"):
                _fuse_qkv(m)
            elif isinstance(m, MLP) and m.gated and fused("fused_swiglu"):
                _swap(unit, name, _FusedGatedMLP(m))
        for name, m in list(unit.named_modules()):
            if isinstance(m, nn.Dropout) and m.p > 0:
                _swap(unit, name, _Dropout(m.p))
            elif isinstance(m, nn.RMSNorm) and m.weight is not None and fused("fused_norm"):
                _swap(unit, name, _FusedRMSNorm(m))
            elif flash and name.endswith("attention.core"):
                _swap(unit, name, _FlashCore(causal))
    return model


def _signature(unit: nn.Module, x: torch.Tensor) -> tuple:
    return (type(unit).__name__, tuple(x.shape), x.dtype,
            tuple((n, tuple(p.shape)) for n, p in unit.named_parameters()))


def window_fraction(seq_len: int, window: int) -> float:
    """Share of causal attention's (query, key) pairs a sliding window of ``window`` tokens
    keeps: w(w+1)/2 + (s-w)w pairs of s(s+1)/2 (1.0 without a window or when w >= s)."""
    s, w = seq_len, window
    if not w or w >= s:
        return 1.0
    return (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)


def spec_from_config(cfg, dtype: str = "bf16") -> ModelSpec:
    """Measure the spec of a zoo architecture (TransformerConfig or SwinConfig)."""
    from autoplan.models.zoo import build_model, example_inputs, measured_loss_fn

    cfg = cfg.resolved()
    torch_dtype = _DTYPES[dtype]
    is_lm = hasattr(cfg, "vocab")
    flash = getattr(cfg, "attention", "math") == "flash"
    causal = bool(getattr(cfg, "causal", False))
    shardable = hasattr(cfg, "with_shard")
    # A uniform stack repeats one block: measure a one-block model, then replicate its spec.
    # A mixture of experts with dense first blocks repeats two kinds: measure one of each.
    # Its routed experts are measured at balanced load (capacity = tokens x top_k / experts,
    # no padding, nothing dropped): the active-parameter work; the cost model applies the
    # routing's capacity factor or imbalance.
    uniform = is_lm
    loss = measured_loss_fn(cfg)   # (on an fp32 copy of the logits, or on them as they are)
    moe = getattr(cfg, "arch", "") == "moe"
    dense = min(cfg.dense_layers, 1) if moe else 0
    probe_cfg = dataclasses.replace(cfg, layers=1 + dense, **(
        dict(dense_layers=dense, capacity_factor=1.0) if moe else {})) if uniform else cfg

    def units_and_inputs(c, batch, dtype):
        with torch.device("meta"):
            model = _prepare(build_model(c), dtype, flash, causal, c)
            inputs, targets = example_inputs(c, batch, device="meta")
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        return model, inputs, targets

    # The "autocast" run counts the kernels of fp32 weights under autocast (the casts
    # included), as autoplan's runtime issues them (LayerSpec.autocast_kernels_fwd); a
    # half-precision spec only.
    runs = {}
    for label, c, batch in (("base", probe_cfg, 1), ("batch2", probe_cfg, 2)) + (
            (("wide", probe_cfg.with_shard(2), 1),) if shardable else ()) + (
            (("autocast", probe_cfg, 1),) if dtype in ("bf16", "fp16") else ()):
        autocast = label == "autocast"
        model, x, targets = units_and_inputs(c, batch, torch.float32 if autocast else torch_dtype)
        results, cache = [], {}
        n = len(model.layers)
        for i, unit in enumerate(model.layers):
            last = i == n - 1
            sig = _signature(unit, x)
            if sig in cache and not last:
                m = cache[sig]
            elif last:
                m = _measure_last(unit, x, lambda o, t=targets: loss(o, t), autocast=autocast)
            else:
                m = cache[sig] = _measure(unit, x, autocast=autocast)
            results.append((unit, m))
            if not last:
                x = m.output
        runs[label] = results

    layers = []
    base_units = runs["base"]
    for i, (unit, m) in enumerate(base_units):
        wide = runs["wide"][i][1] if shardable else None
        kind = unit_kind(unit)
        layers.append(_layer_spec(kind, unit, m, wide, runs["batch2"][i][1], causal, shardable,
                                  capacity_factor=getattr(cfg, "capacity_factor", None),
                                  autocast=runs["autocast"][i][1] if "autocast" in runs else None))
    if uniform:
        emb, head = layers[0], layers[-1]
        blocks = [layers[1]] * (cfg.dense_layers if dense else 0)
        blocks += [layers[1 + dense]] * (cfg.layers - len(blocks))
        # Blocks differ only in their attention window (Gemma 2 alternates local and global).
        layers = [emb] + [dataclasses.replace(
            b, name=f"block.{i}", attention_fraction=window_fraction(cfg.seq_len, cfg.layer_window(i)))
            for i, b in enumerate(blocks)] + [head]
    else:
        counts: dict[str, int] = {}
        renamed = []
        for l in layers:
            j = counts.get(l.kind, 0)
            counts[l.kind] = j + 1
            renamed.append(dataclasses.replace(l, name=f"{l.kind}.{j}"))
        layers = renamed
    seq = cfg.seq_len
    return ModelSpec(
        name=cfg.name, layers=tuple(layers), seq_len=seq, dtype=dtype,
        heads=getattr(cfg, "heads", 0) if shardable else 0,
        kv_heads=getattr(cfg, "kv_heads", 0) if shardable else 0,
        vocab=getattr(cfg, "vocab", 0), hidden=getattr(cfg, "hidden", 0), config=cfg,
        tokens_per_sample=seq, tp_shardable=shardable,
        shared_params=float(cfg.vocab * cfg.hidden) if getattr(cfg, "tie_embeddings", False) else 0.0)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on meta that never copies parameter or buffer data (the
    user's module, possibly huge and on a GPU, stays untouched)."""
    import copy
    memo = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


class _Stop(Exception):
    """Ends a forward pass early, carrying the input of the first pipeline unit."""

    def __init__(self, value):
        super().__init__()
        self.value = value


def _first_input(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()))


class _Prefix(nn.Module):
    """What a module computes before its first pipeline unit (token and position
    embeddings, ...): its forward runs until ``first`` is called and returns that call's
    input."""

    def __init__(self, module: nn.Module, first: nn.Module):
        super().__init__()
        self.module, self.first = module, first

    def forward(self, *inputs):
        def stop(_m, args, kwargs):
            raise _Stop(_first_input(args, kwargs))
        handle = self.first.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self.module(*inputs)
        except _Stop as s:
            return s.value
        finally:
            handle.remove()
        raise ConfigError("model", f"{type(self.module).__name__}.forward never calls its first layer")


class _Inject(nn.Module):
    """Stands in for every pipeline unit: ignores its input and returns ``value``."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, *args, **kwargs):
        return self.value


class _Suffix(nn.Module):
    """What a module computes after its last pipeline unit (final norm, output head):
    the module's forward with every unit replaced by one handing out ``hidden``. The
    part before the units runs too but feeds nothing backward; its forward figures are
    taken out afterwards (see :func:`_minus`)."""

    def __init__(self, module: nn.Module, inputs: tuple):
        super().__init__()
        self.module, self.inputs = module, inputs

    def forward(self, hidden):
        units = self.module.layers
        self.module.layers = nn.ModuleList(_Inject(hidden) for _ in units)
        try:
            return self.module(*self.inputs)
        finally:
            self.module.layers = units


def _called(run, module: nn.Module) -> list[nn.Module]:
    """The sub-modules of ``module`` whose forward ``run()`` calls, in call order."""
    called: list[nn.Module] = []
    handles = [m.register_forward_pre_hook(lambda m, _a: called.append(m)) for m in module.modules()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return called


def _params_of(modules: list[nn.Module], skip: set[int]) -> list[nn.Parameter]:
    """Distinct parameters held directly by ``modules``, except modules with ids in ``skip``."""
    seen, out = set(), []
    for m in modules:
        if id(m) in skip:
            continue
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _minus(total: _Measurement, part: _Measurement) -> _Measurement:
    """``total``'s forward figures less ``part``'s (its backward is total's own)."""
    fwd = _Census(gemms=total.fwd.gemms[len(part.fwd.gemms):],
                  attention_flops=max(total.fwd.attention_flops - part.fwd.attention_flops, 0.0),
                  memory_bytes=max(total.fwd.memory_bytes - part.fwd.memory_bytes, 0.0),
                  core_memory_bytes=max(total.fwd.core_memory_bytes - part.fwd.core_memory_bytes, 0.0),
                  kernels=max(total.fwd.kernels - part.fwd.kernels, 0))
    return dataclasses.replace(total, flops_fwd=max(total.flops_fwd - part.flops_fwd, 0.0), fwd=fwd,
                               saved_bytes=max(total.saved_bytes - part.saved_bytes, 0.0),
                               core_saved_bytes=max(total.core_saved_bytes - part.core_saved_bytes, 0.0))


def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and example_inputs and all(
            isinstance(t, torch.Tensor) for t in example_inputs):
        return tuple(example_inputs)
    raise ConfigError("example_inputs", f"must be a tensor or a tuple of tensors, got {type(example_inputs).__name__}",
                      "pass e.g. torch.randint(0, vocab, (1, seq_len)) or (input_ids, attention_mask)")


def _sample(inputs: tuple, n: int, dtype) -> tuple:
    """``n`` samples of every input on meta (sample 0 repeated), floats in ``dtype``."""
    out = []
    for t in inputs:
        if t.dim() == 0:
            raise ConfigError("example_inputs", "needs a batch dimension first", "e.g. shape (1, seq_len)")
        x = t[:1].to("meta")
        x = x.expand(n, *x.shape[1:]).contiguous() if n > 1 else x
        out.append(x.to(dtype) if x.is_floating_point() else x)
    return tuple(out)


def _tokens_per_sample(x: torch.Tensor) -> int:
    """The sequence length of a sample: dimension 1 of token ids [batch, seq] or of hidden
    states [batch, seq, hidden]; 1 for other inputs (images, feature vectors)."""
    if (not x.is_floating_point() and x.dim() == 2) or (x.is_floating_point() and x.dim() == 3):
        return int(x.shape[1])
    return 1


def spec_from_module(module: nn.Module, example_inputs, name: str = "module",
                     dtype: str = "bf16", loss=None) -> ModelSpec:
    """Measure any ``nn.Module``. Its pipeline units are ``module.layers`` (a ModuleList
    chained one tensor to the next) or the children of an ``nn.Sequential``; other modules
    become a single unit. With ``layers``, what the forward computes before the first
    unit (embeddings) and after the last (final norm, output head) become units of their
    own, so the spec counts every parameter and FLOP the model has. ``example_inputs`` is
    a tensor or a tuple of tensors (batch first, at the sequence length to plan for);
    they are copied to meta, and the module's parameters are not touched."""
    inputs = _as_tuple(example_inputs)
    torch_dtype = _DTYPES[dtype]
    model = _meta_copy(module).to(torch_dtype)
    has_layers = isinstance(getattr(model, "layers", None), nn.ModuleList) and len(model.layers) > 0
    one, two = _sample(inputs, 1, torch_dtype), _sample(inputs, 2, torch_dtype)
    seq = _tokens_per_sample(one[0])

    def measure(unit, x, last, params=None):
        m = _measure_last(unit, x, loss) if last and loss is not None else _measure(unit, x)
        return dataclasses.replace(m, params=float(sum(p.numel() for p in params))) if params is not None else m

    layers: list[LayerSpec] = []
    shared = 0.0
    if has_layers:
        units = set()
        for u in model.layers:
            units |= {id(m) for m in u.modules()}
        prefix = _Prefix(model, model.layers[0])
        pre_called = _called(lambda: prefix(*one), model)
        pre_params = _params_of(pre_called, units)
        pre = [measure(prefix, xs, False, pre_params) for xs in (one, two)]
        hidden = [pre[0].output, pre[1].output]
        layers.append(_layer_spec("embedding.0", prefix, pre[0], None, pre[1], False, False, kind="embedding"))
        for i, unit in enumerate(model.layers):
            ms = [measure(unit, h, False) for h in hidden]
            layers.append(_layer_spec(f"{type(unit).__name__.lower()}.{i}", unit, ms[0], None, ms[1], False, False,
                                      kind="block"))
            hidden = [m.output for m in ms]
        suffixes = [_Suffix(model, xs) for xs in (one, two)]
        pre_ids = {id(m) for m in pre_called}
        post_called = _called(lambda: suffixes[0](hidden[0]), model)
        post_params = _params_of([m for m in post_called if id(m) not in pre_ids], units)
        post = [_minus(measure(sfx, h, True, post_params), p) for sfx, h, p in zip(suffixes, hidden, pre)]
        layers.append(_layer_spec("head.0", suffixes[0], post[0], None, post[1], False, False, kind="head"))
        pre_param_ids = {id(p) for p in pre_params}
        shared = float(sum(p.numel() for p in post_params if id(p) in pre_param_ids))
    else:
        units = list(model) if isinstance(model, nn.Sequential) else [model]
        if len(inputs) > 1 and len(units) > 1:
            raise ConfigError("example_inputs", "an nn.Sequential takes one input tensor", "pass a single tensor")
        xs = [one, two]
        for i, unit in enumerate(units):
            ms = [measure(unit, x, i == len(units) - 1) for x in xs]
            layers.append(_layer_spec(f"{type(unit).__name__.lower()}.{i}", unit, ms[0], None, ms[1], False, False))
            xs = [m.output for m in ms]
    return ModelSpec(name=name, layers=tuple(layers), seq_len=seq, dtype=dtype, config=None,
                     tokens_per_sample=seq, tp_shardable=False, shared_params=shared)
