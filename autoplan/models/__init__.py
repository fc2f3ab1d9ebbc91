"""Models as the planner sees them: :class:`ModelSpec` built from the zoo, a HuggingFace
``config.json``, or any ``nn.Module``.

    autoplan.models.get("gpt3-175b")                 # zoo preset
    autoplan.models.get("path/to/config.json")       # HuggingFace-style config
    autoplan.models.get("llama3-8b", seq_len=4096)   # preset with overrides
    autoplan.models.transformer(layers=48, hidden=6144, heads=64, seq_len=2048, vocab=51200)
    autoplan.models.from_module(my_module, example_inputs)
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from autoplan.errors import ConfigError
from autoplan.models.config import SwinConfig, TransformerConfig
from autoplan.models.spec import ActivationBytes, Gemm, LayerSpec, ModelSpec, Split

__all__ = ["get", "for_stack", "is_config_path", "transformer", "from_module", "from_config", "list_presets", "ModelSpec", "LayerSpec",
           "Split", "Gemm", "ActivationBytes", "TransformerConfig", "SwinConfig"]


@lru_cache(maxsize=64)
def from_config(cfg: TransformerConfig | SwinConfig, dtype: str = "bf16") -> ModelSpec:
    """Measure the spec of an architecture config (cached per config)."""
    from autoplan.models.extract import spec_from_config
    return spec_from_config(cfg, dtype=dtype)


def get(source, dtype: str = "bf16", **overrides) -> ModelSpec:
    """A ModelSpec from a preset name, a path to a HuggingFace-style config.json, a config
    object, or an ``nn.Module`` (then pass ``example_inputs=``)."""
    import torch.nn as nn

    if isinstance(source, ModelSpec):
        return source
    if isinstance(source, nn.Module):
        example = overrides.pop("example_inputs", None)
        if example is None:
            raise ConfigError("example_inputs", "is required to measure an nn.Module",
                              "pass example_inputs=torch.randint(0, vocab, (1, seq_len))")
        return from_module(source, example, dtype=dtype, **overrides)
    if isinstance(source, (TransformerConfig, SwinConfig)):
        import dataclasses
        return from_config(dataclasses.replace(source, **overrides).resolved(), dtype)
    if isinstance(source, (str, os.PathLike)):
        if is_config_path(source):
            from autoplan.models.hf import config_from_hf
            return from_config(config_from_hf(source, **overrides).resolved(), dtype)
        from autoplan.models.presets import get_config
        return from_config(get_config(str(source), **overrides), dtype)
    raise ConfigError("model", f"cannot build a model from {type(source).__name__}",
                      "give a preset name, a config.json path, a config object or an nn.Module")


def for_stack(source, stack=None, dtype: str = "bf16", **overrides) -> ModelSpec:
    """The spec of ``source`` (anything :func:`get` takes) as ``stack`` runs it: a zoo or
    HuggingFace transformer is measured with the stack's kernels (attention, norm and the
    fusions of ``Stack.model_kernels``), which decide what the layers save and move, and
    with the vocabulary the stack pads (``Stack.vocab_multiple``). A ModelSpec without an
    architecture config, or of another family, is used as given."""
    import dataclasses

    from autoplan.stacks import get_stack
    stack = get_stack(stack)
    spec = source if isinstance(source, ModelSpec) else get(source, dtype=dtype, **overrides)
    cfg = spec.config
    if not isinstance(cfg, TransformerConfig):
        return spec
    # The stack's kernels, and the vocabulary it pads (Stack.vocab_multiple).
    wanted = {**stack.model_kernels(), "vocab": stack.padded_vocab(cfg.vocab)}
    if all(getattr(cfg, k) == v for k, v in wanted.items()):
        return spec
    return from_config(dataclasses.replace(cfg, **wanted).resolved(), spec.dtype)


def is_config_path(source: str | os.PathLike) -> bool:
    """Whether a ``--model`` value names a config.json (file or model directory) rather
    than a zoo preset. A path is explicit when it is a path object, ends in .json or has a
    directory separator; a bare word is a preset when one has that name, so a file in the
    working directory that happens to be called like a preset (``gpt-tiny``) is never
    loaded in its place; other bare words are read as files when they exist."""
    if isinstance(source, os.PathLike):
        return True
    text = str(source)
    if text.endswith(".json") or "/" in text or os.sep in text or (os.altsep and os.altsep in text):
        return True
    from autoplan.models.presets import PRESETS
    if text.lower() in PRESETS:
        return False
    return Path(text).exists()


def transformer(layers: int, hidden: int, heads: int, seq_len: int, vocab: int, ffn_hidden: int | None = None,
                kv_heads: int | None = None, arch: str | None = None, dtype: str = "bf16", **kwargs) -> ModelSpec:
    """Any GPT/Llama-shaped decoder. ``arch`` defaults to 'llama' when grouped-query
    attention or a SwiGLU width is implied by ``kv_heads``, else 'gpt'."""
    if arch is None:
        arch = "llama" if kv_heads is not None and kv_heads != heads else "gpt"
    name = kwargs.pop("name", f"{arch}-{layers}x{hidden}")
    cfg = TransformerConfig(name=name, arch=arch, layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                            vocab=vocab, ffn_hidden=ffn_hidden, kv_heads=kv_heads, **kwargs)
    return from_config(cfg.resolved(), dtype)


def from_module(module, example_inputs, name: str | None = None, dtype: str = "bf16", loss=None) -> ModelSpec:
    """Measure a user's ``nn.Module`` on meta (its pipeline units are ``module.layers``
    or the children of an ``nn.Sequential``)."""
    from autoplan.models.extract import spec_from_module
    return spec_from_module(module, example_inputs, name=name or type(module).__name__, dtype=dtype, loss=loss)


def list_presets() -> list[str]:
    from autoplan.models.presets import list_presets as _list
    return _list()
