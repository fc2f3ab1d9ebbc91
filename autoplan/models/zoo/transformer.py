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

TP_STYLES = ("colwise", "rowwise", "norm", "head_norm", "embedding", "output", "experts", "head_shared")
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
    """Position-wise feed-forward: ``w2(act(w1 x))``, or gated: SwiGLU ``w2(w1 x * silu(w3 x))``
    and GeGLU ``w2(w1 x * gelu(w3 x))``.

    ``w1`` is the up projection and ``w3`` the gate (gated kinds only); both are colwise under
    TP and ``w2`` (down) is rowwise, so the only communication is after ``w2``.
    """

    def __init__(self, dim: int, hidden: int, kind: str, bias: bool):
        super().__init__()
        self.kind = kind
        self.gated = kind in ("swiglu", "geglu")
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        if self.gated:
            self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(self.w1(x) * F.silu(self.w3(x)))
        if self.kind == "geglu":
            return self.w2(self.w1(x) * F.gelu(self.w3(x), approximate="tanh"))
        if self.kind == "relu":
            return self.w2(F.relu(self.w1(x)))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def tp_plan(self) -> TPPlan:
        plan = {"w1": "colwise", "w2": "rowwise"}
        if self.gated:
            plan["w3"] = "colwise"
        return plan


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TokenPositions(nn.Module):
    """The sequence positions of the tokens a unit sees: ``0 .. s-1``.

    A parameter-free module rather than an inline ``arange`` so that a runtime which hands
    a unit only part of the sequence (context parallelism) can swap in one that returns
    the global positions of that part; the model code itself stays free of parallelism."""

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.arange(seq_len, device=device, dtype=dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, theta: float = ROPE_THETA,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021), half-rotation layout, on [b, heads, s, d].

    cos/sin are computed from ``positions`` (default ``0 .. s-1``) on every call, on the
    input's device and dtype, so there is no buffer to materialise and the same code runs
    on ``meta``.
    """
    s, d = q.shape[-2], q.shape[-1]
    if positions is None:
        positions = torch.arange(s, device=q.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=q.device, dtype=torch.float32) / d))
    angles = torch.outer(positions.to(torch.float32), inv_freq)
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


def attended_pairs(s: int, causal: bool, window: int, device) -> torch.Tensor | None:
    """[s, s] boolean mask of the (query, key) pairs attention keeps, or None for all pairs.
    A causal window of w keeps keys q-w < k <= q (w tokens, the query's own included)."""
    if not causal:
        return None
    q = torch.arange(s, device=device)[:, None]
    k = torch.arange(s, device=device)[None, :]
    keep = k <= q
    if window:
        keep = keep & (q - k < window)
    return keep


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int = 0,
                       softcap: float = 0.0, scale: float | None = None,
                       dropout: nn.Module | None = None) -> torch.Tensor:
    """softmax(cap(scale * q k^T) + mask) v computed step by step (autograd keeps the s x s
    probabilities): what soft-capped attention needs where no fused kernel offers it."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    s = q.shape[-2]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # Scaling q (b*h*s*d elements) instead of the scores (b*h*s*s) is cheaper and saves nothing.
    scores = (q * scale) @ k.transpose(-2, -1)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        if window:
            scores = scores.masked_fill(~attended_pairs(s, causal, window, q.device), float("-inf"))
        else:
            future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (dropout(probs) if dropout is not None else probs) @ v


class FlashAttentionCore(nn.Module):
    """Fused attention: softmax(q k^T / sqrt(d)) v without materialising the s x s scores.

    Takes q [b, heads, s, d] and k, v [b, kv_heads, s, d] (kv_heads divides heads) and
    returns [b, heads, s, d]. Parameter-free: it is what selective recomputation re-runs.
    A sliding window is passed to SDPA as a mask. Soft-capped scores are computed
    explicitly: PyTorch's SDPA kernels have no soft-cap (FlashAttention >= 2.6 has, and
    the planner models that fused kernel, as Gemma 2 is trained with it).
    """

    def __init__(self, causal: bool, window: int = 0, softcap: float = 0.0, scale: float | None = None):
        super().__init__()
        self.causal, self.window, self.softcap, self.scale = causal, window, softcap, scale

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
                q, k, v, 0.0, self.causal, scale=self.scale)[0]
        if self.softcap:
            return explicit_attention(q, k, v, self.causal, self.window, self.softcap, self.scale)
        # enable_gqa lets the flash kernel read grouped k/v in place (no repeated copies
        # saved). It is passed only when heads differ: the SDPA docs list GQA support for
        # the flash and math kernels only, so the flag would otherwise rule out the others.
        gqa = q.shape[1] != k.shape[1]
        if self.window:
            mask = attended_pairs(q.shape[-2], self.causal, self.window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale, enable_gqa=gqa)


class MathAttentionCore(nn.Module):
    """Explicit attention, ``softmax(q k^T / sqrt(d) + causal mask) v``, as Megatron-LM did
    before FlashAttention: autograd saves the [b, heads, s, s] probabilities (and, with
    dropout, the mask and the dropped probabilities), which is the activation memory that
    selective recomputation exists to drop."""

    def __init__(self, causal: bool, window: int = 0, softcap: float = 0.0, scale: float | None = None,
                 dropout: float = 0.0):
        super().__init__()
        self.causal, self.window, self.softcap, self.scale = causal, window, softcap, scale
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return explicit_attention(q, k, v, self.causal, self.window, self.softcap, self.scale, self.dropout)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with separate q, k, v, o projections
    (separate so that q and k/v of different widths shard independently under TP).

    ``window`` > 0 restricts this layer to a causal sliding window of that many tokens."""

    def __init__(self, cfg: TransformerConfig, window: int = 0):
        super().__init__()
        self.head_dim = cfg.head_dim  # fixed under TP; head *counts* come from shapes
        self.rope = cfg.position == "rope"
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=cfg.bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = make_norm(cfg.norm, cfg.head_dim, cfg.norm_eps)
            self.k_norm = make_norm(cfg.norm, cfg.head_dim, cfg.norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = make_norm(cfg.norm, cfg.heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = make_norm(cfg.norm, cfg.kv_heads * cfg.head_dim, cfg.norm_eps)
        self.positions = TokenPositions()
        # Fused attention's own dropout keeps no mask (it is regenerated from the RNG state);
        # it is left out here, which changes no shape, FLOP or saved byte.
        if cfg.attention == "flash":
            self.core = FlashAttentionCore(cfg.causal, window, cfg.attn_softcap, cfg.attn_scale)
        else:
            self.core = MathAttentionCore(cfg.causal, window, cfg.attn_softcap, cfg.attn_scale, cfg.dropout)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of ``x`` (the cost model measures a stack that runs them as one GEMM
        by replacing this on its meta copy)."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = apply_rope(q, k, self.rope_theta, self.positions(s, x.device, torch.float32))
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def tp_plan(self) -> TPPlan:
        plan = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}
        if self.qk_norm == "head":
            # One scale vector shared by heads that tensor parallelism spreads over ranks.
            plan.update({"q_norm": "head_norm", "k_norm": "head_norm"})
        return plan


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
            self.positions = TokenPositions()
        # Gemma scales embeddings by sqrt(h) (in the compute dtype, as its reference does).
        self.scale = math.sqrt(cfg.hidden) if cfg.embed_scale else None
        self.post_norm = cfg.arch == "bert"
        if self.post_norm:
            self.norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.scale is not None:
            h = h * torch.tensor(self.scale, dtype=h.dtype, device=h.device)
        if self.learned_positions:
            h = h + self.pos_embeddings(self.positions(tokens.shape[1], tokens.device))
        if self.post_norm:
            h = self.norm(h)
        return h

    def tp_plan(self) -> TPPlan:
        # Only the vocab-sharded table. Its output must stay replicated (positions are added
        # to the full sequence), so under sequence parallelism the sequence is split at this
        # unit's output; BERT's embedding norm therefore runs replicated, not as an SP region.
        return {"tok_embeddings": "embedding"}


class DropoutAdd(nn.Module):
    """``x + dropout(y)``: a residual branch joining the stream (a module of its own so that
    the cost model can measure it as the one kernel Megatron-LM fuses it into)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(p) if p else nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(y)


class Block(nn.Module):
    """One transformer layer: attention then MLP (or MoE), each with a residual.

    Norm layouts (``cfg.norm_layout``): 'pre' ``x + f(norm(x))`` (gpt/llama/moe), 'post'
    ``norm(x + f(x))`` (BERT), 'sandwich' ``x + norm2(f(norm(x)))`` (Gemma 2) and 'output'
    ``x + norm(f(x))`` (OLMo 2). ``window`` > 0 makes the attention a sliding window.
    Block ``index`` of an moe model is dense when it is among the first ``dense_layers``;
    attention is multi-head latent attention when ``kv_lora_rank`` is set.
    """

    def __init__(self, cfg: TransformerConfig, index: int = 0, window: int = 0):
        super().__init__()
        from autoplan.models.zoo.latent_attention import LatentAttention
        from autoplan.models.zoo.moe import MoE

        self.layout = cfg.norm_layout
        self.attention_norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg, window)
        self.mlp_norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
        if self.layout == "sandwich":
            self.post_attention_norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
            self.post_mlp_norm = make_norm(cfg.norm, cfg.hidden, cfg.norm_eps)
        self.is_moe = cfg.arch == "moe" and index >= cfg.dense_layers
        if self.is_moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden, cfg.ffn_hidden, cfg.mlp, cfg.bias)
        # Megatron's hidden dropout on each residual branch (parameter-free).
        self.attention_residual = DropoutAdd(cfg.dropout)
        self.mlp_residual = DropoutAdd(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ffn = self.moe if self.is_moe else self.mlp
        join_attention, join_mlp = self.attention_residual, self.mlp_residual
        if self.layout == "pre":
            x = join_attention(x, self.attention(self.attention_norm(x)))
            return join_mlp(x, ffn(self.mlp_norm(x)))
        if self.layout == "sandwich":
            x = join_attention(x, self.post_attention_norm(self.attention(self.attention_norm(x))))
            return join_mlp(x, self.post_mlp_norm(ffn(self.mlp_norm(x))))
        if self.layout == "output":
            x = join_attention(x, self.attention_norm(self.attention(x)))
            return join_mlp(x, self.mlp_norm(ffn(x)))
        x = self.attention_norm(join_attention(x, self.attention(x)))
        return self.mlp_norm(join_mlp(x, ffn(x)))

    def tp_plan(self) -> TPPlan:
        ffn_name = "moe" if self.is_moe else "mlp"
        ffn = self.moe if self.is_moe else self.mlp
        plan: TPPlan = {"attention_norm": "norm", "mlp_norm": "norm"}
        if self.layout == "sandwich":
            plan.update({"post_attention_norm": "norm", "post_mlp_norm": "norm"})
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
        self.softcap = cfg.logit_softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlm:
            x = F.gelu(self.dense(x), approximate="tanh")
        logits = self.output(self.norm(x))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

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
            [TokenEmbedding(cfg), *(Block(cfg, i, cfg.layer_window(i)) for i in range(cfg.layers)), Head(cfg)])
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
