"""ModelSpecs measured on meta agree with closed-form counts, without memory."""
from __future__ import annotations

import pytest

import autoplan
from autoplan.models import from_config
from autoplan.models.presets import PUBLISHED_ACTIVE_PARAMS, PUBLISHED_PARAMS, get_config
from autoplan.models.spec import Split


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


# name: (weight matrices, parameter tensors) of one block, by its architecture: GPT-3's
# separate q/k/v, output and two MLP linears with biases and two LayerNorms (scale and bias);
# Llama's q/k/v/o and three SwiGLU linears without biases and two RMSNorm scales.
BLOCK_TENSORS = {"gpt3-1.3b": (6, 16), "llama3-8b": (7, 9)}


@pytest.mark.parametrize("name", sorted(BLOCK_TENSORS))
def test_block_counts_its_weight_matrices_and_parameter_tensors(name):
    """What a per-module ZeRO-3 gathers (weight matrices) and reduce-scatters (every tensor)."""
    weights, tensors = BLOCK_TENSORS[name]
    block = next(l for l in autoplan.models.get(name).layers if l.kind == "block")
    assert (block.weight_tensors(), block.param_tensors, block.parameter_tensors()) == (weights, tensors, tensors)


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b"])
def test_large_spec_extraction_measures_every_layer(name):
    """A model of hundreds of billions of parameters is measured on meta (one block, then
    replicated): embedding, every block, head."""
    from_config.cache_clear()
    spec = autoplan.models.get(name)
    assert spec.num_layers == get_config(name).layers + 2


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_spec_params_match_published(name):
    published, _source = PUBLISHED_PARAMS[name]
    assert autoplan.models.get(name).num_params == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE_PARAMS))
def test_active_params_match_published(name):
    """Parameters one token passes through; publications round them and some leave the token
    embedding out, so the figure must lie between the two counts (within 3%)."""
    spec, cfg = autoplan.models.get(name), get_config(name)
    published = PUBLISHED_ACTIVE_PARAMS[name]
    low, high = spec.active_params - cfg.vocab * cfg.hidden, spec.active_params
    assert low * 0.97 <= published <= high * 1.03, (name, low, high, published)


def _closed_form_moe_block_fwd_flops(cfg) -> float:
    """Active-parameter forward FLOPs of one expert block: attention as above, the router,
    and every token through top_k routed experts (+ the shared expert), all SwiGLU."""
    s, h, d = cfg.seq_len, cfg.hidden, cfg.head_dim
    q, kv = cfg.heads * d, cfg.kv_heads * d
    attention = 2 * s * (h * q + 2 * h * kv + q * h) + 4 * s * s * q
    experts = 2 * s * 3 * h * (cfg.top_k * cfg.moe_ffn_hidden + cfg.shared_ffn_hidden)
    return attention + experts + 2 * s * h * cfg.num_experts


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_moe_block_flops_are_active_parameter_flops(name):
    cfg = get_config(name)
    block = from_config(cfg).layers[-2]
    assert block.flops_fwd.total == pytest.approx(_closed_form_moe_block_fwd_flops(cfg), rel=0.01)
    e = block.experts
    assert (e.num_experts, e.top_k) == (cfg.num_experts, cfg.top_k)
    assert e.params.total == pytest.approx(3 * cfg.num_experts * cfg.hidden * cfg.moe_ffn_hidden)
    assert e.params.replicated == 0   # tensor parallelism shards every expert weight
    # One all-to-all carries every token's top_k copies of the hidden state (bf16). Slots per
    # expert are whole numbers: 4096 x 4 / 60 experts rounds up by 0.3%.
    assert e.dispatch_bytes == pytest.approx(cfg.seq_len * cfg.top_k * cfg.hidden * 2, rel=0.005)
    assert 0 < e.activation_bytes.total < block.activation_bytes.none.total
    assert {g.expert for g in block.gemms_fwd} == {True, False}
    assert sum(g.flops for g in block.gemms_fwd if g.expert) == pytest.approx(
        2 * cfg.seq_len * 3 * cfg.hidden * cfg.top_k * cfg.moe_ffn_hidden, rel=0.005)
    assert sum(g.flops for g in block.gemms_bwd if g.expert) == pytest.approx(
        2 * sum(g.flops for g in block.gemms_fwd if g.expert))


