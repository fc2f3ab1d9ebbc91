"""Context parallelism: the ranks of a context-parallel group each hold part of every
sequence, and attention, the one place tokens meet, exchanges what it needs.

* Which tokens a rank holds (:func:`shard_positions`): for the ring exchanges ('p2p',
  'all_gather') on causal models, chunks ``r`` and ``2cp-1-r`` of ``2cp`` (zig-zag, also
  called head-tail), so that every rank has the same share of the causal triangle; for
  'a2a' and bidirectional models a contiguous ``1/cp``.
* Ring attention (:class:`RingAttentionCore`) is PyTorch's own context-parallel attention,
  the algorithm behind ``torch.distributed.tensor.experimental.context_parallel``: its
  templated ring forward and backward (key/value rotation by all-gather or by a ring
  permutation, log-sum-exp merging, zig-zag causal masks), called here on local tensors
  with the device's SDPA kernel that returns the log-sum-exp. ``context_parallel`` itself
  only intercepts the CUDA kernels; on a CPU process group its DTensor dispatch has no rule
  for ``_scaled_dot_product_flash_attention_for_cpu``, and it patches SDPA globally. Keys
  and values travel in their grouped (GQA) form and are repeated per block.
* Head-scatter attention (:class:`HeadScatterAttentionCore`, DeepSpeed-Ulysses): a DTensor
  redistribution ``Shard(seq) -> Shard(heads)`` (an all-to-all) before the unit's own
  attention core and back after it, so the core sees whole sequences for ``1/cp`` of the
  heads (windows and soft-caps work unchanged).
* Positions (:class:`ShardPositions`) replace the zoo's ``TokenPositions`` so RoPE and
  learned positions use each token's global position.

Everything else in a unit works token by token and needs nothing; the weights' gradients
are averaged over data and context ranks together by the data-parallel wrapper.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoplan.errors import ConfigError
from autoplan.models.zoo.transformer import Attention, FlashAttentionCore, TokenPositions

aten = torch.ops.aten

RING_COMMS = {"p2p": "ALL_TO_ALL", "all_gather": "ALL_GATHER"}
"""autoplan's ring exchanges -> PyTorch's rotate methods (its 'alltoall' rotation is a ring
permutation: every rank sends its key/value chunk to the next)."""


def zigzag(cp_comm: str, causal: bool) -> bool:
    """Whether the sequence is split into 2cp chunks handed out head-tail."""
    return causal and cp_comm in RING_COMMS


def shard_positions(seq_len: int, cp: int, cp_rank: int, cp_comm: str, causal: bool) -> torch.Tensor:
    """Global positions (LongTensor, ascending within each chunk) of the tokens rank
    ``cp_rank`` of ``cp`` holds."""
    if zigzag(cp_comm, causal):
        c = seq_len // (2 * cp)
        first, second = cp_rank, 2 * cp - 1 - cp_rank
        return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])
    c = seq_len // cp
    return torch.arange(cp_rank * c, (cp_rank + 1) * c)


class ShardPositions(nn.Module):
    """A ``TokenPositions`` that returns the global positions of this rank's tokens."""

    def __init__(self, positions: torch.Tensor):
        super().__init__()
        self.index = positions   # a plain attribute: not a buffer, so not in checkpoints

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
        if seq_len != len(self.index):
            raise RuntimeError(f"context-parallel unit got {seq_len} tokens, expected its {len(self.index)}")
        return self.index.to(device=device, dtype=dtype)


# ------------------------------------------------------------------------ ring attention
def _ring_api():
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
        return cp_attention
    except ImportError:   # torch < 2.8 kept the module one level up
        from torch.distributed.tensor.experimental import _attention as cp_attention
        return cp_attention


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // k.shape[1]
    return k.repeat_interleave(rep, dim=1) if rep > 1 else k


