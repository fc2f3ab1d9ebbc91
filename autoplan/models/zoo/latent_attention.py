"""Multi-head latent attention (DeepSeek-V2, Sec. 2.1; DeepSeek-V3): keys and values are
rebuilt per head from one low-rank latent of the token, queries from another, and a small
rotary part of every query/key head carries the position ("decoupled RoPE") so that it need
not pass through the latent.

    q      = q_b(norm(q_a(x)))            (or q_proj(x) without query compression)
    c, k_r = kv_a(x)                      c: the kv latent, k_r: one rotary key shared by the heads
    k, v   = kv_b(norm(c))                per head: the non-rotary key part and the value
    out    = o(attention([q_nope, rope(q_r)], [k_nope, rope(k_r)], v))

Tensor parallelism shards what is per head (q_b or q_proj, kv_b colwise; o rowwise); the
down projections to the latents and their norms are small and stay replicated, as in
Megatron-Core, and the rotary key every head reads is marked ``head_shared`` (its gradient
is summed over the tensor-parallel ranks). Local head counts come from tensor shapes, as in
the zoo's other attention.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.zoo.transformer import FlashAttentionCore, MathAttentionCore, TPPlan, apply_rope


class LatentAttention(nn.Module):
    """Multi-head latent attention; see the module docstring."""

    def __init__(self, cfg):
        super().__init__()
        self.nope, self.rope, self.v_dim = cfg.head_dim, cfg.rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.rope_theta = cfg.rope_theta
        q_width = cfg.heads * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.q_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.q_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden, q_width, bias=False)
        self.kv_a = nn.Linear(cfg.hidden, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, cfg.heads * (self.nope + self.v_dim), bias=False)
        # The rotary key is one per token, read by every head: a marker module, so tensor
        # parallelism can sum its gradient over the ranks that each hold some of the heads.
        self.shared_key = nn.Identity()
        self.wo = nn.Linear(cfg.heads * self.v_dim, cfg.hidden, bias=False)
        # FlashAttention-2 kernels (PyTorch's fused SDPA among them) need one head width for
        # q, k and v: values are zero-padded to the query width and the padding is cut off
        # after the kernel, as eager DeepSeek implementations do.
        self.pad_values = cfg.attention == "flash" and self.v_dim != self.nope + self.rope
        core = FlashAttentionCore if cfg.attention == "flash" else MathAttentionCore
        self.core = core(cfg.causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))) if hasattr(self, "q_b") else self.q_proj(x)
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)           # [b, H, s, nope+rope]
        q_nope, q_rot = q.split((self.nope, self.rope), dim=-1)
        latent, k_rot = self.kv_a(x).split((self.kv_rank, self.rope), dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        q_rot, k_rot = apply_rope(q_rot, self.shared_key(k_rot).view(b, 1, s, self.rope))
        heads = q.shape[1]
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, heads, s, self.rope)), dim=-1)
        if self.pad_values:
            v = F.pad(v, (0, self.nope + self.rope - self.v_dim))
        out = self.core(q, k, v)[..., :self.v_dim]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def tp_plan(self) -> TPPlan:
        plan = {"kv_b": "colwise", "wo": "rowwise", "shared_key": "head_shared"}
        plan["q_b" if hasattr(self, "q_b") else "q_proj"] = "colwise"
        return plan
