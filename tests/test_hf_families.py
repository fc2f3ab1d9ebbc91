"""Current model families from their HuggingFace config.json: the built model has the
published parameter count, each family's features are read, what is not modelled is
refused by name, and the features behave as specified (windows, soft-caps)."""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.errors import ConfigError
from autoplan.models.config import TransformerConfig
from autoplan.models.hf import config_from_hf
from autoplan.models.zoo import build_model
from autoplan.models.zoo.transformer import Attention

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"

# directory under examples/models -> (published parameter count, where it is published).
# The files and their provenance: examples/models/README.md.
PUBLISHED = {
    "gemma-2-2b": (2_614_636_800, "Gemma Team 2024 (arXiv 2408.00118), Table 2: 590,118,912 embedding "
                                  "+ 2,024,517,888 non-embedding"),
    "gemma-2-9b": (9_242_164_736, "Gemma Team 2024 (arXiv 2408.00118), Table 2: 917,962,752 embedding "
                                  "+ 8,324,201,984 non-embedding"),
    "phi-3-mini-4k-instruct": (3.82e9, "Hugging Face Hub, microsoft/Phi-3-mini-4k-instruct: 3.82B params"),
    "qwen3-8b": (8.19e9, "Hugging Face Hub, Qwen/Qwen3-8B: 8.19B params (model card: 8.2B)"),
    "olmo-2-1124-7b": (7.3e9, "Hugging Face Hub, allenai/OLMo-2-1124-7B: 7.3B params"),
    "qwen2.5-7b": (7.61e9, "Qwen/Qwen2.5-7B model card: 7.61B"),
    "qwen2.5-0.5b": (494e6, "Hugging Face Hub, Qwen/Qwen2.5-0.5B: 494M params (model card: 0.49B)"),
    "deepseek-v3": (671e9, "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv 2412.19437): 671B total "
                           "(the 14B multi-token-prediction module excluded)"),
}
PARAM_TOLERANCE = 1e-3


@functools.cache
def config(name: str) -> TransformerConfig:
    return config_from_hf(MODELS / name / "config.json")


@pytest.mark.parametrize("name", PUBLISHED, ids=list(PUBLISHED))
def test_parameter_count_matches_publication(name):
    published, source = PUBLISHED[name]
    with torch.device("meta"):
        model = build_model(config(name))
    count = sum(p.numel() for p in model.parameters())   # a tied table counts once
    assert abs(count / published - 1) < PARAM_TOLERANCE, f"{name}: {count:,} vs {published:,.0f} ({source})"


def test_every_example_config_has_a_published_count():
    assert sorted(p.parent.name for p in MODELS.glob("*/config.json")) == sorted(PUBLISHED)


# directory -> fields the reader must set from the family's config.json
FEATURES = {
    "qwen2.5-7b": dict(qkv_bias=True, bias=False, qk_norm="none", tie_embeddings=False, kv_heads=4),
    "qwen2.5-0.5b": dict(qkv_bias=True, tie_embeddings=True),
    "qwen3-8b": dict(qk_norm="head", qkv_bias=False, head_dim=128, norm_layout="pre", tie_embeddings=False),
    "olmo-2-1124-7b": dict(qk_norm="full", norm_layout="output", kv_heads=32, tie_embeddings=False),
    "phi-3-mini-4k-instruct": dict(sliding_window=2047, global_every=0, kv_heads=32, vocab=32064),
    "gemma-2-9b": dict(mlp="geglu", norm_layout="sandwich", tie_embeddings=True, embed_scale=True,
                       sliding_window=4096, global_every=2, attn_softcap=50.0, logit_softcap=30.0,
                       head_dim=256, attn_scale=256 ** -0.5),
}


@pytest.mark.parametrize("name", FEATURES, ids=list(FEATURES))
def test_family_features_are_read(name):
    cfg = config(name)
    assert {k: getattr(cfg, k) for k in FEATURES[name]} == FEATURES[name]


def _with(name: str, **changes) -> dict:
    data = json.loads((MODELS / name / "config.json").read_text())
    data.update(changes)
    return data


# case -> (config.json content, the key the one-line error must name, words in it)
UNSUPPORTED = {
    "other-architecture": (_with("qwen3-8b", model_type="gemma3"), "model_type", "'gemma3' is not supported"),
    "qwen-sliding-window": (_with("qwen2.5-7b", use_sliding_window=True), "use_sliding_window", "not modelled"),
    "output-projection-bias": (_with("olmo-2-1124-7b", attention_bias=True), "attention_bias", "not modelled"),
    "gemma-other-activation": (_with("gemma-2-9b", hidden_activation="silu"), "hidden_activation",
                               "not modelled"),
}


@pytest.mark.parametrize("case", UNSUPPORTED, ids=list(UNSUPPORTED))
def test_what_is_not_modelled_is_refused_in_one_line(case):
    data, key, words = UNSUPPORTED[case]
    with pytest.raises(ConfigError) as info:
        config_from_hf(data)
    assert info.value.field.endswith(key) and words in str(info.value)
    assert "\n" not in str(info.value)


def _tiny(**kw) -> TransformerConfig:
    return autoplan.models.presets.get_config("llama-tiny", **kw)


# case -> (config, layer, does a token `window` or more positions back reach the last query?)
WINDOW_CASES = {
    "windowed-layer": (dict(sliding_window=4, global_every=2), 0, False),
    "global-layer": (dict(sliding_window=4, global_every=2), 1, True),
    "window-on-every-layer": (dict(sliding_window=4), 1, False),
    "soft-capped-window": (dict(sliding_window=4, attn_softcap=5.0), 0, False),
}


@pytest.mark.parametrize("case", WINDOW_CASES, ids=list(WINDOW_CASES))
def test_sliding_window_limits_what_a_query_sees(case):
    overrides, layer, reaches = WINDOW_CASES[case]
    cfg = _tiny(**overrides).resolved()
    torch.manual_seed(0)
    attn = Attention(cfg, cfg.layer_window(layer))
    x = torch.randn(1, 16, cfg.hidden)
    far = x.clone()
    far[:, 16 - 1 - 4] += 1.0        # 4 positions before the last query: outside a window of 4
    near = x.clone()
    near[:, 16 - 4] += 1.0            # 3 positions before: inside
    last = lambda t: attn(t)[0, -1]   # noqa: E731
    assert not torch.allclose(last(near), last(x))
    assert torch.allclose(last(far), last(x)) != reaches


def test_output_logits_are_soft_capped():
    cfg = _tiny(logit_softcap=2.0)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        model.layers[-1].output.weight.mul_(1000)    # logits far beyond the cap
        logits = model(torch.randint(0, cfg.vocab, (2, cfg.seq_len)))
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9


def test_windowed_layers_do_less_attention_work_in_the_spec():
    spec = autoplan.models.get(MODELS / "gemma-2-2b" / "config.json", layers=4, seq_len=8192)
    blocks = [l for l in spec.layers if l.kind == "block"]
    # Local layers (0, 2) see 4096 of 8192 tokens; global layers (1, 3) see all of them.
    fractions = [round(l.attention_fraction, 3) for l in blocks]
    assert fractions == [0.75, 1.0, 0.75, 1.0]
    from costmodel.compute import layer_timing
    dev = autoplan.Cluster.load(MODELS.parent / "clusters" / "dgx-h100-8nodes.json").groups[0].device
    local, glob = (layer_timing(dev, blocks[i], 1, 1, False, "bf16") for i in (0, 1))
    assert local.forward < glob.forward
    assert dataclasses.replace(blocks[0], attention_fraction=1.0) == blocks[1]
