"""Named architectures from the literature, plus tiny ones for tests.

Presets hold only the published hyper-parameters; family defaults (ffn width, head dim,
norms, ...) are filled in by ``resolved()`` when :func:`get_config` is called, so an
override such as ``hidden=1024`` re-derives everything that depends on it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from autoplan.errors import ConfigError, closest
from autoplan.models.config import SwinConfig, TransformerConfig

ModelConfig = TransformerConfig | SwinConfig


def _gpt(name: str, layers: int, hidden: int, heads: int, seq_len: int, **kw: Any) -> TransformerConfig:
    # GPT-2 and GPT-3 both share the token embedding with the output head (GPT-3 reuses
    # GPT-2's architecture); the tied count is the one that matches GPT-3's 174.6B.
    return TransformerConfig(name=name, arch="gpt", layers=layers, hidden=hidden, heads=heads,
                             seq_len=seq_len, vocab=50257, tie_embeddings=True, **kw)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq_len: int, **kw: Any) -> TransformerConfig:
    return TransformerConfig(name=name, arch="llama", layers=layers, hidden=hidden, heads=heads,
                             kv_heads=kv_heads, ffn_hidden=ffn, vocab=vocab, seq_len=seq_len, **kw)


def _moe(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int, top_k: int,
         vocab: int, seq_len: int = 4096, **kw: Any) -> TransformerConfig:
    """A Llama-shaped decoder whose MLPs are routed experts (``ffn`` is the dense MLP width,
    used by the experts unless ``moe_ffn_hidden`` is given, and by ``dense_layers``)."""
    return TransformerConfig(name=name, arch="moe", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                             ffn_hidden=ffn, num_experts=experts, top_k=top_k, vocab=vocab, seq_len=seq_len, **kw)


_MLA_128 = dict(head_dim=128, rope_head_dim=64, v_head_dim=128, norm_eps=1e-6)
"""DeepSeek-V2/V3 latent attention head shapes (qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
and their RMSNorm epsilon (config.json "rms_norm_eps"; RoPE base 10000, the default)."""
_QWEN_FACTS = dict(rope_theta=1e6, norm_eps=1e-6)
"""Qwen1.5-MoE and Qwen3-MoE config.json "rope_theta" and "rms_norm_eps"."""


def _bert(name: str, layers: int, hidden: int, heads: int, **kw: Any) -> TransformerConfig:
    # BERT ties its MLM decoder to the word embeddings (Devlin et al. 2019).
    # ... and its LayerNorms use eps 1e-12 (google-bert config.json "layer_norm_eps").
    return TransformerConfig(name=name, arch="bert", layers=layers, hidden=hidden, heads=heads,
                             seq_len=512, vocab=30522, tie_embeddings=True, norm_eps=1e-12, **kw)


_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=8.0)

_ALL: list[ModelConfig] = [
    # GPT-2 (Radford et al. 2019): vocab 50257, context 1024.
    _gpt("gpt2-small", 12, 768, 12, 1024),
    _gpt("gpt2-medium", 24, 1024, 16, 1024),
    _gpt("gpt2-large", 36, 1280, 20, 1024),
    _gpt("gpt2-xl", 48, 1600, 25, 1024),
    # GPT-3 (Brown et al. 2020, Table 2.1): context 2048.
    _gpt("gpt3-125m", 12, 768, 12, 2048),
    _gpt("gpt3-350m", 24, 1024, 16, 2048),
    _gpt("gpt3-760m", 24, 1536, 16, 2048),
    # Table 2.1 lists 24 heads x d_head 128 for d_model 2048, which cannot both hold;
    # 16 x 128 = 2048 keeps the stated width and head size (and the 1.3B count).
    _gpt("gpt3-1.3b", 24, 2048, 16, 2048),
    _gpt("gpt3-2.7b", 32, 2560, 32, 2048),
    _gpt("gpt3-6.7b", 32, 4096, 32, 2048),
    # Table 2.1 gives d_model 5140 with 40 heads of 128; 5120 = 40 x 128 is what
    # reproductions use (5140 is not divisible by 40).
    _gpt("gpt3-13b", 40, 5120, 40, 2048),
    _gpt("gpt3-175b", 96, 12288, 96, 2048),
    # Llama 2 (Touvron et al. 2023): vocab 32000, context 4096; 70B uses GQA with 8 kv heads.
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3 / 3.1 (Grattafiori et al. 2024, Table 3): vocab 128256, 8 kv heads, RoPE base
    # 500000; the released 3.1 checkpoints (config.json "rope_scaling": llama3, factor 8) and
    # Llama 3.2 1B (Meta 2024 model card: 16 layers, tied embeddings) use Llama 3.1's scaling.
    _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192, tie_embeddings=True, **_LLAMA31_ROPE),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, **_LLAMA31_ROPE),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, **_LLAMA31_ROPE),
    _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, **_LLAMA31_ROPE),
    # BERT (Devlin et al. 2019): vocab 30522 (uncased WordPiece), 512 positions.
    _bert("bert-base", 12, 768, 12),
    _bert("bert-large", 24, 1024, 16),
    # Mixture of experts (zoo.moe: top-k token choice, dropless unless a capacity factor is given).
    # Mixtral 8x7B / 8x22B (Jiang et al. 2024; mistralai config.json): Mistral attention,
    # 8 SwiGLU experts, top-2, RoPE base 1e6.
    _moe("mixtral-8x7b", 32, 4096, 32, 8, 14336, 8, 2, 32000, aux_loss_coeff=0.02, rope_theta=1e6),
    _moe("mixtral-8x22b", 56, 6144, 48, 8, 16384, 8, 2, 32768, aux_loss_coeff=0.001, rope_theta=1e6),
    # Qwen1.5-MoE-A2.7B (model_type qwen2_moe): 60 fine-grained experts, top-4, one shared
    # expert, softmax weights not renormalised, q/k/v biases. The shared expert's 1-output gate
    # (< 0.01% of the parameters) is left out.
    _moe("qwen1.5-moe-a2.7b", 24, 2048, 16, 16, 5632, 60, 4, 151936, moe_ffn_hidden=1408,
         shared_ffn_hidden=5632, normalize_top_k=False, aux_loss_coeff=0.001, **_QWEN_FACTS, qkv_bias=True),
    # Qwen3-MoE (Qwen3 technical report, Yang et al. 2025; config.json): 128 experts, top-8,
    # head_dim 128, no shared experts; per-head q/k RMSNorm (256 parameters a layer) left out.
    _moe("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 128, 8, 151936, moe_ffn_hidden=768, head_dim=128,
         aux_loss_coeff=0.001, **_QWEN_FACTS),
    _moe("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 128, 8, 151936, moe_ffn_hidden=1536, head_dim=128,
         aux_loss_coeff=0.001, **_QWEN_FACTS),
    # DeepSeek-V2 / V2-Lite (DeepSeek-AI 2024) and V3 (DeepSeek-AI 2024, Sec. 4.2), shapes and
    # aux-loss weights as in their config.json: multi-head latent attention, shared experts,
    # dense first blocks. V3's sigmoid, group-limited routing changes no shape (softmax top-k
    # here); its multi-token-prediction module (14B) is not part of the 671B main model.
    _moe("deepseek-v2-lite", 27, 2048, 16, 16, 10944, 64, 6, 102400, moe_ffn_hidden=1408,
         shared_ffn_hidden=2 * 1408, dense_layers=1, normalize_top_k=False, aux_loss_coeff=0.001,
         **_MLA_128, kv_lora_rank=512),
    _moe("deepseek-v2", 60, 5120, 128, 128, 12288, 160, 6, 102400, moe_ffn_hidden=1536,
         shared_ffn_hidden=2 * 1536, dense_layers=1, normalize_top_k=False, aux_loss_coeff=0.001,
         **_MLA_128, kv_lora_rank=512, q_lora_rank=1536),
    _moe("deepseek-v3", 61, 7168, 128, 128, 18432, 256, 8, 129280, moe_ffn_hidden=2048,
         shared_ffn_hidden=2048, dense_layers=3, aux_loss_coeff=0.001,
         **_MLA_128, kv_lora_rank=512, q_lora_rank=1536),
    # Swin (Liu et al. 2021, Sec. 3.3): ImageNet-1k classifiers at 224x224, window 7.
    SwinConfig(name="swin-t", embed_dim=96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24)),
    SwinConfig(name="swin-b", embed_dim=128, depths=(2, 2, 18, 2), heads=(4, 8, 16, 32)),
    # Tiny configurations for tests: build and run on a CPU in milliseconds.
    TransformerConfig(name="gpt-tiny", arch="gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=32,
                      tie_embeddings=True),
    TransformerConfig(name="llama-tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=256, seq_len=32),
    # The features of Qwen3 (per-head q/k norm), OLMo 2 (full-width q/k norm, norms after
    # each sub-layer) and Gemma 2 (GeGLU, sandwich norms, alternating sliding windows,
    # soft-capped scores and logits, scaled tied embeddings) at the size of llama-tiny.
    TransformerConfig(name="qwen3-tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=256, seq_len=32, qk_norm="head"),
    TransformerConfig(name="olmo2-tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=256, seq_len=32, qk_norm="full", norm_layout="output"),
    TransformerConfig(name="gemma2-tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                      vocab=256, seq_len=32, mlp="geglu", norm_layout="sandwich", sliding_window=8,
                      global_every=2, attn_softcap=50.0, logit_softcap=30.0, attn_scale=0.25,
                      embed_scale=True, tie_embeddings=True),
    TransformerConfig(name="moe-tiny", arch="moe", layers=2, hidden=64, heads=4, kv_heads=2,
                      ffn_hidden=128, num_experts=4, top_k=2, vocab=256, seq_len=32),
    # DeepSeek's layout in miniature: a dense first block, then latent attention with shared
    # and fine-grained routed experts.
    TransformerConfig(name="deepseek-tiny", arch="moe", layers=3, hidden=64, heads=4, ffn_hidden=128,
                      num_experts=4, top_k=2, moe_ffn_hidden=32, shared_ffn_hidden=32, dense_layers=1,
                      kv_lora_rank=16, q_lora_rank=32, head_dim=16, rope_head_dim=8, v_head_dim=16,
                      vocab=256, seq_len=32),
    TransformerConfig(name="bert-tiny", arch="bert", layers=2, hidden=64, heads=4, vocab=256,
                      seq_len=32, tie_embeddings=True),
    SwinConfig(name="swin-tiny-test", image_size=32, patch_size=2, embed_dim=16, depths=(2, 2, 2),
               heads=(2, 4, 8), window=4, num_classes=10),
]

PRESETS: dict[str, ModelConfig] = {c.name: c for c in _ALL}
"""Preset name (lower case) -> unresolved config; use :func:`get_config` for a resolved one."""

PUBLISHED_PARAMS: dict[str, tuple[float, str]] = {
    "gpt2-xl": (1.558e9, "Radford et al. 2019; 1,557,611,200 in the released gpt2-xl checkpoint "
                         "(the paper's Table 2 rounds to 1542M)"),
    "gpt3-175b": (174.6e9, "Brown et al. 2020, Table 2.1 ('175.0B'); 174.6B is the exact count of "
                           "its shapes with tied embeddings"),
    "llama2-7b": (6.74e9, "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-7b-hf: 6.74B"),
    "llama2-13b": (13.0e9, "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-13b-hf: 13.0B"),
    "llama2-70b": (69.0e9, "Touvron et al. 2023 (Llama 2); meta-llama/Llama-2-70b-hf: 69.0B"),
    "llama3.2-1b": (1.24e9, "Meta 2024, Llama 3.2 model card ('1.23B'); meta-llama/Llama-3.2-1B: "
                            "1,235,814,400 parameters"),
    "llama3-8b": (8.03e9, "Grattafiori et al. 2024 (Llama 3); meta-llama/Meta-Llama-3-8B: 8.03B"),
    "llama3-70b": (70.6e9, "Grattafiori et al. 2024 (Llama 3); meta-llama/Meta-Llama-3-70B: 70.6B"),
    "llama3-405b": (405.8e9, "Grattafiori et al. 2024 (Llama 3.1); meta-llama/Llama-3.1-405B: 405.8B"),
    "mixtral-8x7b": (46.7e9, "Jiang et al. 2024 (Mixtral of Experts, '47B'); "
                             "mistralai/Mixtral-8x7B-v0.1: 46.7B"),
    "mixtral-8x22b": (141e9, "Mistral AI, 'Cheaper, Better, Faster, Stronger' (Mixtral 8x22B release, "
                             "2024-04-17): 141B parameters, 39B active"),
    "qwen1.5-moe-a2.7b": (14.3e9, "Qwen team, 'Qwen1.5-MoE: Matching 7B Model Performance with 1/3 "
                                  "Activated Parameters' (2024): 14.3B in total, 2.7B activated"),
    "qwen3-30b-a3b": (30.5e9, "Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated"),
    "qwen3-235b-a22b": (235e9, "Qwen/Qwen3-235B-A22B model card: 235B in total, 22B activated"),
    "deepseek-v2-lite": (15.7e9, "DeepSeek-AI 2024, DeepSeek-V2 (arXiv 2405.04434), DeepSeek-V2-Lite: "
                                 "15.7B total, 2.4B activated per token"),
    "deepseek-v2": (236e9, "DeepSeek-AI 2024, DeepSeek-V2 (arXiv 2405.04434): 236B total, 21B activated"),
    "deepseek-v3": (671e9, "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv 2412.19437): 671B total, "
                           "37B activated (the 14B multi-token-prediction module excluded)"),
    "bert-base": (110e6, "Devlin et al. 2019, Sec. 3 ('110M')"),
    "bert-large": (336e6, "Devlin et al. 2019 ('340M'); google-bert/bert-large-uncased: 336M"),
    "swin-t": (28.3e6, "Liu et al. 2021, Table 1(a) ('28M'); 28,288,354 in the released "
                       "swin_tiny_patch4_window7_224 checkpoint"),
    "swin-b": (88e6, "Liu et al. 2021, Table 1(a) ('88M')"),
}
"""Preset name -> (published parameter count, where it is published)."""

PUBLISHED_ACTIVE_PARAMS: dict[str, float] = {
    "mixtral-8x7b": 12.9e9,      # Jiang et al. 2024: '13B active parameters'; Mistral AI: 12.9B
    "mixtral-8x22b": 39e9,
    "qwen1.5-moe-a2.7b": 2.7e9,
    "qwen3-30b-a3b": 3.3e9,
    "qwen3-235b-a22b": 22e9,
    "deepseek-v2-lite": 2.4e9,
    "deepseek-v2": 21e9,
    "deepseek-v3": 37e9,
}
"""Mixture-of-experts preset -> published parameters active per token (same sources as
PUBLISHED_PARAMS); publications round these, and some leave the embedding out."""


def list_presets() -> list[str]:
    """Every preset name, in declaration order (families together, small to large)."""
    return list(PRESETS)


def apply_overrides(cfg: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """``cfg`` with ``overrides`` replaced, *not yet resolved* (so that derived defaults
    are re-derived from the new values); an unknown key raises ConfigError naming it."""
    known = [f.name for f in dataclasses.fields(cfg) if f.init]
    for key in overrides:
        if key not in known:
            hint = closest(key, known)
            raise ConfigError(key, f"is not a field of {type(cfg).__name__}",
                              hint or f"known fields: {', '.join(known)}")
    return dataclasses.replace(cfg, **overrides)


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The resolved preset ``name`` (case-insensitive) with ``overrides`` applied,
    e.g. ``get_config("llama3-8b", layers=4, seq_len=2048)``."""
    cfg = PRESETS.get(str(name).lower())
    if cfg is None:
        raise ConfigError("model", f"unknown model {name!r}", closest(str(name), PRESETS) or
                          f"known models: {', '.join(PRESETS)}")
    return apply_overrides(cfg, overrides).resolved()