def test_dense_first_blocks_and_latent_attention():
    cfg = get_config("deepseek-v3")
    spec = from_config(cfg)
    blocks = [l for l in spec.layers if l.kind == "block"]
    assert len(blocks) == 61 and [b.experts is None for b in blocks[:4]] == [True, True, True, False]
    assert spec.num_experts == 256
    dense, moe = blocks[0], blocks[-1]
    # Latent attention: the latent down projections are replicated under tensor parallelism.
    latent = cfg.hidden * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.rope_head_dim) + cfg.q_lora_rank + cfg.kv_lora_rank
    assert dense.params.replicated == pytest.approx(latent + 2 * cfg.hidden)   # + the two block norms
    assert moe.params.total - moe.experts.params.total == pytest.approx(
        dense.params.total - 3 * cfg.hidden * cfg.ffn_hidden + 3 * cfg.hidden * cfg.shared_ffn_hidden
        + cfg.hidden * cfg.num_experts)


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


class _TinyLM:
    """A user's language model in the usual shape: embeddings, a ModuleList of blocks,
    a final norm and an output head (optionally tied), taking (ids[, mask])."""

    @staticmethod
    def build(tied: bool, vocab: int = 97, dim: int = 32, layers: int = 3, seq: int = 24):
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(dim)
                self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

            def forward(self, x):
                return x + self.mlp(self.norm(x))

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.tok = nn.Embedding(vocab, dim)
                self.pos = nn.Embedding(seq, dim)
                self.layers = nn.ModuleList(Block() for _ in range(layers))
                self.norm = nn.LayerNorm(dim)
                self.head = nn.Linear(dim, vocab, bias=False)
                if tied:
                    self.head.weight = self.tok.weight

            def forward(self, ids, mask=None):
                import torch
                x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
                if mask is not None:
                    x = x * mask.unsqueeze(-1)
                for layer in self.layers:
                    x = layer(x)
                return self.head(self.norm(x))

        return LM()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("inputs", ["ids", "ids-and-mask"])
