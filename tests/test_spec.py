"""ModelSpecs measured on meta agree with closed-form counts, fast, without memory."""
from __future__ import annotations

import time

import pytest

import autoplan
from autoplan.models import from_config
from autoplan.models.presets import PUBLISHED_PARAMS, get_config


def _closed_form_block_fwd_flops(cfg) -> float:
    """Per-sample forward FLOPs of one block: 2 x matmul MACs + 4 s^2 h of attention
    (Narayanan et al. 2021, Eq. 3 generalised to GQA and SwiGLU)."""
    s, h, d = cfg.seq_len, cfg.hidden, cfg.head_dim
    q, kv = cfg.heads * d, cfg.kv_heads * d
    mlp_mats = 3 if cfg.mlp == "swiglu" else 2
    return 2 * s * (h * q + 2 * h * kv + q * h + mlp_mats * h * cfg.ffn_hidden) + 4 * s * s * q


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b", "llama2-70b", "gpt3-1.3b", "llama3-8b"])
def test_block_flops_match_closed_form(name):
    cfg = get_config(name)
    spec = from_config(cfg)
    block = spec.layers[1]
    assert block.flops_fwd.total == pytest.approx(_closed_form_block_fwd_flops(cfg), rel=0.02)
    # backward = 2x forward for matmuls, 2.5x for FlashAttention's recomputing backward
    assert 2.0 <= block.flops_bwd.total / block.flops_fwd.total <= 2.2


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b"])
def test_large_spec_extraction_is_fast(name):
    from_config.cache_clear()
    start = time.perf_counter()
    spec = autoplan.models.get(name)
    assert time.perf_counter() - start < 15
    assert spec.num_layers == get_config(name).layers + 2


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_spec_params_match_published(name):
    published, _source = PUBLISHED_PARAMS[name]
    assert autoplan.models.get(name).num_params == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_split_is_exact(tp):
    """A block measured at TP shapes 1/tp equals replicated + sharded/tp of the spec."""
    import dataclasses
    cfg = get_config("llama-tiny")
    spec = from_config(cfg)
    wide = from_config(dataclasses.replace(cfg.resolved(), heads=cfg.resolved().heads * 2,
                                           kv_heads=cfg.resolved().kv_heads * 2,
                                           ffn_hidden=cfg.resolved().ffn_hidden * 2))
    b1, b2 = spec.layers[1], wide.layers[1]
    # Doubling the sharded widths is TP degree 1/2: value(1/2) = replicated + 2 * sharded.
    assert b2.params.total == pytest.approx(b1.params.replicated + 2 * b1.params.sharded)
    assert b1.params.at(tp) == pytest.approx(b1.params.replicated + b1.params.sharded / tp)


def test_activation_modes_are_ordered():
    block = autoplan.models.get("gpt3-13b").layers[1]
    a = block.activation_bytes
    assert a.full.total < a.selective.total <= a.none.total
    math_block = autoplan.models.get("gpt3-13b", attention="math").layers[1]
    # Without FlashAttention the s x s scores dominate and selective recompute removes them.
    assert math_block.activation_bytes.none.total > 2 * block.activation_bytes.none.total
    assert math_block.activation_bytes.selective.total < 0.5 * math_block.activation_bytes.none.total


def test_from_module_measures_a_user_module():
    import torch
    import torch.nn as nn
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    spec = autoplan.models.from_module(model, torch.randn(4, 32))
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert spec.layers[0].flops_fwd.total == pytest.approx(2 * 32 * 64)  # per sample
    assert spec.tp_degrees() == [1]
    assert next(model.parameters()).device.type == "cpu"  # the user's module is untouched


@pytest.mark.parametrize("bad,field", [
    (dict(heads=7), "hidden"),
    (dict(kv_heads=5), "kv_heads"),
    (dict(arch="rnn"), "arch"),
    (dict(layers=0), "layers"),
    (dict(arch="moe", num_experts=1), "num_experts"),
    (dict(norm="batchnorm"), "norm"),
], ids=["heads", "kv_heads", "arch", "layers", "experts", "norm"])
def test_bad_model_config_names_field(bad, field):
    base = dict(layers=2, hidden=64, heads=4, seq_len=16, vocab=100)
    with pytest.raises(autoplan.ConfigError) as e:
        autoplan.models.transformer(**{**base, **bad})
    assert e.value.field == field


def test_unknown_preset_suggests_closest():
    with pytest.raises(autoplan.ConfigError, match="llama3-8b"):
        autoplan.models.get("llama3-8")
