"""HuggingFace config.json reader: real configs map to the presets; bad ones name the field."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoplan.errors import ConfigError
from autoplan.models.hf import config_from_hf
from autoplan.models.presets import get_config

# Abridged copies of the public config.json files (shape fields verbatim, plus some of the
# fields the reader must ignore).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
# meta-llama/Llama-3.1-8B: the same shapes with Llama 3.1's rotary scaling and 128k positions.
LLAMA31_8B = {**LLAMA3_8B, "max_position_embeddings": 131072,
              "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32000,
}
GPT2 = {  # gpt2 (small): no n_inner and no tie_word_embeddings, both class defaults
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768,
    "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
}
BERT_BASE = {
    "architectures": ["BertForMaskedLM"], "hidden_act": "gelu", "hidden_size": 768,
    "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "model_type": "bert", "num_attention_heads": 12, "num_hidden_layers": 12,
    "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": 30522,
}
MISTRAL_7B = {
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "sliding_window": 4096, "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN2_0_5B = {
    "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "tie_word_embeddings": True, "vocab_size": 151936,
}
PYTHIA_160M = {
    "hidden_size": 768, "intermediate_size": 3072, "max_position_embeddings": 2048,
    "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12,
    "rotary_pct": 0.25, "tie_word_embeddings": False, "vocab_size": 50304,
}
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "tie_word_embeddings": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False, "vocab_size": 151936,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "aux_loss_alpha": 0.001, "first_k_dense_replace": 1,
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}
# The complete published DeepSeek-V3 config.json ships as an example.
DEEPSEEK_V3 = json.loads((Path(__file__).parents[1] / "examples/models/deepseek-v3/config.json").read_text())

# case -> (config.json, overrides, preset it must equal (or None), expected fields)
GOOD = {
    "llama3.1-8b": (LLAMA31_8B, {"seq_len": 8192}, "llama3-8b", dict(rope_scaling_factor=8.0)),
    "llama3-8b-default-seq": (LLAMA3_8B, {}, None, dict(seq_len=4096, kv_heads=8, arch="llama",
                                                       rope_theta=500000.0, rope_scaling_factor=None,
                                                       norm_eps=1e-5, qkv_bias=False)),
    "mixtral-8x7b": (MIXTRAL_8X7B, {}, "mixtral-8x7b", dict(seq_len=4096)),
    "gpt2": (GPT2, {}, "gpt2-small", dict(tie_embeddings=True, ffn_hidden=3072, max_positions=1024)),
    "bert-base": (BERT_BASE, {}, "bert-base", dict(causal=False, tie_embeddings=True, norm_eps=1e-12)),
    "mistral-7b": (MISTRAL_7B, {}, None, dict(arch="llama", kv_heads=8, ffn_hidden=14336)),
    "qwen2-0.5b": (QWEN2_0_5B, {}, None, dict(hidden=896, heads=14, kv_heads=2, head_dim=64,
                                              tie_embeddings=True, vocab=151936, qkv_bias=True,
                                              bias=False, rope_theta=10000.0)),
    "pythia-160m": (PYTHIA_160M, {}, None, dict(arch="gpt", position="rope", seq_len=2048,
                                                tie_embeddings=False)),
    "explicit-head-dim": ({**MISTRAL_7B, "head_dim": 64}, {}, None, dict(head_dim=64, heads=32)),
    "overrides": (LLAMA3_8B, {"layers": 2, "attention": "math"}, None, dict(layers=2, attention="math")),
    "qwen1.5-moe-a2.7b": (QWEN1_5_MOE_A2_7B, {}, "qwen1.5-moe-a2.7b", dict(shared_ffn_hidden=5632,
                                                                        normalize_top_k=False)),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, {}, "qwen3-30b-a3b", dict(moe_ffn_hidden=768, head_dim=128, dense_layers=0)),
    "deepseek-v2-lite": (DEEPSEEK_V2_LITE, {}, "deepseek-v2-lite", dict(q_lora_rank=0, shared_ffn_hidden=2816)),
    "deepseek-v3": (DEEPSEEK_V3, {}, "deepseek-v3", dict(dense_layers=3, kv_lora_rank=512, rope_head_dim=64)),
    "moe-capacity-override": (MIXTRAL_8X7B, {"capacity_factor": 1.25}, None, dict(capacity_factor=1.25)),
}


@pytest.mark.parametrize("case", GOOD, ids=list(GOOD))
def test_reads_public_configs(case):
    data, overrides, preset, expected = GOOD[case]
    cfg = config_from_hf(data, **overrides)
    assert {k: getattr(cfg, k) for k in expected} == expected
    if preset:
        assert dataclasses.replace(cfg, name=preset) == get_config(preset)


def test_reads_a_file_or_its_directory(tmp_path):
    model_dir = tmp_path / "Meta-Llama-3-8B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    by_file = config_from_hf(model_dir / "config.json")
    by_dir = config_from_hf(str(model_dir))
    assert by_file == by_dir and by_file.name == "Meta-Llama-3-8B"


def _without(data: dict, key: str) -> dict:
    return {k: v for k, v in data.items() if k != key}


# case -> (config.json content, or raw text for a file, expected field, words in the message)
BAD = {
    "missing-hidden-size": (_without(LLAMA3_8B, "hidden_size"), "hidden_size", "required"),
    "missing-model-type": (_without(LLAMA3_8B, "model_type"), "model_type", "required"),
    "missing-experts": (_without(MIXTRAL_8X7B, "num_local_experts"), "num_local_experts", "required"),
    "missing-gpt2-positions": (_without(_without(GPT2, "n_positions"), "n_ctx"), "n_ctx", "required"),
    "heads-not-an-integer": ({**LLAMA3_8B, "num_attention_heads": "x"}, "num_attention_heads",
                             "must be an integer, got 'x'"),
    "fractional-layers": ({**LLAMA3_8B, "num_hidden_layers": 31.5}, "num_hidden_layers", "integer"),
    "zero-vocab": ({**GPT2, "vocab_size": 0}, "vocab_size", ">= 1"),
    "tie-not-bool": ({**LLAMA3_8B, "tie_word_embeddings": "no"}, "tie_word_embeddings", "true or false"),
    "unknown-model-type": ({**LLAMA3_8B, "model_type": "t5"}, "model_type", "supported model types: llama"),
    # A mixture-of-experts family must not be read as its dense neighbour (qwen2 for
    # qwen3_moe would plan a model several times too small): no "did you mean", and
    # expert keys under a dense model_type are refused.
    "moe-family-unsupported": ({**LLAMA3_8B, "model_type": "olmoe", "num_experts": 64,
                                "moe_intermediate_size": 1024, "num_experts_per_tok": 8},
                               "model_type", "mixture-of-experts layers (num_experts"),
    "experts-under-dense-type": ({**LLAMA3_8B, "model_type": "qwen2", "num_experts": 128,
                                  "num_experts_per_tok": 8}, "num_experts", "dense family"),
    "heads-not-dividing-hidden": ({**LLAMA3_8B, "num_attention_heads": 30, "num_key_value_heads": 10},
                                  "hidden_size", "not divisible"),
    "kv-heads-not-dividing": ({**LLAMA3_8B, "num_key_value_heads": 5}, "num_key_value_heads", "multiple"),
    "one-expert": ({**MIXTRAL_8X7B, "num_local_experts": 1}, "num_local_experts", ">= 2"),
    "top-k-over-experts": ({**MIXTRAL_8X7B, "num_experts_per_tok": 9}, "num_experts_per_tok",
                           "1..num_experts=8"),
    "unknown-rope-scaling": ({**LLAMA3_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling",
                             "'yarn' is not supported"),
    "negative-rope-factor": ({**LLAMA31_8B, "rope_scaling": {"rope_type": "llama3", "factor": -1}},
                             "rope_scaling.factor", "> 0"),
    "zero-norm-eps": ({**LLAMA3_8B, "rms_norm_eps": 0}, "rms_norm_eps", "> 0"),
    "qwen-interleaved-dense": ({**QWEN3_30B_A3B, "mlp_only_layers": [3, 7]}, "mlp_only_layers", "interleaves"),
    "qwen-sparse-step": ({**QWEN1_5_MOE_A2_7B, "decoder_sparse_step": 2}, "decoder_sparse_step", "interleaves"),
    "deepseek-layer-freq": ({**DEEPSEEK_V3, "moe_layer_freq": 2}, "moe_layer_freq", "interleaved"),
    "deepseek-missing-rope-dim": (_without(DEEPSEEK_V3, "qk_rope_head_dim"), "qk_rope_head_dim", "required"),
    "deepseek-all-dense": ({**DEEPSEEK_V3, "first_k_dense_replace": 61}, "first_k_dense_replace", "no expert"),
    "negative-aux-loss": ({**MIXTRAL_8X7B, "router_aux_loss_coef": -1}, "router_aux_loss_coef", ">= 0"),
    "not-an-object": ("[1, 2]", "config.json", "expected an object"),
    "bad-json-file": ("{\"model_type\": \"llama\",", "config.json", "not valid JSON"),
    "not-json-at-all": ("model_type = llama", "config.json", "not valid JSON"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_configs_name_the_field(case, tmp_path):
    content, field, words = BAD[case]
    if isinstance(content, str):
        source = tmp_path / "config.json"
        source.write_text(content)
    else:
        source = content
    with pytest.raises(ConfigError) as info:
        config_from_hf(source)
    assert field in info.value.field
    assert words in str(info.value)


def test_file_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ConfigError, match="file not found") as info:
        config_from_hf(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match="is not valid JSON") as info:
        (tmp_path / "config.json").write_text("")
        config_from_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_field_errors_from_a_file_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_attention_heads": "x"}))
    with pytest.raises(ConfigError) as info:
        config_from_hf(tmp_path / "config.json")
    assert str(info.value).startswith("config.json")
    assert "num_attention_heads" in str(info.value)


OVERRIDE_ERRORS = {
    "unknown-key": ({"num_layers": 2}, "num_layers"),
    "bad-value-names-the-override": ({"kv_heads": 5}, "kv_heads"),
    "learned-table-too-short": ({"seq_len": 2048}, "seq_len"),  # gpt2 has 1024 positions
}


@pytest.mark.parametrize("case", OVERRIDE_ERRORS, ids=list(OVERRIDE_ERRORS))
def test_override_errors_name_the_override(case):
    overrides, field = OVERRIDE_ERRORS[case]
    with pytest.raises(ConfigError) as info:
        config_from_hf(GPT2 if field == "seq_len" else LLAMA3_8B, **overrides)
    assert info.value.field == field
