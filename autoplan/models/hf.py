"""Read a HuggingFace ``config.json`` into a :class:`TransformerConfig`, without transformers.

Only the fields that fix shapes are read; everything else (dropout, eps, rope scaling,
activation names) is ignored because it changes no parameter, FLOP or activation byte
that the planner models. Every problem is a ConfigError naming the offending field.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader
from autoplan.models.config import TransformerConfig
from autoplan.models.presets import apply_overrides

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "gpt2", "gpt_neox", "bert")

DEFAULT_MAX_SEQ_LEN = 4096
"""seq_len defaults to min(max_position_embeddings, this): long-context models (128k) are
trained mostly at a few thousand tokens, and planning at 128k is rarely what is meant."""

# Per model_type: (arch, position, tie_word_embeddings default). The tie default is the
# transformers class default, because save_pretrained omits a value equal to it.
_FAMILY: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "rope", False),
    "mistral": ("llama", "rope", False),
    "qwen2": ("llama", "rope", False),   # q/k/v biases ignored (< 0.01% of parameters)
    "mixtral": ("moe", "rope", False),
    "gpt_neox": ("gpt", "rope", False),  # parallel residual and partial rotary ignored
    "gpt2": ("gpt", "learned", True),
    "bert": ("bert", "learned", True),
}


def _load(source: str | os.PathLike | Mapping) -> tuple[Any, str, Path | None]:
    """The parsed JSON, the name errors should start with, and the file it came from."""
    if isinstance(source, Mapping):
        return source, "config", None
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(str(path), "file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(path), f"cannot be read ({e})") from None
    try:
        return json.loads(text), path.name, path
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def config_from_hf(source: str | os.PathLike | Mapping, **overrides: Any) -> TransformerConfig:
    """The resolved TransformerConfig of a HuggingFace ``config.json``.

    ``source`` is the file, the model directory holding it, or the already-parsed dict.
    ``overrides`` replace fields afterwards (e.g. ``seq_len=8192``, ``layers=4``), as in
    :func:`autoplan.models.presets.get_config`.
    """
    data, where, path = _load(source)
    r = FieldReader(data, where)
    model_type = r.str("model_type", choices=SUPPORTED_MODEL_TYPES)
    arch, position, tie_default = _FAMILY[model_type]
    if model_type == "gpt2":
        hidden = r.int("n_embd", minimum=1)
        fields = dict(layers=r.int("n_layer", minimum=1), heads=r.int("n_head", minimum=1),
                      ffn_hidden=r.int("n_inner", None, minimum=1))
        max_positions = r.int("n_positions", None, minimum=1) or r.int("n_ctx", minimum=1)
    else:
        hidden = r.int("hidden_size", minimum=1)
        fields = dict(layers=r.int("num_hidden_layers", minimum=1),
                      heads=r.int("num_attention_heads", minimum=1),
                      ffn_hidden=r.int("intermediate_size", minimum=1))
        max_positions = r.int("max_position_embeddings", minimum=1)
    if arch in ("llama", "moe"):
        fields.update(kv_heads=r.int("num_key_value_heads", None, minimum=1),
                      head_dim=r.int("head_dim", None, minimum=1))
    if arch == "moe":
        fields.update(num_experts=r.int("num_local_experts", minimum=2),
                      top_k=r.int("num_experts_per_tok", minimum=1))
    # A label for reports: the hub id if saved with one, else the model's directory name.
    name = r.str("_name_or_path", "") or (path.resolve().parent.name if path else "") or model_type
    cfg = TransformerConfig(
        name=name, arch=arch, hidden=hidden, vocab=r.int("vocab_size", minimum=1),
        seq_len=min(max_positions, DEFAULT_MAX_SEQ_LEN), position=position,
        max_positions=max_positions if position == "learned" else None,
        tie_embeddings=r.bool("tie_word_embeddings", tie_default), **fields)
    try:
        cfg = cfg.resolved()
    except ConfigError as e:
        # Re-point config-level errors (e.g. heads not dividing hidden) at the file.
        raise ConfigError(f"{where}: {e.field}", e.problem, e.fix) from None
    return apply_overrides(cfg, overrides)
