"""Swin Transformer (Liu et al., ICCV 2021) as a flat list of pipeline units:
``[PatchEmbed, SwinBlock x depths[0], PatchMerging, SwinBlock x depths[1], ..., ClassifierHead]``.

Each unit maps one tensor [b, tokens, channels] to one tensor, so any contiguous slice is
a pipeline stage. Stages differ in resolution and width, which is why this model is in the
zoo: it is the non-uniform case for the pipeline partitioner.

All shapes are static: the window partition, the cyclic shift, the relative-position
index and the shifted-window mask are computed from the (fixed) resolution on every call,
on the input's device, so the model runs on ``meta`` and needs no buffers.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from autoplan.models.config import SwinConfig
from autoplan.models.zoo.transformer import MLP, TPPlan, init_parameters

SHIFT_MASK_VALUE = -100.0
"""Additive score for token pairs from different regions of a shifted window (the
reference implementation's value: large enough to vanish after softmax, finite in fp16)."""


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[b, H, W, C] -> [b * windows, window * window, C], windows in row-major order."""
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def window_reverse(windows: torch.Tensor, window: int, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: [b * windows, window * window, C] -> [b, H, W, C]."""
    c = windows.shape[-1]
    x = windows.view(-1, h // window, w // window, window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, w, c)


def relative_position_index(window: int, device: torch.device) -> torch.Tensor:
    """[N, N] index into the (2w-1)^2 bias table for every (query, key) pair of a window."""
    coords = torch.arange(window, device=device)
    grid = torch.stack(torch.meshgrid(coords, coords, indexing="ij")).flatten(1)   # [2, N]
    rel = grid[:, :, None] - grid[:, None, :] + (window - 1)                       # [2, N, N]
    return rel[0] * (2 * window - 1) + rel[1]


def shifted_window_mask(resolution: int, window: int, shift: int, device: torch.device,
                        dtype: torch.dtype) -> torch.Tensor:
    """[windows, N, N] additive mask keeping attention inside the regions that the cyclic
    shift brought together (0 within a region, SHIFT_MASK_VALUE across regions)."""
    pos = torch.arange(resolution, device=device)
    # Region 0, 1, 2 along each axis: [0, R-w), [R-w, R-shift), [R-shift, R), as in the paper.
    region = (pos >= resolution - window).long() + (pos >= resolution - shift).long()
    label = region[:, None] * 3 + region[None, :]                                  # [R, R]
    windows = window_partition(label[None, :, :, None], window).squeeze(-1)        # [nW, N]
    different = windows[:, None, :] != windows[:, :, None]
    return torch.where(different, SHIFT_MASK_VALUE, 0.0).to(dtype)


class PatchEmbed(nn.Module):
    """Images [b, C, H, W] -> patch tokens [b, (H/p)(W/p), embed_dim] (conv patchify + norm)."""

    def __init__(self, cfg: SwinConfig):
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_channels, cfg.embed_dim, cfg.patch_size, stride=cfg.patch_size)
        self.norm = nn.LayerNorm(cfg.embed_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(images).flatten(2).transpose(1, 2))

    def tp_plan(self) -> TPPlan:
        return {}  # a convolution over 3 input channels: nothing worth sharding


class WindowAttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + bias) v within each window; parameter-free.

    q, k, v: [b * windows, heads, N, d]; bias: [windows or 1, heads, N, N] (relative position
    bias plus the shift mask). Explicit rather than fused because windows are small (N = 49)
    and fused kernels take no per-window bias without materialising it per batch element.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:
        bw, heads, n, _ = q.shape
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
        scores = (scores.view(-1, bias.shape[0], heads, n, n) + bias).view(bw, heads, n, n)
        return torch.softmax(scores, dim=-1) @ v


