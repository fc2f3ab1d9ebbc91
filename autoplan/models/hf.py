"""Read a HuggingFace ``config.json`` into a :class:`TransformerConfig`, without transformers.

The fields that fix shapes are read, and the facts an exported engine config must carry
(rotary base and Llama-3.1 scaling, norm epsilon, q/k/v biases); the rest (dropout,
activation names, ...) is ignored. Every problem is a ConfigError naming the offending field.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, load_json
from autoplan.limits import MAX_EXPERTS, MAX_FFN, MAX_HIDDEN, MAX_LAYERS
from autoplan.models.config import MAX_AUX_LOSS_COEFF, TransformerConfig
from autoplan.models.presets import apply_overrides

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "gpt_neox", "bert",
                         "qwen3", "olmo2", "phi3", "gemma2")
SUPPORTED_MODEL_TYPES += ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")   # mixtures of experts

MAX_CONFIG_BYTES = 4 * 2**20
"""A config.json is a few kilobytes; anything far larger is not one."""

DEFAULT_MAX_SEQ_LEN = 4096
"""seq_len defaults to min(max_position_embeddings, this): long-context models (128k) are
trained mostly at a few thousand tokens, and planning at 128k is rarely what is meant."""

# Per model_type: (arch, position, tie_word_embeddings default). The tie default is the
# transformers class default, which applies when a saved config.json omits the key.
_FAMILY: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "rope", False),
    "mistral": ("llama", "rope", False),
    "qwen2": ("llama", "rope", False),   # with q/k/v biases (qkv_bias)
    "mixtral": ("moe", "rope", False),
    "qwen2_moe": ("moe", "rope", False),   # with q/k/v biases; the shared expert's gate ignored
    "qwen3_moe": ("moe", "rope", False),   # per-head q/k norms ignored (256 parameters a layer)
    "deepseek_v2": ("moe", "rope", False),
    "deepseek_v3": ("moe", "rope", False),  # the multi-token-prediction module is not read
    "gpt_neox": ("gpt", "rope", False),  # parallel residual and partial rotary ignored
    "gpt2": ("gpt", "learned", True),
    "bert": ("bert", "learned", True),
    "qwen3": ("llama", "rope", False),
    "olmo2": ("llama", "rope", False),
    "phi3": ("llama", "rope", False),    # fused qkv/gate-up projections: same shapes as separate ones
    "gemma2": ("llama", "rope", True),
}


# TransformerConfig field -> config.json key: GPT-2's own names, and everyone else's.
_GPT2_KEYS = {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "ffn_hidden": "n_inner",
              "vocab": "vocab_size"}
_KEYS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
         "ffn_hidden": "intermediate_size", "vocab": "vocab_size", "kv_heads": "num_key_value_heads",
         "head_dim": "head_dim"}


# Mixture-of-experts fields per family: TransformerConfig field -> config.json key (None: the
# family has no such key and the field keeps its default). Counts of shared experts are
# turned into a width below.
_MOE_KEYS: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
                "aux_loss_coeff": "router_aux_loss_coef"},
    "qwen2_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok",
                  "moe_ffn_hidden": "moe_intermediate_size", "shared_ffn_hidden": "shared_expert_intermediate_size",
                  "normalize_top_k": "norm_topk_prob", "aux_loss_coeff": "router_aux_loss_coef"},
    "qwen3_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok",
                  "moe_ffn_hidden": "moe_intermediate_size", "normalize_top_k": "norm_topk_prob",
                  "aux_loss_coeff": "router_aux_loss_coef"},
    "deepseek_v2": {"num_experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                    "moe_ffn_hidden": "moe_intermediate_size", "dense_layers": "first_k_dense_replace",
                    "normalize_top_k": "norm_topk_prob", "aux_loss_coeff": "aux_loss_alpha",
                    "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank", "head_dim": "qk_nope_head_dim",
                    "rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"},
}
_MOE_KEYS["deepseek_v3"] = _MOE_KEYS["deepseek_v2"]
# transformers' class defaults for keys a saved config.json may omit.
_MOE_DEFAULTS = {"normalize_top_k": {"qwen2_moe": False, "qwen3_moe": False, "deepseek_v2": False,
                                     "deepseek_v3": True},
                 "aux_loss_coeff": {"mixtral": 0.001, "qwen2_moe": 0.001, "qwen3_moe": 0.001,
                                    "deepseek_v2": 0.001, "deepseek_v3": 0.001}}


def _moe_fields(r: FieldReader, model_type: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The mixture-of-experts (and latent-attention) fields of a config, and the keys they came
    from (for error messages). Layer patterns the zoo cannot build are refused by name."""
    keys = _MOE_KEYS[model_type]
    out: dict[str, Any] = {"num_experts": r.int(keys["num_experts"], minimum=2, maximum=MAX_EXPERTS),
                           "top_k": r.int(keys["top_k"], minimum=1, maximum=MAX_EXPERTS)}
    if "moe_ffn_hidden" in keys:
        out["moe_ffn_hidden"] = r.int(keys["moe_ffn_hidden"], minimum=1, maximum=MAX_FFN)
    if "normalize_top_k" in keys:
        out["normalize_top_k"] = r.bool(keys["normalize_top_k"], _MOE_DEFAULTS["normalize_top_k"][model_type])
    out["aux_loss_coeff"] = r.float(keys["aux_loss_coeff"], _MOE_DEFAULTS["aux_loss_coeff"][model_type],
                                    minimum=0.0, maximum=MAX_AUX_LOSS_COEFF)
    if model_type == "qwen2_moe":
        out["shared_ffn_hidden"] = r.int(keys["shared_ffn_hidden"], 0, minimum=0, maximum=MAX_FFN)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = r.int("decoder_sparse_step", 1, minimum=1, maximum=MAX_LAYERS)
        dense = r.ints("mlp_only_layers", [], minimum=0, maximum=MAX_LAYERS, max_len=MAX_LAYERS)
        if step != 1 or dense != list(range(len(dense))):
            bad = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
            raise ConfigError(r.path(bad), "interleaves dense and expert layers, which the zoo cannot build "
                              "(it supports dense layers only before the first expert layer)",
                              "use decoder_sparse_step 1 and mlp_only_layers [0, 1, ..., k-1]")
        out["dense_layers"] = len(dense)
    if model_type.startswith("deepseek"):
        freq = r.int("moe_layer_freq", 1, minimum=1, maximum=MAX_LAYERS)
        if freq != 1:
            raise ConfigError(r.path("moe_layer_freq"), f"is {freq}: interleaved dense and expert layers "
                              "are not supported by the zoo", "use moe_layer_freq 1")
        out["dense_layers"] = r.int(keys["dense_layers"], 0, minimum=0, maximum=MAX_LAYERS)
        routed = out.get("moe_ffn_hidden", 0)
        out["shared_ffn_hidden"] = r.int("n_shared_experts", 0, minimum=0, maximum=MAX_EXPERTS) * routed
        for f in ("kv_lora_rank", "head_dim", "rope_head_dim", "v_head_dim"):
            out[f] = r.int(keys[f], minimum=1, maximum=MAX_HIDDEN)
        out["q_lora_rank"] = r.int(keys["q_lora_rank"], None, minimum=1, maximum=MAX_HIDDEN) or 0
    return out, keys


