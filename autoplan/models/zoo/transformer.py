"""GPT, Llama, BERT and mixture-of-experts transformers (the MoE layer and multi-head
latent attention live in ``zoo.moe`` and ``zoo.latent_attention``), built as a flat list of
pipeline units: ``[TokenEmbedding, Block x layers, Head]``.

Every unit maps one tensor to one tensor, so any contiguous slice of
``model.layers`` is a pipeline stage. Every unit also declares a ``tp_plan()``
naming which of its submodules a tensor-parallel runtime shards and how; the
model code itself contains no parallelism.

Two rules keep these modules usable by the planner, which runs them on ``meta``
tensors under ``FlopCounterMode`` and autograd saved-tensor hooks, and by a
DTensor runtime that shrinks weights in place:

* no data-dependent Python control flow: every branch depends on the config
  (fixed at construction) or on tensor *shapes*, never on tensor values;
* attention derives its local head counts from tensor shapes
  (``q.view(b, s, -1, head_dim)``), so a colwise-sharded ``wq`` with half the
  output features simply yields half the heads.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.config import TransformerConfig

INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear/Embedding/Conv weight (GPT-2/Megatron)."""
NORM_EPS = 1e-5
ROPE_THETA = 10000.0
"""RoPE base. Llama 3 uses 500000; the base changes no shape, FLOP or byte, so one value serves."""

TP_STYLES = ("colwise", "rowwise", "norm", "embedding", "output", "experts", "head_shared")
"""The sharding styles a unit's ``tp_plan()`` may name (see the module docstring of zoo)."""

TPPlan = dict[str, str]


def init_rule(module: nn.Module, name: str) -> tuple[str, float]:
    """How parameter ``name`` (``weight`` or ``bias``) of ``module`` is initialised:
    ('normal', std) for Linear/Embedding/Conv weights, ('zeros', 0) for biases, ('ones', 0)
    for norm scales, ('normal_per_matrix', std) for stacked expert weights ([experts, out, in]:
    each expert's matrix drawn as a matrix of its own, so an expert's values do not depend on
    how the stack is split over ranks). The one rule :func:`init_parameters` and the
    runtime's shard-local initialisation both follow."""
    from autoplan.models.zoo.moe import GroupedExperts

    if isinstance(module, GroupedExperts):
        return ("normal_per_matrix", INIT_STD)
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
        return ("normal", INIT_STD) if name == "weight" else ("zeros", 0.0)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return ("ones", 0.0) if name == "weight" else ("zeros", 0.0)
    raise TypeError(f"no initialisation rule for {type(module).__name__}.{name}")


def init_parameters(module: nn.Module) -> None:
    """(Re-)initialise every parameter under ``module`` deterministically from the global
    RNG: normal(0, 0.02) weights for Linear/Embedding/Conv, zero biases, unit norm scales
    (see :func:`init_rule`)."""
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            if p.is_meta:
                continue   # shapes only: nothing to initialise (and meta's normal_ is slow)
            kind, std = init_rule(m, name)
            if kind in ("normal", "normal_per_matrix"):
                nn.init.normal_(p, mean=0.0, std=std)
            elif kind == "ones":
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)


def make_norm(kind: str, dim: int, eps: float = NORM_EPS) -> nn.Module:
    """A LayerNorm or RMSNorm over the last dimension."""
    if kind == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps)


class MLP(nn.Module):
    """Position-wise feed-forward: ``w2(act(w1 x))``, or SwiGLU ``w2(w1 x * silu(w3 x))``.

    ``w1`` is the up projection and ``w3`` the gate (SwiGLU only); both are colwise under
    TP and ``w2`` (down) is rowwise, so the only communication is after ``w2``.
    """

    def __init__(self, dim: int, hidden: int, kind: str, bias: bool):
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        if kind == "swiglu":
            self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(self.w1(x) * F.silu(self.w3(x)))
        if self.kind == "relu":
            return self.w2(F.relu(self.w1(x)))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def tp_plan(self) -> TPPlan:
        plan = {"w1": "colwise", "w2": "rowwise"}
        if self.kind == "swiglu":
            plan["w3"] = "colwise"
        return plan


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021), half-rotation layout, on [b, heads, s, d].

    cos/sin are computed from positions on every call, on the input's device and dtype,
    so there is no buffer to materialise and the same code runs on ``meta``.
    """
    s, d = q.shape[-2], q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=q.device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, device=q.device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def repeat_kv(k: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Expand [b, kv_heads, s, d] to [b, q_heads, s, d] for grouped-query attention.

    The factor comes from the *local* head counts, so it stays right when both q and
    kv projections are sharded by the same TP degree.
    """
    b, kv_heads, s, d = k.shape
    rep = q_heads // kv_heads
    if rep == 1:
        return k
    return k[:, :, None].expand(b, kv_heads, rep, s, d).reshape(b, kv_heads * rep, s, d)


class FlashAttentionCore(nn.Module):
    """Fused attention: softmax(q k^T / sqrt(d)) v without materialising the s x s scores.

    Takes q [b, heads, s, d] and k, v [b, kv_heads, s, d] (kv_heads divides heads) and
    returns [b, heads, s, d]. Parameter-free: it is what selective recomputation re-runs.
    """

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.device.type == "meta":
            # On meta, F.scaled_dot_product_attention has no fused kernel to pick and falls
            # back to the math decomposition, which saves the s x s probabilities and counts
            # its FLOPs as bmm's: the planner would then see "flash" cost like "math". Calling
            # the flash op directly makes the traced saved tensors (q, k, v, out, logsumexp)
            # and FLOPs those of the fused kernel. (It takes no GQA flag, so k/v are repeated
            # here and saved repeated: an over-estimate of 2 * (heads - kv_heads) * s * d.)
            k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, self.causal)[0]
        # enable_gqa lets the flash kernel read grouped k/v in place (no repeated copies
        # saved). It is passed only when heads differ: the SDPA docs list GQA support for
        # the flash and math kernels only, so the flag would otherwise rule out the others.
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