def _block_forward(q, k, v, is_causal: bool, scale=None, **_):
    """(out, logsumexp) of one query block against one key/value block."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if q.device.type == "cuda":
        out, lse, *_rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _block_backward(query, key, value, out, logsumexp, is_causal: bool, grad_out, scale=None, **_):
    """(dq, dk, dv) of one block; dk/dv summed back to the grouped key/value heads."""
    heads = query.shape[1]
    k, v = _repeat_kv(key, heads), _repeat_kv(value, heads)
    if query.device.type == "cuda":
        empty = torch.empty(0, dtype=torch.int64, device=query.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, k, v, out, logsumexp, None, None, query.shape[2], k.shape[2], 0.0, is_causal,
            empty, empty, scale=scale)
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, k, v, out, logsumexp, 0.0, is_causal, scale=scale)
    group = heads // key.shape[1]
    if group > 1:
        b, _, s, d = dk.shape
        dk = dk.view(b, key.shape[1], group, s, d).sum(2)
        dv = dv.view(b, key.shape[1], group, s, d).sum(2)
    return dq, dk, dv


@contextlib.contextmanager
def _ring_options(cp_comm: str, zig: bool):
    """PyTorch keeps the rotate method and load balancing in module-level options; set them
    for one call and put back what was there."""
    api = _ring_api()
    opts = api._cp_options
    saved = (opts.rotate_method, opts.enable_load_balance)
    opts.rotate_method = getattr(api._RotateMethod, RING_COMMS[cp_comm])
    opts.enable_load_balance = zig
    try:
        yield api
    finally:
        opts.rotate_method, opts.enable_load_balance = saved


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, cp_comm):
        zig = zigzag(cp_comm, causal)
        with _ring_options(cp_comm, zig) as api:
            out, lse, *_ = api._templated_ring_attention(group, 2, _block_forward, q, k, v,
                                                         is_causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, cp_comm)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, cp_comm = ctx.args
        with _ring_options(cp_comm, zigzag(cp_comm, causal)) as api:
            dq, dk, dv, *_ = api._templated_ring_attention_backward(
                group, 2, _block_backward, grad.contiguous(), "grad_out", q, k, v, out, lse,
                is_causal=causal, scale=scale)
        return dq, dk, dv, None, None, None, None


class RingAttentionCore(nn.Module):
    """Attention over a sequence split across ``group``: each rank's queries meet every
    rank's keys/values as they come round the ring (or all at once after an all-gather)."""

    def __init__(self, group: dist.ProcessGroup, causal: bool, scale: float | None, cp_comm: str):
        super().__init__()
        self.group, self.causal, self.scale, self.cp_comm = group, causal, scale, cp_comm

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k.contiguous(), v.contiguous(), self.group, self.causal,
                                    self.scale, self.cp_comm)


# -------------------------------------------------------------- head-scatter attention
def _reshard(x: torch.Tensor, mesh: DeviceMesh, src: int, dst: int) -> torch.Tensor:
    """All-to-all from Shard(src) to Shard(dst) over ``mesh`` (differentiable)."""
    return DTensor.from_local(x, mesh, [Shard(src)], run_check=False).redistribute(mesh, [Shard(dst)]).to_local()


class HeadScatterAttentionCore(nn.Module):
    """DeepSpeed-Ulysses: q, k, v [b, heads, s/cp, d] become [b, heads/cp, s, d] by an
    all-to-all, ``inner`` (the unit's own core) attends over whole sequences, and the
    output goes back to [b, heads, s/cp, d]."""

    def __init__(self, inner: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.inner, self.mesh = inner, mesh

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (_reshard(t.contiguous(), self.mesh, 2, 1) for t in (q, k, v))
        return _reshard(self.inner(q, k, v).contiguous(), self.mesh, 1, 2)


# ---------------------------------------------------------------------------- applying it
def check_context_supported(cfg, cp: int, cp_comm: str, seq_len: int) -> None:
    """Raise ConfigError for what the runtime's context parallelism cannot run."""
    from autoplan.models.config import TransformerConfig
    if cp == 1:
        return
    if not isinstance(cfg, TransformerConfig):
        raise ConfigError("groups[0].cp", f"{cp}: context parallelism needs a transformer language model",
                          "set cp to 1")
    if cp_comm in RING_COMMS:
        if cfg.attention != "flash":
            raise ConfigError("cp_comm", f"{cp_comm!r} runs fused attention blocks; the model uses "
                              f"attention={cfg.attention!r}", "use cp_comm 'a2a'")
        if cfg.sliding_window or cfg.attn_softcap:
            raise ConfigError("cp_comm", f"{cp_comm!r}: ring attention has no sliding window or soft-cap",
                              "use cp_comm 'a2a', which runs the model's own attention on whole sequences")
    chunks = 2 * cp if zigzag(cp_comm, cfg.causal) else cp
    if seq_len % chunks:
        raise ConfigError("groups[0].cp", f"{cp}: sequence length {seq_len} is not divisible by {chunks}",
                          "pick a cp (or a sequence length) that divides")


def apply_context_parallel(unit: nn.Module, cp_mesh: DeviceMesh, cp_comm: str, positions: torch.Tensor) -> None:
    """Make ``unit`` run on this rank's share of the sequence: attention cores exchange over
    ``cp_mesh``, position lookups return global positions."""
    for name, module in list(unit.named_modules()):
        if isinstance(module, TokenPositions):
            parent = unit.get_submodule(name.rsplit(".", 1)[0]) if "." in name else unit
            setattr(parent, name.rsplit(".", 1)[-1], ShardPositions(positions))
        if isinstance(module, Attention):
            core = module.core
            if cp_comm == "a2a":
                module.core = HeadScatterAttentionCore(core, cp_mesh)
            else:
                if not isinstance(core, FlashAttentionCore):
                    raise ConfigError("cp_comm", f"{cp_comm!r} needs fused attention", "use cp_comm 'a2a'")
                module.core = RingAttentionCore(cp_mesh.get_group(), core.causal, core.scale, cp_comm)