def _load(source: str | os.PathLike | Mapping) -> tuple[Any, str, Path | None]:
    """The parsed JSON, the name errors should start with, and the file it came from."""
    if isinstance(source, Mapping):
        return source, "config", None
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    return load_json(path, "file", max_bytes=MAX_CONFIG_BYTES), path.name, path


# Keys of mixture-of-experts configs (Qwen-MoE, DeepSeek, OLMoE, DBRX, ...). A family read
# as dense would drop them silently and plan for a model several times too small.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts")


def _model_type(r: FieldReader) -> str:
    model_type = r.str("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        # No "did you mean": a neighbouring family name (qwen2 for qwen3_moe) is a
        # different architecture, and loading the file under it would plan a wrong model.
        experts = [k for k in _EXPERT_KEYS if r.has(k)]
        missing = (f"its mixture-of-experts layers ({', '.join(experts)})" if experts
                   else "its layer layout")
        raise ConfigError(r.path("model_type"), f"{model_type[:60]!r} is not supported: autoplan does not "
                          f"read {missing}", f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}; "
                          "or describe the model with autoplan.models.transformer(...)")
    if _FAMILY[model_type][0] != "moe":
        for key in _EXPERT_KEYS:
            value = r.raw(key, None)
            if value not in (None, 0, 1, False):
                raise ConfigError(r.path(key), f"is set ({str(value)[:20]}), but model_type {model_type!r} is a "
                                  "dense family: its experts would be ignored and the model planned too small",
                                  "give the model's real model_type; mixture-of-experts configs are read for "
                                  "model_type 'mixtral'")
    return model_type