class WindowAttention(nn.Module):
    """(Shifted-)window multi-head self-attention on tokens [b, R*R, C].

    The cyclic shift and window partition live here rather than in the block so that the
    block has the same ``x + attention(attention_norm(x))`` shape as a transformer block
    (a sequence-parallel runtime gathers the sequence at this module's input).
    The relative position bias table is an ``nn.Embedding((2w-1)^2, heads)`` so that a
    colwise sharding splits it along heads, matching the local heads of sharded q/k/v.
    """

    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int,
                 head_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim or dim // heads
        self.resolution, self.window, self.shift = resolution, window, shift
        inner = heads * self.head_dim
        self.wq = nn.Linear(dim, inner)
        self.wk = nn.Linear(dim, inner)
        self.wv = nn.Linear(dim, inner)
        self.wo = nn.Linear(inner, dim)
        self.relative_position_bias = nn.Embedding((2 * window - 1) ** 2, heads)
        self.core = WindowAttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, c = x.shape
        r, w, shift = self.resolution, self.window, self.shift
        x = x.view(b, r, r, c)
        if shift:
            x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        win = window_partition(x, w)                                   # [b*nW, N, C]
        bw, n, _ = win.shape
        q = self.wq(win).view(bw, n, -1, self.head_dim).transpose(1, 2)
        k = self.wk(win).view(bw, n, -1, self.head_dim).transpose(1, 2)
        v = self.wv(win).view(bw, n, -1, self.head_dim).transpose(1, 2)
        bias = self.relative_position_bias(relative_position_index(w, x.device))
        bias = bias.permute(2, 0, 1).unsqueeze(0)                     # [1, heads, N, N]
        if shift:
            mask = shifted_window_mask(r, w, shift, x.device, bias.dtype)
            bias = bias + mask.unsqueeze(1)                           # [nW, heads, N, N]
        out = self.core(q, k, v, bias).transpose(1, 2).reshape(bw, n, -1)
        x = window_reverse(self.wo(out), w, r, r)
        if shift:
            x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
        return x.reshape(b, length, c)

    def tp_plan(self) -> TPPlan:
        return {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise",
                "relative_position_bias": "colwise"}


class SwinBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))`` then ``x + mlp(norm(x))`` (GELU MLP)."""

    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int,
                 mlp_ratio: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = WindowAttention(dim, heads, resolution, window, shift)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dim * mlp_ratio, "gelu", bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def tp_plan(self) -> TPPlan:
        plan: TPPlan = {"attention_norm": "norm", "mlp_norm": "norm"}
        plan.update({f"attention.{k}": v for k, v in self.attention.tp_plan().items()})
        plan.update({f"mlp.{k}": v for k, v in self.mlp.tp_plan().items()})
        return plan


class PatchMerging(nn.Module):
    """Halve the resolution and double the width: concatenate each 2x2 patch group
    ([b, R*R, C] -> [b, R*R/4, 4C]), normalise, then a bias-free Linear 4C -> 2C."""

    def __init__(self, dim: int, resolution: int):
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        x = x.view(b, self.resolution, self.resolution, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(b, -1, 4 * c)))

    def tp_plan(self) -> TPPlan:
        return {}  # one small Linear per stage boundary; replicated


class ClassifierHead(nn.Module):
    """Tokens [b, L, C] -> class logits [b, num_classes] (norm, mean pool, Linear)."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x).mean(dim=1))

    def tp_plan(self) -> TPPlan:
        return {}  # replicated: the pooled input is tiny


class SwinModel(nn.Module):
    """A Swin Transformer as a chain of pipeline units; ``forward`` runs ``layers`` in order."""

    def __init__(self, cfg: SwinConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.config = cfg
        units: list[nn.Module] = [PatchEmbed(cfg)]
        resolution, dim = cfg.image_size // cfg.patch_size, cfg.embed_dim
        for stage, (depth, heads) in enumerate(zip(cfg.depths, cfg.heads)):
            if stage:
                units.append(PatchMerging(dim, resolution))
                resolution, dim = resolution // 2, dim * 2
            # As in the reference code: a stage no larger than one window uses a single
            # window covering it and no shift (shifting would only re-label the same tokens).
            window = min(cfg.window, resolution)
            shift = window // 2 if resolution > cfg.window else 0
            for i in range(depth):
                units.append(SwinBlock(dim, heads, resolution, window, shift if i % 2 else 0,
                                       cfg.mlp_ratio))
        units.append(ClassifierHead(dim, cfg.num_classes))
        self.layers = nn.ModuleList(units)
        init_parameters(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for unit in self.layers:
            x = unit(x)
        return x
