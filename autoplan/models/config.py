"""Architecture hyper-parameters of the zoo models.

One dataclass describes every GPT/Llama/BERT/MoE-shaped network; :class:`SwinConfig`
describes the hierarchical vision transformer whose layers are far from uniform.
Defaults that depend on the architecture (ffn width, kv heads, head dim) are
filled in by :meth:`TransformerConfig.resolved`, the one place that validates.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autoplan.errors import ConfigError
from autoplan.fields import check_float, check_int, check_text
from autoplan.limits import (MAX_EXPERTS, MAX_FFN, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_SEQ_LEN, MAX_UNITS,
                             MAX_VOCAB)

MAX_CAPACITY_FACTOR = 1_000.0
"""Token slots per expert over the balanced load; past num_experts / top_k nothing more can
be routed, so a larger factor is a mistake."""
MAX_AUX_LOSS_COEFF = 1_000.0
"""The load-balancing loss coefficient (published models use 1e-4 to 1e-2)."""

ARCHS = ("gpt", "llama", "bert", "moe")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "geglu", "relu")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("flash", "math")
NORM_LAYOUTS = ("pre", "post", "sandwich", "output")
QK_NORMS = ("none", "head", "full")


STACK_KERNELS = ("fused_norm", "fused_qkv", "fused_softmax", "fused_dropout_add", "fused_swiglu", "fp32_loss")
"""The TransformerConfig fields that say how the training stack's kernels run: which fused
kernels it has and the precision of its loss (with ``attention``, the stack's choices rather
than the model's: see Stack.model_kernels)."""


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only (GPT, Llama, MoE) or encoder-only (BERT) transformer."""

    name: str = "custom"
    """Preset name or a user label; only used in reports."""
    arch: str = "gpt"
    """Family: 'gpt' (LayerNorm, GELU, learned positions), 'llama' (RMSNorm, SwiGLU, RoPE, GQA),
    'bert' (bidirectional encoder, post-norm) or 'moe' (Llama-style with mixture-of-experts MLPs)."""
    layers: int = 12
    """Number of transformer blocks."""
    hidden: int = 768
    """Model width h."""
    heads: int = 12
    """Query attention heads."""
    seq_len: int = 2048
    """Tokens per sample the spec is built for."""
    vocab: int = 50257
    """Vocabulary size."""
    ffn_hidden: int | None = None
    """MLP inner width; None = 4h for gpt/bert, Llama's rounded 8h/3 for llama/moe."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = heads (multi-head attention)."""
    head_dim: int | None = None
    """Width of one head; None = hidden // heads."""
    norm: str | None = None
    """'layernorm' or 'rmsnorm'; None = the family's default."""
    mlp: str | None = None
    """'gelu', 'relu', 'swiglu' or 'geglu' (gated like SwiGLU, with a tanh-GELU gate: Gemma);
    None = the family's default."""
    position: str | None = None
    """'learned' absolute positions or 'rope'; None = the family's default."""
    bias: bool | None = None
    """Linear layers carry biases; None = the family's default (gpt/bert yes, llama no)."""
    causal: bool | None = None
    """Causal attention mask; None = True except for bert."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head (GPT-2 does)."""
    num_experts: int = 0
    """Routed experts per MoE layer (moe only)."""
    top_k: int = 2
    """Experts each token is routed to (moe only)."""
    moe_ffn_hidden: int | None = None
    """Width of one routed expert's SwiGLU MLP (moe only); None = ffn_hidden."""
    shared_ffn_hidden: int = 0
    """Width of the shared-expert SwiGLU MLP every token also passes through (moe only; DeepSeek's
    n_shared_experts x moe_intermediate_size, Qwen2-MoE's shared_expert_intermediate_size); 0 = none."""
    dense_layers: int = 0
    """Leading blocks whose MLP is dense (width ffn_hidden) instead of experts (moe only;
    DeepSeek's first_k_dense_replace)."""
    capacity_factor: float | None = None
    """Token slots per expert as a multiple of the balanced load tokens x top_k / num_experts;
    a token routed to a full expert is dropped (GShard, Switch Transformer). None = dropless:
    every expert has a slot for every token, so nothing is dropped (what Mixtral, Qwen3-MoE and
    DeepSeek-V3 train with)."""
    normalize_top_k: bool = True
    """Rescale each token's top-k router probabilities to sum to 1 (Mixtral, Qwen3-MoE,
    DeepSeek-V3); False keeps the softmax values (Qwen2-MoE, DeepSeek-V2)."""
    aux_loss_coeff: float = 0.01
    """Weight of the load-balancing loss N_E * sum_i f_i * p_i in the objective (moe only; 0 = none)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3): rank of the compressed key/value latent;
    0 = ordinary multi-head / grouped-query attention."""
    q_lora_rank: int = 0
    """MLA: rank of the compressed query; 0 = a full-rank query projection (DeepSeek-V2-Lite)."""
    rope_head_dim: int = 0
    """MLA: per-head width of the decoupled rotary query/key part; head_dim is the part without
    position information (DeepSeek's qk_nope_head_dim)."""
    v_head_dim: int | None = None
    """MLA: per-head value width; None = head_dim."""
    attention: str = "flash"
    """Attention kernel: 'flash' (fused SDPA, saves no s×s scores) or 'math' (explicit softmax,
    saves the score matrix as Megatron-LM did before FlashAttention)."""
    max_positions: int | None = None
    """Learned position table size; None = seq_len."""
    rope_theta: float | None = None
    """Rotary base (the period scale of the position angles); None = 10000, RoFormer's value.
    Llama 3 uses 500000, Mixtral 1000000."""
    rope_scaling_factor: float | None = None
    """Llama-3.1-style rotary frequency scaling factor (low frequencies stretched by it,
    original context 8192, low/high frequency factors 1 and 4); None = no scaling."""
    qkv_bias: bool | None = None
    """The q/k/v projections carry biases even where other linears do not (Qwen2);
    None = same as ``bias``."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm/RMSNorm."""
    fused_norm: bool = True
    """RMSNorm runs as one fused GPU kernel saving the bf16 input and rstd (PyTorch >= 2.8 on
    CUDA, Apex, Transformer Engine); False = the eager fp32 decomposition, which saves fp32
    copies and moves more bytes."""
    fused_qkv: bool = False
    """q, k and v come from one GEMM (Megatron-LM's and AA-Scaling's query_key_value linear):
    the backward has one input-gradient GEMM instead of three whose results are added.
    Measurement only (the runtime keeps the three projections)."""
    fused_softmax: bool = False
    """With 'math' attention, scale, causal mask and softmax run as one kernel each way
    (Megatron-LM's FusedScaleMaskSoftmax); False = three eager passes over the scores."""
    fused_dropout_add: bool = False
    """Each residual branch's dropout and add run as one kernel (Megatron-LM's
    bias-dropout-add fusion); False = a dropout kernel, then an add."""
    fused_swiglu: bool = False
    """A gated MLP's activation (SwiGLU, GeGLU) runs as one kernel each way that saves only
    its two inputs and recomputes the activation in the backward (Megatron-Core's
    bias-SwiGLU fusion); False = the eager ``up * act(gate)``, which also saves the gate's
    activation. Measurement only (the runtime keeps the eager form)."""
    fp32_loss: bool = True
    """The cross entropy runs on an fp32 copy of the logits (``logits.float()`` first:
    Megatron-LM, Megatron-DeepSpeed, HuggingFace models, torchtitan and this project's
    runtime); False = on the half-precision logits as the head writes them. Its passes over
    the logits are bandwidth-bound, and with a large vocabulary they are a visible part of the
    head's time. Measurement only (the runtime always upcasts)."""
    dropout: float = 0.0
    """Dropout probability on both residual branches and, with 'math' attention, on the
    attention probabilities (Megatron-LM's hidden and attention dropout, GPT-2/3's 0.1).
    Training keeps a one-byte mask per dropped element for the backward; fused attention
    regenerates its mask from the RNG state instead."""
    # Features of the 2024-2025 decoder families (Qwen2.5, Qwen3, OLMo 2, Gemma 2, Phi-3).
    qk_norm: str = "none"
    """RMSNorm on queries and keys before RoPE: 'none'; 'head' (one head_dim-wide scale
    shared by every head: Qwen3) or 'full' (over the whole q and k projections: OLMo 2)."""
    norm_layout: str | None = None
    """Where a block's norms sit: 'pre' (x + f(norm(x)): GPT-2, Llama), 'post'
    (norm(x + f(x)): BERT), 'sandwich' (x + norm(f(norm(x))): Gemma 2) or 'output'
    (x + norm(f(x)): OLMo 2); None = 'post' for bert, else 'pre'."""
    sliding_window: int = 0
    """Tokens a query sees (itself included) on windowed layers; 0 = full attention."""
    global_every: int = 0
    """With a sliding window, every this-many-th layer (index % n == n - 1) attends to the
    whole sequence (Gemma 2: 2, local and global alternate); 0 = every layer is windowed."""
    attn_softcap: float = 0.0
    """Attention scores are capped as cap * tanh(score / cap) (Gemma 2: 50); 0 = no cap."""
    logit_softcap: float = 0.0
    """Output logits capped the same way (Gemma 2: 30); 0 = no cap."""
    attn_scale: float | None = None
    """Factor on q.k scores; None = 1/sqrt(head_dim) (Gemma 2: query_pre_attn_scalar ** -0.5)."""
    embed_scale: bool = False
    """Token embeddings are multiplied by sqrt(hidden) (Gemma)."""

    def layer_window(self, index: int) -> int:
        """Sliding-window width of block ``index`` (0-based); 0 = the block attends globally."""
        if not self.sliding_window:
            return 0
        if self.global_every and index % self.global_every == self.global_every - 1:
            return 0
        return self.sliding_window

    def resolved(self) -> "TransformerConfig":
        """A copy with every family default filled in, validated."""
        c = self
        check_text(c.name, "name")
        if c.arch not in ARCHS:
            raise ConfigError("arch", f"{str(c.arch)[:40]!r} is not one of {list(ARCHS)}")
        for name, top in (("layers", MAX_LAYERS), ("hidden", MAX_HIDDEN), ("heads", MAX_HEADS),
                          ("seq_len", MAX_SEQ_LEN), ("vocab", MAX_VOCAB)):
            v = getattr(c, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, f"must be a positive integer, got {str(v)[:40]!r}")
            check_int(v, name, minimum=1, maximum=top)
        for name, top in (("ffn_hidden", MAX_FFN), ("kv_heads", MAX_HEADS), ("head_dim", MAX_HIDDEN),
                          ("max_positions", MAX_SEQ_LEN), ("num_experts", MAX_EXPERTS), ("top_k", MAX_EXPERTS)):
            v = getattr(c, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(name, f"must be an integer, got {str(v)[:40]!r}")
            check_int(v, name, minimum=0 if name in ("num_experts", "top_k") else 1, maximum=top)
        for name in ("bias", "causal", "tie_embeddings", *STACK_KERNELS):
            v = getattr(c, name)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(name, f"must be true or false, got {str(v)[:40]!r}")
        llama_like = c.arch in ("llama", "moe")
        defaults = dict(
            norm="rmsnorm" if llama_like else "layernorm",
            mlp="swiglu" if llama_like else "gelu",
            position="rope" if llama_like else "learned",
            bias=not llama_like,
            causal=c.arch != "bert",
            kv_heads=c.heads,
            head_dim=c.hidden // c.heads if c.hidden % c.heads == 0 else None,
            max_positions=c.seq_len,
            norm_layout="post" if c.arch == "bert" else "pre",
            qkv_bias=c.bias if c.bias is not None else not llama_like,
        )
        updates = {k: v for k, v in defaults.items() if getattr(c, k) is None}
        c = dataclasses.replace(c, **updates)
        if c.head_dim is None:
            raise ConfigError("hidden", f"{c.hidden} is not divisible by heads={c.heads}",
                              "give head_dim explicitly")
        if c.ffn_hidden is None:
            if c.mlp in ("swiglu", "geglu"):
                # Llama's rule: 2/3 of 4h, rounded up to a multiple of 256.
                ffn = int(2 * 4 * c.hidden / 3)
                ffn = 256 * ((ffn + 255) // 256)
            else:
                ffn = 4 * c.hidden
            c = dataclasses.replace(c, ffn_hidden=ffn)
        if c.kv_heads < 1 or c.heads % c.kv_heads:
            raise ConfigError("kv_heads", f"heads={c.heads} must be a multiple of kv_heads={c.kv_heads}")
        for name, choices in (("norm", NORMS), ("mlp", MLPS), ("position", POSITIONS),
                              ("attention", ATTENTIONS), ("norm_layout", NORM_LAYOUTS),
                              ("qk_norm", QK_NORMS)):
            if getattr(c, name) not in choices:
                raise ConfigError(name, f"{getattr(c, name)!r} is not one of {list(choices)}")
        if isinstance(c.dropout, bool) or not isinstance(c.dropout, (int, float)) or not 0 <= c.dropout < 1:
            raise ConfigError("dropout", f"must be a probability in [0, 1), got {c.dropout!r}")
        if c.arch == "moe":
            if c.num_experts < 2:
                raise ConfigError("num_experts", f"an moe model needs >= 2 experts, got {c.num_experts}")
            if not 1 <= c.top_k <= c.num_experts:
                raise ConfigError("top_k", f"must be in 1..num_experts={c.num_experts}, got {c.top_k}")
            if c.moe_ffn_hidden is None:
                c = dataclasses.replace(c, moe_ffn_hidden=c.ffn_hidden)
            for name, top in (("moe_ffn_hidden", MAX_FFN), ("shared_ffn_hidden", MAX_FFN), ("dense_layers", MAX_LAYERS)):
                v = getattr(c, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "moe_ffn_hidden" else 0):
                    raise ConfigError(name, f"must be a {'positive' if name == 'moe_ffn_hidden' else 'non-negative'} "
                                      f"integer, got {str(v)[:40]!r}")
                check_int(v, name, maximum=top)
            if c.dense_layers >= c.layers:
                raise ConfigError("dense_layers", f"{c.dense_layers} dense blocks leave no expert block "
                                  f"among {c.layers}", "use fewer dense layers or arch 'llama'")
            if c.capacity_factor is not None and not (isinstance(c.capacity_factor, (int, float))
                                                      and not isinstance(c.capacity_factor, bool)
                                                      and c.capacity_factor > 0):
                raise ConfigError("capacity_factor", f"must be a number > 0 or None (dropless), "
                                  f"got {str(c.capacity_factor)[:40]!r}")
            check_float(c.capacity_factor, "capacity_factor", maximum=MAX_CAPACITY_FACTOR)
            if not isinstance(c.aux_loss_coeff, (int, float)) or isinstance(c.aux_loss_coeff, bool) \
                    or not c.aux_loss_coeff >= 0:
                raise ConfigError("aux_loss_coeff", f"must be a number >= 0, got {str(c.aux_loss_coeff)[:40]!r}")
            check_float(c.aux_loss_coeff, "aux_loss_coeff", maximum=MAX_AUX_LOSS_COEFF)
        else:
            for name, empty in (("num_experts", 0), ("shared_ffn_hidden", 0), ("dense_layers", 0),
                                ("moe_ffn_hidden", None)):
                if getattr(c, name) not in (empty, None):
                    raise ConfigError(name, f"is a mixture-of-experts setting but arch is {c.arch!r}",
                                      "set arch to 'moe'")
        if c.kv_lora_rank:
            if c.v_head_dim is None:
                c = dataclasses.replace(c, v_head_dim=c.head_dim)
            for name in ("kv_lora_rank", "q_lora_rank", "v_head_dim", "rope_head_dim"):
                v = getattr(c, name)
                low = 0 if name in ("q_lora_rank", "rope_head_dim") else 1   # a 0 rotary part: see below
                if not isinstance(v, int) or isinstance(v, bool) or v < low:
                    raise ConfigError(name, f"must be a {'non-negative' if low == 0 else 'positive'} "
                                      f"integer, got {str(v)[:40]!r}")
                check_int(v, name, maximum=MAX_HIDDEN)
            if c.rope_head_dim < 2 or c.rope_head_dim % 2 or c.position != "rope":
                raise ConfigError("rope_head_dim", f"multi-head latent attention needs an even rotary "
                                  f"width >= 2 with rope positions, got {c.rope_head_dim}")
            if c.kv_heads != c.heads:
                raise ConfigError("kv_heads", f"multi-head latent attention gives every head its own keys "
                                  f"and values: kv_heads must equal heads={c.heads}, got {c.kv_heads}")
        elif c.q_lora_rank or c.rope_head_dim or c.v_head_dim is not None:
            raise ConfigError("kv_lora_rank", "q_lora_rank, rope_head_dim and v_head_dim describe multi-head "
                              "latent attention, which kv_lora_rank = 0 turns off", "set kv_lora_rank")
        for name in ("rope_theta", "rope_scaling_factor", "norm_eps"):
            v = getattr(c, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ConfigError(name, f"must be a positive number, got {v!r}")
        if c.position != "rope" and (c.rope_theta is not None or c.rope_scaling_factor is not None):
            raise ConfigError("rope_theta", f"is set but the model uses {c.position!r} positions",
                              "drop rope_theta / rope_scaling_factor or use position='rope'")
        if c.position == "rope" and c.rope_theta is None:
            c = dataclasses.replace(c, rope_theta=10000.0)
        for name in ("sliding_window", "global_every"):
            v = getattr(c, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(name, f"must be an integer >= 0, got {v!r}")
        for name in ("attn_softcap", "logit_softcap"):
            v = getattr(c, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(name, f"must be a number >= 0 (0 = off), got {v!r}")
        if c.attn_scale is not None and not c.attn_scale > 0:
            raise ConfigError("attn_scale", f"must be > 0, got {c.attn_scale!r}")
        if (c.sliding_window or c.attn_softcap) and not c.causal:
            raise ConfigError("sliding_window" if c.sliding_window else "attn_softcap",
                              "is only modelled for causal decoders")
        if c.position == "learned" and c.max_positions < c.seq_len:
            raise ConfigError("seq_len", f"{c.seq_len} exceeds the learned position table "
                              f"({c.max_positions})", "raise max_positions or shorten seq_len")
        return c

    def with_shard(self, factor: float) -> "TransformerConfig":
        """The per-rank shapes under tensor parallelism of degree 1/factor: factor=2 doubles
        everything Megatron-style tensor parallelism divides (attention heads, kv heads, MLP
        width, vocabulary), which separates sharded from replicated cost by measurement."""
        c = self.resolved()
        moe = {}
        if c.arch == "moe":   # expert widths are sharded like the dense MLP's
            moe = dict(moe_ffn_hidden=int(c.moe_ffn_hidden * factor),
                       shared_ffn_hidden=int(c.shared_ffn_hidden * factor))
        return dataclasses.replace(
            c, heads=int(c.heads * factor), kv_heads=int(c.kv_heads * factor),
            ffn_hidden=int(c.ffn_hidden * factor), vocab=int(c.vocab * factor), **moe)


@dataclass(frozen=True)
class SwinConfig:
    """A Swin Transformer (Liu et al., ICCV 2021): four stages of windowed-attention
    blocks at falling resolution and rising width, so no two stages cost the same."""

    name: str = "swin"
    image_size: int = 224
    """Input side in pixels."""
    patch_size: int = 4
    """Patch side in pixels."""
    embed_dim: int = 96
    """Width of stage 1 (doubles each stage)."""
    depths: tuple[int, ...] = (2, 2, 6, 2)
    """Blocks per stage."""
    heads: tuple[int, ...] = (3, 6, 12, 24)
    """Attention heads per stage."""
    window: int = 7
    """Attention window side in patches."""
    mlp_ratio: int = 4
    """MLP width over block width."""
    num_classes: int = 1000
    """Classifier outputs."""
    in_channels: int = 3
    """Image channels."""
    arch: str = field(default="swin", init=False)

    def resolved(self) -> "SwinConfig":
        check_text(self.name, "name")
        for name, top in (("image_size", 65_536), ("patch_size", 65_536), ("embed_dim", MAX_HIDDEN),
                          ("window", 65_536), ("mlp_ratio", 64), ("num_classes", MAX_VOCAB), ("in_channels", 1024)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(name, f"must be a positive integer, got {str(v)[:40]!r}")
            check_int(v, name, minimum=1, maximum=top)
        for name in ("depths", "heads"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not 1 <= len(v) <= 16 or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_HEADS for x in v):
                raise ConfigError(name, f"must be 1 to 16 positive integers, got {str(v)[:60]}")
        if sum(self.depths) + 2 > MAX_UNITS:
            raise ConfigError("depths", f"{sum(self.depths)} blocks, at most {MAX_UNITS - 2} are supported")
        if len(self.depths) != len(self.heads):
            raise ConfigError("heads", f"needs one entry per stage ({len(self.depths)}), got {len(self.heads)}")
        if self.image_size % self.patch_size:
            raise ConfigError("image_size", f"{self.image_size} is not a multiple of patch_size={self.patch_size}")
        # Window partition and 2x2 patch merging need every stage's grid to divide evenly.
        resolution, dim = self.image_size // self.patch_size, self.embed_dim
        for stage, heads in enumerate(self.heads):
            if stage:
                if resolution % 2:
                    raise ConfigError("image_size", f"stage {stage + 1} cannot merge an odd "
                                      f"{resolution}x{resolution} patch grid")
                resolution, dim = resolution // 2, dim * 2
            if resolution % min(self.window, resolution):
                raise ConfigError("window", f"{self.window} does not divide stage {stage + 1}'s "
                                  f"{resolution}x{resolution} patch grid")
            if heads < 1 or dim % heads:
                raise ConfigError("heads", f"stage {stage + 1} width {dim} is not divisible by {heads} heads")
        return self

    @property
    def seq_len(self) -> int:
        """Patches per image at stage 1 (the 'tokens' of a sample)."""
        return (self.image_size // self.patch_size) ** 2