class MathAttentionCore(nn.Module):
    """Explicit attention, ``softmax(q k^T / sqrt(d) + causal mask) v``, as Megatron-LM did
    before FlashAttention: autograd saves the [b, heads, s, s] probabilities (and, with
    dropout, the mask and the dropped probabilities), which is the activation memory that
    selective recomputation exists to drop."""

    def __init__(self, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.causal = causal
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
        s = q.shape[-2]
        # Scaling q (b*h*s*d elements) instead of the scores (b*h*s*s) is cheaper and saves nothing.
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
        if self.causal:
            future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return self.dropout(torch.softmax(scores, dim=-1)) @ v


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with separate q, k, v, o projections
    (separate so that q and k/v of different widths shard independently under TP)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.head_dim = cfg.head_dim  # fixed under TP; head *counts* come from shapes
        self.rope = cfg.position == "rope"
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=cfg.bias)
        # Fused attention's own dropout keeps no mask (it is regenerated from the RNG state);
        # it is left out here, which changes no shape, FLOP or saved byte.
        self.core = FlashAttentionCore(cfg.causal) if cfg.attention == "flash" else MathAttentionCore(
            cfg.causal, cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, k, self.rope_theta)
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def tp_plan(self) -> TPPlan:
        return {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}


class TokenEmbedding(nn.Module):
    """First pipeline unit: token ids [b, s] -> hidden states [b, s, h].

    Adds learned absolute positions (gpt, bert) and, for BERT, the embedding LayerNorm.
    (BERT's segment/token-type embedding is left out: it is 2 x h parameters and needs a
    second input, which would break the one-tensor-per-unit contract.)
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.learned_positions = cfg.position == "learned"
        if self.learned_positions:
            self.pos_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.post_norm = cfg.arch == "bert"
        if self.post_norm:
            self.norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.learned_positions:
            h = h + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        if self.post_norm:
            h = self.norm(h)
        return h

    def tp_plan(self) -> TPPlan:
        # Only the vocab-sharded table. Its output must stay replicated (positions are added
        # to the full sequence), so under sequence parallelism the sequence is split at this
        # unit's output; BERT's embedding norm therefore runs replicated, not as an SP region.
        return {"tok_embeddings": "embedding"}


class Block(nn.Module):
    """One transformer layer: attention then MLP (or MoE), each with a residual.

    Pre-norm (``x + f(norm(x))``) for gpt/llama/moe; post-norm (``norm(x + f(x))``) for BERT.
    Block ``index`` of an moe model is dense when it is among the first ``dense_layers``;
    attention is multi-head latent attention when ``kv_lora_rank`` is set.
    """

    def __init__(self, cfg: TransformerConfig, index: int = 0):
        super().__init__()
        from autoplan.models.zoo.latent_attention import LatentAttention
        from autoplan.models.zoo.moe import MoE

        self.pre_norm = cfg.arch != "bert"
        self.attention_norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg)
        self.mlp_norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
        self.is_moe = cfg.arch == "moe" and index >= cfg.dense_layers
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden, cfg.ffn_hidden, cfg.mlp, cfg.bias)
        # Megatron's hidden dropout on each residual branch (parameter-free).
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ffn = self.moe if self.is_moe else self.mlp
        drop = self.dropout
        if self.pre_norm:
            x = x + drop(self.attention(self.attention_norm(x)))
            return x + drop(ffn(self.mlp_norm(x)))
        x = self.attention_norm(x + drop(self.attention(x)))
        return self.mlp_norm(x + drop(ffn(x)))

    def tp_plan(self) -> TPPlan:
        ffn_name = "moe" if self.is_moe else "mlp"
        ffn = self.moe if self.is_moe else self.mlp
        plan: TPPlan = {"attention_norm": "norm", "mlp_norm": "norm"}
        plan.update({f"attention.{k}": v for k, v in self.attention.tp_plan().items()})
        plan.update({f"{ffn_name}.{k}": v for k, v in ffn.tp_plan().items()})
        return plan


class Head(nn.Module):
    """Last pipeline unit: hidden states [b, s, h] -> logits [b, s, vocab].

    Decoders: final norm + ``output``. BERT: the MLM head (dense h->h, GELU, LayerNorm,
    ``output``); its blocks are post-norm, so there is no separate final norm.
    ``output`` has no bias so that it can share its weight with the token embedding.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.mlm = cfg.arch == "bert"
        if self.mlm:
            self.dense = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlm:
            x = F.gelu(self.dense(x), approximate="tanh")
        return self.output(self.norm(x))

    def tp_plan(self) -> TPPlan:
        # BERT's dense h->h transform stays replicated (one h x h matrix per model).
        return {"norm": "norm", "output": "output"}


class TransformerModel(nn.Module):
    """A transformer as a chain of pipeline units; ``forward`` just runs ``layers`` in order."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.config = cfg
        self.layers = nn.ModuleList(
            [TokenEmbedding(cfg), *(Block(cfg, i) for i in range(cfg.layers)), Head(cfg)])
        init_parameters(self)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the head's output weight the embedding weight when ``tie_embeddings``.

        Tying only happens when both units live in this one model object. A pipeline stage
        that holds the head without the embedding keeps its own copy, and the runtime must
        keep the two copies equal (Megatron all-reduces their gradients between the first
        and last stage). Call again after ``to_empty()``, which may untie them.
        """
        if self.config.tie_embeddings:
            self.layers[-1].output.weight = self.layers[0].tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for unit in self.layers:
            x = unit(x)
        return x
