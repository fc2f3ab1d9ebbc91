"""Shape keys match a planner's LayerSpec to profiled entries: the same architecture at
another sequence length shares the fingerprint, anything that changes the work does not.
Shard configs are what one tensor-parallel rank runs."""
from __future__ import annotations

import pytest

from autoplan import models
from autoplan.errors import ConfigError
from autoplan.models.presets import get_config
from autoplan.profiler.shapes import shape_key, shard_config, spec_from_dict, spec_to_dict, tp_supported

UNITS = {"embedding": 0, "block": 1, "head": -1}


def key(preset: str, unit: str, dtype: str = "fp32", **over):
    return shape_key(models.get(preset, dtype=dtype, **over).layers[UNITS[unit]])


# (case id, (preset, overrides, dtype), (preset, overrides, dtype), unit, same fingerprint?)
KEY_CASES = [
    ("seq-len-changes-tokens-only", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"seq_len": 64}, "fp32"), "block", True),
    ("seq-len-embedding", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"seq_len": 64}, "fp32"), "embedding", True),
    ("seq-len-head", ("llama-tiny", {}, "fp32"), ("llama-tiny", {"seq_len": 128}, "fp32"), "head", True),
    ("seq-len-llama-block", ("llama-tiny", {}, "fp32"), ("llama-tiny", {"seq_len": 96}, "fp32"), "block", True),
    ("seq-len-moe-block", ("moe-tiny", {}, "fp32"), ("moe-tiny", {"seq_len": 64}, "fp32"), "block", True),
    ("seq-len-bert-block", ("bert-tiny", {}, "fp32"), ("bert-tiny", {"seq_len": 64}, "fp32"), "block", True),
    ("seq-len-math-attention", ("gpt-tiny", {"attention": "math"}, "fp32"),
     ("gpt-tiny", {"attention": "math", "seq_len": 64}, "fp32"), "block", True),
    ("gpt-vs-llama-block", ("gpt-tiny", {}, "fp32"), ("llama-tiny", {}, "fp32"), "block", False),
    ("flash-vs-math", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"attention": "math"}, "fp32"), "block", False),
    ("dtype", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {}, "bf16"), "block", False),
    ("wider-ffn", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"ffn_hidden": 512}, "fp32"), "block", False),
    ("more-heads", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"heads": 8}, "fp32"), "block", False),
    ("more-heads-math", ("gpt-tiny", {"attention": "math"}, "fp32"),
     ("gpt-tiny", {"heads": 8, "attention": "math"}, "fp32"), "block", False),
    ("fewer-kv-heads", ("llama-tiny", {}, "fp32"), ("llama-tiny", {"kv_heads": 1}, "fp32"), "block", False),
    ("bigger-vocab-head", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"vocab": 512}, "fp32"), "head", False),
    ("causal-vs-bidirectional", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"causal": False}, "fp32"), "block", False),
    ("layer-count-irrelevant", ("gpt-tiny", {}, "fp32"), ("gpt-tiny", {"layers": 5}, "fp32"), "block", True),
    ("shared-embedding-llama-moe", ("llama-tiny", {}, "fp32"), ("moe-tiny", {}, "fp32"), "embedding", True),
    ("moe-vs-llama-block", ("llama-tiny", {}, "fp32"), ("moe-tiny", {}, "fp32"), "block", False),
]


@pytest.mark.parametrize("a,b,unit,same", [c[1:] for c in KEY_CASES], ids=[c[0] for c in KEY_CASES])
def test_shape_key(a, b, unit, same):
    ka = key(a[0], unit, a[2], **a[1])
    kb = key(b[0], unit, b[2], **b[1])
    assert (ka.fingerprint == kb.fingerprint) == same
    seq_a = get_config(a[0], **a[1]).seq_len
    seq_b = get_config(b[0], **b[1]).seq_len
    assert (ka.tokens, kb.tokens) == (seq_a, seq_b)


SHARD_CASES = [
    # (id, preset, tp, expected (heads, kv_heads, ffn_hidden, vocab) or the error's text)
    ("gpt-tp1", "gpt-tiny", 1, (4, 4, 256, 256)),
    ("gpt-tp2", "gpt-tiny", 2, (2, 2, 128, 128)),
    ("gpt-tp4", "gpt-tiny", 4, (1, 1, 64, 64)),
    ("gpt-tp8-heads", "gpt-tiny", 8, "does not divide"),
    ("llama-gqa-tp2", "llama-tiny", 2, (2, 1, 128, 128)),
    ("llama-kv-replicated-tp4", "llama-tiny", 4, (1, 1, 64, 64)),
    ("gpt2-vocab-padded-tp4", "gpt2-small", 4, (3, 3, 768, 12565)),
    ("gpt2-tp8-heads", "gpt2-small", 8, "does not divide"),
]


@pytest.mark.parametrize("preset,tp,want", [c[1:] for c in SHARD_CASES], ids=[c[0] for c in SHARD_CASES])
def test_shard_config(preset, tp, want):
    cfg = get_config(preset)
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            shard_config(cfg, tp)
        assert want in tp_supported(cfg, tp)
        return
    c = shard_config(cfg, tp)
    assert (c.heads, c.kv_heads, c.ffn_hidden, c.vocab) == want
    assert (c.hidden, c.head_dim, c.layers) == (cfg.hidden, cfg.head_dim, cfg.layers)
    assert tp_supported(cfg, tp) == ""


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny", "moe-tiny", "bert-tiny"])
def test_spec_round_trip(preset):
    for layer in models.get(preset, dtype="fp32").layers:
        back = spec_from_dict(spec_to_dict(layer))
        assert back == layer and back.name == layer.name and hash(back) == hash(layer)


# name: (backward ms, input-gradient ms or None) -> (input part, weight part)
BACKWARD_SPLITS = {
    "both-parts": (1.0, 0.4, (0.4, 0.6)),
    "no-input-gradient-timed": (1.0, None, (0.0, 1.0)),
    "noise-puts-the-input-pass-above-the-whole": (0.2364, 0.2468, (0.2364, 0.0)),
}


@pytest.mark.parametrize("name", list(BACKWARD_SPLITS), ids=list(BACKWARD_SPLITS))
def test_backward_split_adds_up(name):
    from autoplan.profiler.layers import split_backward

    total, inputs, (want_input, want_weight) = BACKWARD_SPLITS[name]
    st = {"backward_ms": total, **({"backward_input_ms": inputs} if inputs is not None else {})}
    got = split_backward(st)
    assert (got["backward_input_ms"], got["backward_weight_ms"]) == pytest.approx((want_input, want_weight))
    assert got["backward_input_ms"] + got["backward_weight_ms"] == pytest.approx(total)
