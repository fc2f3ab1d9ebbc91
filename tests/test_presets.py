"""Presets: published shapes give published parameter counts; lookup and overrides."""
from __future__ import annotations

import functools

import pytest
import torch

from autoplan.errors import ConfigError
from autoplan.models.config import SwinConfig, TransformerConfig
from autoplan.models.presets import PRESETS, PUBLISHED_PARAMS, get_config, list_presets
from autoplan.models.zoo import build_model


@functools.cache
def meta_model(name: str) -> torch.nn.Module:
    """Built once per session: the large presets take a few hundred ms even on meta."""
    with torch.device("meta"):
        return build_model(get_config(name))


def meta_param_count(name: str) -> int:
    return sum(p.numel() for p in meta_model(name).parameters())  # tied tensors count once


@pytest.mark.parametrize("name", PUBLISHED_PARAMS, ids=list(PUBLISHED_PARAMS))
def test_parameter_count_matches_publication(name):
    published, source = PUBLISHED_PARAMS[name]
    count = meta_param_count(name)
    assert abs(count / published - 1) < 0.01, f"{name}: {count:,} vs {published:,.0f} ({source})"


@pytest.mark.parametrize("name", list_presets(), ids=list_presets())
def test_every_preset_builds_on_meta(name):
    cfg, model = get_config(name), meta_model(name)
    assert all(p.is_meta for p in model.parameters())
    if isinstance(cfg, TransformerConfig):
        assert len(model.layers) == cfg.layers + 2
    else:
        assert len(model.layers) == sum(cfg.depths) + len(cfg.depths) + 1


# name -> expected resolved fields: spot checks of the published shapes.
SHAPES = {
    "gpt2-xl": dict(layers=48, hidden=1600, heads=25, vocab=50257, seq_len=1024, tie_embeddings=True),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, head_dim=128, seq_len=2048, ffn_hidden=49152),
    "llama2-70b": dict(kv_heads=8, ffn_hidden=28672, vocab=32000, seq_len=4096, norm="rmsnorm",
                       mlp="swiglu", position="rope", bias=False, tie_embeddings=False),
    "llama3-405b": dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                        vocab=128256, seq_len=8192),
    "bert-large": dict(layers=24, hidden=1024, heads=16, causal=False, vocab=30522, seq_len=512),
    "mixtral-8x7b": dict(arch="moe", num_experts=8, top_k=2, kv_heads=8, ffn_hidden=14336,
                         moe_ffn_hidden=14336, capacity_factor=None),
    "qwen3-235b-a22b": dict(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, num_experts=128,
                            top_k=8, moe_ffn_hidden=1536, shared_ffn_hidden=0, dense_layers=0),
    "deepseek-v3": dict(layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=128, rope_head_dim=64,
                        v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536, num_experts=256, top_k=8,
                        moe_ffn_hidden=2048, shared_ffn_hidden=2048, dense_layers=3, ffn_hidden=18432,
                        vocab=129280),
    "llama-tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32),
    "swin-t": dict(embed_dim=96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24), window=7, seq_len=3136),
}


@pytest.mark.parametrize("name", SHAPES, ids=list(SHAPES))
def test_published_shapes(name):
    cfg = get_config(name)
    assert {k: getattr(cfg, k) for k in SHAPES[name]} == SHAPES[name]


LOOKUPS = {
    "exact": ("llama3-8b", {}, dict(name="llama3-8b", layers=32)),
    "case-insensitive": ("LLaMA3-8B", {}, dict(name="llama3-8b")),
    "override-rederives-defaults": ("gpt2-small", {"hidden": 1024, "heads": 16},
                                    dict(head_dim=64, ffn_hidden=4096)),
    "override-seq-len": ("llama3-8b", {"seq_len": 2048, "layers": 4}, dict(seq_len=2048, layers=4)),
    "swin-override": ("swin-t", {"num_classes": 10}, dict(num_classes=10, embed_dim=96)),
}


@pytest.mark.parametrize("case", LOOKUPS, ids=list(LOOKUPS))
def test_get_config(case):
    name, overrides, expected = LOOKUPS[case]
    cfg = get_config(name, **overrides)
    assert {k: getattr(cfg, k) for k in expected} == expected


BAD_LOOKUPS = {
    "unknown-name-with-hint": ("llama3-7b", {}, "model", "did you mean"),
    "unknown-override": ("gpt2-small", {"hiden": 10}, "hiden", "did you mean 'hidden'"),
    "init-false-field": ("swin-t", {"arch": "gpt"}, "arch", "is not a field of SwinConfig"),
    "invalid-override-value": ("gpt2-small", {"layers": 0}, "layers", "positive integer"),
    "kv-heads-not-dividing": ("llama3-8b", {"kv_heads": 5}, "kv_heads", "multiple"),
    "experts-on-a-dense-model": ("llama3-8b", {"num_experts": 8}, "num_experts", "arch is 'llama'"),
    "all-blocks-dense": ("deepseek-tiny", {"dense_layers": 3}, "dense_layers", "no expert block"),
    "zero-capacity": ("moe-tiny", {"capacity_factor": 0}, "capacity_factor", "> 0"),
    "latent-attention-without-rope-part": ("deepseek-tiny", {"rope_head_dim": 0}, "rope_head_dim", "rotary"),
    "latent-attention-grouped-kv": ("deepseek-tiny", {"kv_heads": 2}, "kv_heads", "must equal heads"),
    "rope-part-without-latent": ("moe-tiny", {"rope_head_dim": 8}, "kv_lora_rank", "turns off"),
    "swin-window-not-dividing": ("swin-t", {"window": 5}, "window", "does not divide"),
}


@pytest.mark.parametrize("case", BAD_LOOKUPS, ids=list(BAD_LOOKUPS))
def test_get_config_errors_name_the_field(case):
    name, overrides, field, words = BAD_LOOKUPS[case]
    with pytest.raises(ConfigError) as info:
        get_config(name, **overrides)
    assert info.value.field == field
    assert words in str(info.value)


def test_list_presets():
    names = list_presets()
    assert names == list(PRESETS) and len(set(names)) == len(names)
    assert all(n == n.lower() for n in names)
    for required in ("gpt2-small", "gpt3-175b", "llama2-7b", "llama3-405b", "bert-base",
                     "mixtral-8x7b", "swin-t", "swin-b", "gpt-tiny", "llama-tiny", "moe-tiny",
                     "bert-tiny", "swin-tiny-test", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b",
                     "deepseek-v2", "deepseek-v3", "deepseek-tiny"):
        assert required in names
    assert all(isinstance(PRESETS[n], (TransformerConfig, SwinConfig)) for n in names)