def test_from_module_counts_embedding_and_head_at_the_real_length(tied, inputs):
    """Everything outside ``layers`` (embeddings, final norm, head) is part of the spec,
    every parameter is counted once (a tied table too), FLOPs are those of the whole
    forward at the example's sequence length, and a tuple of inputs works."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    model = _TinyLM.build(tied)
    ids = torch.randint(0, 97, (2, 24))
    example = ids if inputs == "ids" else (ids, torch.ones(2, 24))
    spec = autoplan.models.from_module(model, example, dtype="fp32")
    assert [l.kind for l in spec.layers] == ["embedding", "block", "block", "block", "head"]
    assert spec.num_params == sum(p.numel() for p in model.parameters())   # parameters() dedups ties
    assert spec.seq_len == 24 and spec.tokens_per_sample == 24
    with FlopCounterMode(display=False) as fc:
        model(*(example if isinstance(example, tuple) else (example,)))[:1].float().sum()
    per_sample = fc.get_total_flops() / 2
    assert sum(l.flops_fwd.total for l in spec.layers) == pytest.approx(per_sample, rel=1e-6)
    assert spec.layers[-1].flops_fwd.total == pytest.approx(2 * 24 * 32 * 97, rel=1e-6)


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


# One small GPT block with dropout, explicit attention: s = 32, h = 64, 4 heads, bf16 (2 bytes).
_S, _H, _HEADS, _B = 32, 64, 4, 2


def _block(**fused):
    model = autoplan.models.transformer(layers=1, hidden=_H, heads=_HEADS, seq_len=_S, vocab=128, attention="math",
                                        dropout=0.1, name="fusion-probe", **fused)
    return model.layers[1]


@pytest.mark.parametrize("fused,fwd_saved,bwd_saved,gemms_fewer", [
    # Scale, mask and softmax in one kernel: the mask pass over the scores and the scaling of
    # q go, forward (read + write of the scores, q's read + write, and building the s x s
    # boolean mask: ones, triu's read and write, masked_fill's read) and backward (the mask
    # pass over the scores' gradient with its read of the mask, the scaling of q's gradient).
    (dict(fused_softmax=True),
     Split(4 * _S * _S, 2 * _HEADS * _S * _S * _B + 2 * _S * _H * _B),
     Split(_S * _S, 2 * _HEADS * _S * _S * _B + 2 * _S * _H * _B), 0),
    # Dropout and residual add of both branches in one kernel each: one write and one read
    # of each branch's dropped output go.
    (dict(fused_dropout_add=True), Split(2 * 2 * _S * _H * _B, 0), Split(0, 0), 0),
    # One q/k/v GEMM: two of the three forward and input-gradient GEMMs and two of the
    # weight-gradient ones go, and the backward's two adds of input gradients (three tensors
    # each); the split's backward concatenates the three gradients (a read and a write).
    (dict(fused_qkv=True), Split(0, 0), Split(2 * 3 * _S * _H * _B, -2 * 3 * _S * _H * _B), 2),
], ids=["fused-softmax", "fused-dropout-add", "fused-qkv"])
def test_stack_fusions_remove_exactly_their_passes(fused, fwd_saved, bwd_saved, gemms_fewer):
    plain, fusedl = _block(), _block(**fused)
    assert fusedl.params == plain.params
    assert plain.memory_bytes_fwd.replicated - fusedl.memory_bytes_fwd.replicated == pytest.approx(fwd_saved.replicated)
    assert plain.memory_bytes_fwd.sharded - fusedl.memory_bytes_fwd.sharded == pytest.approx(fwd_saved.sharded)
    assert plain.memory_bytes_bwd.replicated - fusedl.memory_bytes_bwd.replicated == pytest.approx(bwd_saved.replicated)
    assert plain.memory_bytes_bwd.sharded - fusedl.memory_bytes_bwd.sharded == pytest.approx(bwd_saved.sharded)
    assert len(plain.gemms_fwd) - len(fusedl.gemms_fwd) == gemms_fewer
    # The same arithmetic: GEMM FLOPs do not change, whatever the grouping.
    flops = lambda gemms: sum(2 * g.m * g.n * g.k * g.count for g in gemms)  # noqa: E731
    assert flops(fusedl.gemms_fwd) == pytest.approx(flops(plain.gemms_fwd))
    assert flops(fusedl.gemms_bwd) == pytest.approx(flops(plain.gemms_bwd))
    assert fusedl.kernels_fwd < plain.kernels_fwd


def test_fused_softmax_is_recomputed_with_the_core():
    """Selective recomputation re-runs the attention core, fused kernels inside it included."""
    for fused in ({}, dict(fused_softmax=True)):
        block = _block(**fused)
        assert block.core_memory_bytes_fwd.sharded >= 2 * _HEADS * _S * _S * _B   # at least the softmax's read + write


# unit -> (GEMMs re-run of the unit's forward GEMMs, attention re-run): PyTorch's
# early-stopping checkpoint re-runs a unit's forward up to its last save only.
EARLY_STOP_CASES = {
    "gpt-block-skips-the-down-projection": ("gpt2-small", 1, "all-but-last", 1.0),
    "llama-block-skips-the-down-projection": ("llama3.2-1b", 1, "all-but-last", 1.0),
    "head-skips-its-vocabulary-gemm": ("gpt2-small", -1, "none", 0.0),
}


@pytest.mark.parametrize("case", list(EARLY_STOP_CASES), ids=list(EARLY_STOP_CASES))
def test_recompute_prefix_stops_at_the_last_save(case):
    name, index, gemms, attention = EARLY_STOP_CASES[case]
    layer = autoplan.models.get(name, seq_len=256).layers[index]
    pre = layer.recompute_prefix
    assert pre.gemms == {"all-but-last": len(layer.gemms_fwd) - 1, "none": 0}[gemms]
    assert pre.attention_share == attention
    assert 0 < pre.kernels < layer.kernels_fwd
    assert 0 < pre.memory_bytes.at(1) < layer.memory_bytes_fwd.at(1)


# name: (model, unit index, tensor-parallel degree, the largest weight in units of h^2 or, when
# the unit reads no weight through a matmul, None: the whole unit)
LARGEST_WEIGHT = {
    "gpt3-block-fc1": ("gpt3-175b", 1, 1, 4.0),
    "gpt3-block-fc1-tp8": ("gpt3-175b", 1, 8, 0.5),
    "llama3-block-gate": ("llama3-8b", 1, 1, 14336 / 4096),
    "embedding-is-one-table": ("llama3-8b", 0, 1, None),
}


@pytest.mark.parametrize("name", list(LARGEST_WEIGHT), ids=list(LARGEST_WEIGHT))
def test_largest_weight(name):
    """The largest single weight matrix a tensor-parallel rank holds (what an engine that
    gathers per sub-module brings in at once)."""
    model, unit, tp, squares = LARGEST_WEIGHT[name]
    cfg = get_config(model)
    layer = autoplan.models.get(model).layers[unit]
    expected = layer.params.at(tp) if squares is None else squares * cfg.hidden ** 2
    assert layer.largest_weight(tp) == pytest.approx(expected, rel=1e-9)
