"""CUDA autocast's casting, emulated where autocast itself does not run (``meta`` tensors).

autoplan's runtime computes a plan's layers under ``torch.autocast`` on fp32 weights
wherever no FSDP-family wrapper holds half-precision copies (``autoplan.data_parallel``).
Autocast then issues kernels the model code does not show: a cast of each weight per
forward, of each fp32 activation entering a matmul, of each half-precision tensor entering
an op autocast keeps in fp32, and one more per such cast in the backward. On a GPU the host
pays for every one of them (``costmodel.host``). Autocast only acts on tensors of its own
device, so a census on ``meta`` sees none of them; :class:`AutocastEmulation` applies the
same policy at the function level, above autograd, so the casts and their backward nodes
are real ops the census counts.

The op lists follow PyTorch's autocast op reference for CUDA (torch.amp documentation,
"Autocast Op Reference"): ops that autocast to the lower precision, ops that autocast to
float32, and among the latter those that take a ``dtype`` argument instead of a cast (one
kernel computing in float32: softmax, log_softmax, sum, cumsum, prod, cumprod). Weight
casts are cached for the region as autocast caches them (leaf tensors that require grad).
Off CUDA, softmax and log_softmax given ``dtype`` on a half-precision input dispatch a cast
before the op where CUDA runs one kernel: one kernel too many per such op (the zoo's blocks
have them only in explicit attention and expert routers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_LOWER = {
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
    torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm,
    torch.addbmm, torch.mv, torch.addmv, torch.addr, torch.chain_matmul, F.conv1d, F.conv2d, F.conv3d,
    F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.prelu, F.scaled_dot_product_attention,
}
"""Ops autocast runs in the lower precision, casting floating inputs to it."""

_FP32_CAST = {
    F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, torch.exp, torch.Tensor.exp, torch.expm1,
    torch.log, torch.Tensor.log, torch.log1p, torch.log2, torch.log10, torch.pow, torch.Tensor.pow,
    torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.rsqrt, torch.Tensor.rsqrt, torch.reciprocal,
    torch.Tensor.reciprocal, torch.acos, torch.asin, torch.cosh, torch.sinh, torch.tan, torch.erfinv,
    F.softplus, F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy_with_logits, F.cosine_similarity, F.normalize, torch.cdist, torch.dist, torch.norm,
    torch.Tensor.norm, torch.renorm,
}
"""Ops autocast runs in float32, casting half-precision inputs to it."""

_FP32_DTYPE = {
    F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
    F.softmin, torch.sum, torch.Tensor.sum, torch.cumsum, torch.Tensor.cumsum, torch.prod, torch.Tensor.prod,
    torch.cumprod, torch.Tensor.cumprod,
}
"""Ops autocast runs in float32 by passing ``dtype=torch.float32`` (no separate cast)."""


class AutocastEmulation(TorchFunctionMode):
    """CUDA autocast's casts to ``dtype`` (bf16 by default), applied to whatever device the
    tensors are on. One instance is one autocast region: weight casts are cached within it."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self._weights: dict[int, torch.Tensor] = {}

    def _cast(self, x, dtype: torch.dtype):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == dtype:
            return x
        if x.is_leaf and x.requires_grad:           # a weight: cast once per region
            hit = self._weights.get(id(x))
            if hit is None or hit.dtype != dtype:
                hit = self._weights[id(x)] = x.to(dtype)
            return hit
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to = self.dtype if func in _LOWER else torch.float32 if func in _FP32_CAST else None
        if to is not None:
            args = tuple(self._cast(a, to) for a in args)
            kwargs = {k: self._cast(v, to) for k, v in kwargs.items()}
        elif func in _FP32_DTYPE and kwargs.get("dtype") is None and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_floating_point() and args[0].dtype != torch.float32:
            kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)