def config_from_hf(source: str | os.PathLike | Mapping, **overrides: Any) -> TransformerConfig:
    """The resolved TransformerConfig of a HuggingFace ``config.json``.

    ``source`` is the file, the model directory holding it, or the already-parsed dict.
    ``overrides`` replace fields afterwards (e.g. ``seq_len=8192``, ``layers=4``), as in
    :func:`autoplan.models.presets.get_config`.
    """
    data, where, path = _load(source)
    r = FieldReader(data, where)
    model_type = _model_type(r)
    arch, position, tie_default = _FAMILY[model_type]
    gpt2 = model_type == "gpt2"
    keys = _GPT2_KEYS if gpt2 else _KEYS
    required = ["hidden", "layers", "heads", "vocab"] + ([] if gpt2 else ["ffn_hidden"])
    optional = ["ffn_hidden"] if gpt2 else []   # GPT-2's n_inner: null means 4h
    if arch in ("llama", "moe"):
        optional += ["kv_heads", "head_dim"]
    moe_keys: dict[str, str] = {}
    if arch == "moe" and model_type.startswith("deepseek"):
        optional.remove("head_dim")     # DeepSeek's head widths are qk_nope/qk_rope/v_head_dim
    fields = {f: r.int(keys[f], minimum=1) for f in required}
    fields.update({f: r.int(keys[f], None, minimum=1) for f in optional})
    if arch == "moe":
        moe, moe_keys = _moe_fields(r, model_type)
        fields.update(moe)
    if gpt2:
        max_positions = r.int("n_positions", None, minimum=1) or r.int("n_ctx", minimum=1)
    else:
        max_positions = r.int("max_position_embeddings", minimum=1)
    # A label for reports: the hub id if saved with one, else the model's directory name.
    name = r.str("_name_or_path", "") or (path.resolve().parent.name if path else "") or model_type
    facts = _facts(r, model_type, position)
    fields.update(_family_features(model_type, r))
    cfg = TransformerConfig(
        name=name, arch=arch, seq_len=min(max_positions, DEFAULT_MAX_SEQ_LEN), position=position,
        max_positions=max_positions if position == "learned" else None,
        tie_embeddings=r.bool("tie_word_embeddings", tie_default), **fields, **facts)
    cfg = apply_overrides(cfg, overrides)
    try:
        return cfg.resolved()
    except ConfigError as e:
        if e.field in overrides:
            raise
        # Cross-field problems (heads not dividing hidden, ...) are reported against the
        # file's own key, which is what the user has to edit.
        raise ConfigError(r.path({**keys, **moe_keys}.get(e.field, e.field)), e.problem, e.fix) from None


_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def _facts(r: FieldReader, model_type: str, position: str) -> dict:
    """Rotary base and scaling, norm epsilon and q/k/v biases, where the file states them."""
    out: dict = {}
    if position == "rope":
        theta = r.float("rope_theta", None, positive=True)
        if theta is not None:
            out["rope_theta"] = float(theta)
        scaling = r.raw("rope_scaling", None)
        if isinstance(scaling, Mapping):
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "yarn" and model_type.startswith("deepseek"):
                # DeepSeek's YaRN context extension changes no shape or cost of training at
                # the planned sequence length; it is not carried.
                scaling = None
            elif kind != "llama3":
                raise ConfigError(r.path("rope_scaling"), f"rope scaling {kind!r} is not supported",
                                  "only Llama 3.1's 'llama3' scaling is")
            if scaling is not None:
                out["rope_scaling_factor"] = FieldReader(scaling, r.path("rope_scaling")).float("factor",
                                                                                               positive=True)
        elif scaling is not None:
            raise ConfigError(r.path("rope_scaling"), f"must be an object or null, got {scaling!r}")
    for key in _EPS_KEYS:
        eps = r.float(key, None, positive=True)
        if eps is not None:
            out["norm_eps"] = float(eps)
            break
    if model_type in ("qwen2", "qwen2_moe"):
        out["qkv_bias"] = True   # Qwen2's attention always has q/k/v biases
    elif r.has("attention_bias"):
        out["qkv_bias"] = r.bool("attention_bias")
    return out


def _unsupported(r: FieldReader, key: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(r.path(key), problem + " is not modelled", fix)


def _family_features(model_type: str, r: FieldReader) -> dict[str, Any]:
    """The TransformerConfig fields a family's config.json sets beyond the common shape
    keys. A key that would change the model in a way autoplan does not model raises a
    ConfigError naming it, rather than planning silently for a different model."""
    out: dict[str, Any] = {}
    if model_type in ("llama", "mistral", "qwen3", "olmo2") and r.bool("attention_bias", False):
        raise _unsupported(r, "attention_bias", "true (biases on q/k/v and the output projection)",
                           "set it to false, or describe the model with autoplan.models.transformer(bias=True)")
    if model_type == "llama" and r.bool("mlp_bias", False):
        raise _unsupported(r, "mlp_bias", "true", "set it to false")
    if model_type in ("qwen2", "qwen3") and r.bool("use_sliding_window", False):
        raise _unsupported(r, "use_sliding_window", "true (windows on the layers from max_window_layers on)",
                           "set it to false (the released Qwen2.5 and Qwen3 configs do)")
    if model_type == "qwen3":
        out["qk_norm"] = "head"         # RMSNorm over head_dim on q and k, before RoPE
    if model_type == "olmo2":
        out["qk_norm"] = "full"         # RMSNorm over the whole q and k projections
        out["norm_layout"] = "output"   # x + norm(f(x)): norms after attention and MLP
    if model_type in ("mistral", "phi3"):
        # Every layer is windowed (Mistral v0.1: 4096; Phi-3-mini-4k: 2047; null = none).
        out["sliding_window"] = r.int("sliding_window", 0, minimum=0)
    if model_type == "gemma2":
        act = r.str("hidden_activation", None) or r.str("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise _unsupported(r, "hidden_activation", f"{act!r}", "Gemma 2 uses gelu_pytorch_tanh")
        head_dim = r.int("head_dim", 256, minimum=1)
        out.update(
            head_dim=head_dim, mlp="geglu", norm_layout="sandwich", embed_scale=True,
            # Local (sliding) and global layers alternate, starting with a local one.
            sliding_window=r.int("sliding_window", 4096, minimum=0), global_every=2,
            attn_softcap=r.float("attn_logit_softcapping", 0.0, minimum=0.0) or 0.0,
            logit_softcap=r.float("final_logit_softcapping", 0.0, minimum=0.0) or 0.0,
            attn_scale=r.float("query_pre_attn_scalar", float(head_dim), positive=True) ** -0.5)
    return out
