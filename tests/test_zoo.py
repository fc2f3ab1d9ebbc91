"""The model zoo: every architecture builds, trains a step, splits into pipeline stages,
traces on meta, and shards by its tp_plan."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from autoplan.models.presets import get_config
from autoplan.models.zoo import TP_STYLES, build_model, example_inputs, init_parameters, loss_fn
from autoplan.models.zoo.swin import SwinBlock, WindowAttention
from autoplan.models.zoo.transformer import MLP, Attention, Block, MoE

# name -> (preset, overrides)
TINY = {
    "gpt": ("gpt-tiny", {}),
    "gpt-math": ("gpt-tiny", {"attention": "math"}),
    "gpt-relu-untied": ("gpt-tiny", {"mlp": "relu", "tie_embeddings": False}),
    "llama-gqa": ("llama-tiny", {}),
    "llama-math": ("llama-tiny", {"attention": "math"}),
    "qwen2-qkv-bias": ("llama-tiny", {"qkv_bias": True}),
    "qwen3-head-qk-norm": ("llama-tiny", {"qk_norm": "head"}),
    "olmo2-full-qk-norm-output-norms": ("llama-tiny", {"qk_norm": "full", "norm_layout": "output"}),
    "phi3-sliding-window": ("llama-tiny", {"sliding_window": 8}),
    "gemma2": ("llama-tiny", dict(mlp="geglu", norm_layout="sandwich", sliding_window=8, global_every=2,
                                  attn_softcap=50.0, logit_softcap=30.0, attn_scale=0.2, embed_scale=True,
                                  tie_embeddings=True)),
    "moe": ("moe-tiny", {}),
    "bert": ("bert-tiny", {}),
    "swin": ("swin-tiny-test", {}),
}
BATCH = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: a second intra-op thread buys nothing and, on a busy 2-core
    machine, spin-waits against other processes (measured 5x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(case: str):
    preset, overrides = TINY[case]
    return get_config(preset, **overrides)


def build(case: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(tiny(case))


def batch(case: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return example_inputs(tiny(case), BATCH, "cpu", torch.Generator().manual_seed(seed))


def output_shape(cfg) -> tuple[int, ...]:
    if cfg.arch == "swin":
        return (BATCH, cfg.num_classes)
    return (BATCH, cfg.seq_len, cfg.vocab)


@pytest.mark.parametrize("case", TINY, ids=list(TINY))
def test_forward_backward(case):
    model = build(case)
    x, y = batch(case)
    out = model(x)
    assert out.shape == output_shape(tiny(case))
    loss = loss_fn(out, y)
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


@pytest.mark.parametrize("case", TINY, ids=list(TINY))
def test_deterministic_under_seed(case):
    a, b, c = build(case, seed=3), build(case, seed=3), build(case, seed=4)
    x, _ = batch(case)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.equal(a(x), c(x))


@pytest.mark.parametrize("case", TINY, ids=list(TINY))
def test_pipeline_slices_compose(case):
    model = build(case)
    x, _ = batch(case)
    full = model(x)
    n = len(model.layers)
    for cuts in ([1], [n - 1], [1, n // 2, n - 1]):
        bounds = [0, *cuts, n]
        h = x
        for a, b in zip(bounds, bounds[1:]):
            h = nn.Sequential(*model.layers[a:b])(h)
        torch.testing.assert_close(h, full, rtol=0, atol=0)


@pytest.mark.parametrize("case", TINY, ids=list(TINY))
def test_unit_layout(case):
    cfg, model = tiny(case), build(case)
    names = [type(u).__name__ for u in model.layers]
    if cfg.arch == "swin":
        assert names[0] == "PatchEmbed" and names[-1] == "ClassifierHead"
        assert names.count("SwinBlock") == sum(cfg.depths)
        assert names.count("PatchMerging") == len(cfg.depths) - 1
    else:
        assert names == ["TokenEmbedding", *["Block"] * cfg.layers, "Head"]


@pytest.mark.parametrize("case", TINY, ids=list(TINY))
def test_meta_trace(case):
    """What the planner does: build on meta, forward+backward under FlopCounterMode and
    saved-tensor hooks, with no real memory."""
    cfg = tiny(case)
    with torch.device("meta"):
        model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    x, y = example_inputs(cfg, BATCH)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with FlopCounterMode(display=False) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        loss_fn(out, y).backward()
    assert out.shape == output_shape(cfg) and out.is_meta
    assert counter.get_total_flops() > 0 and saved
    if cfg.arch != "swin":
        # Fused attention saves no s x s score tensor; the math kernel saves one per layer.
        s = cfg.seq_len
        scores = sum(1 for shape in saved if len(shape) == 4 and shape[-2:] == (s, s))
        assert scores == (cfg.layers if cfg.attention == "math" else 0)


@pytest.mark.parametrize("case", TINY, ids=list(TINY))
def test_tp_plan_names_real_modules_and_covers_linears(case):
    model = build(case)
    for unit in model.layers:
        plan = unit.tp_plan()
        for fqn, style in plan.items():
            assert style in TP_STYLES, (fqn, style)
            unit.get_submodule(fqn)
        if isinstance(unit, (Block, SwinBlock)):
            linears = {n for n, m in unit.named_modules() if isinstance(m, nn.Linear)}
            routers = {n for n in linears if n.endswith("moe.gate")}
            assert linears - routers <= set(plan), sorted(linears - routers - set(plan))
            assert routers.isdisjoint(plan)


def _shard_rows(dst: nn.Linear, src: nn.Linear, rank: int, world: int) -> None:
    """Copy the ``rank``-th block of output features (a colwise shard)."""
    n = dst.out_features
    dst.weight.data.copy_(src.weight.data[rank * n:(rank + 1) * n])
    if src.bias is not None:
        dst.bias.data.copy_(src.bias.data[rank * n:(rank + 1) * n])


def _shard_cols(dst: nn.Linear, src: nn.Linear, rank: int, world: int) -> None:
    """Copy the ``rank``-th block of input features (a rowwise shard; bias on rank 0 only)."""
    n = dst.in_features
    dst.weight.data.copy_(src.weight.data[:, rank * n:(rank + 1) * n])
    if src.bias is not None:
        dst.bias.data.copy_(src.bias.data if rank == 0 else torch.zeros_like(src.bias))


def _shard_like_tp(dst: nn.Module, src: nn.Module, plan: dict[str, str], rank: int, world: int):
    """Fill a module built at per-rank shapes with rank ``rank``'s shard of ``src``."""
    for fqn, style in plan.items():
        d, s = dst.get_submodule(fqn), src.get_submodule(fqn)
        if style == "head_norm":   # replicated: every rank holds the whole scale
            d.weight.data.copy_(s.weight.data)
        elif style == "rowwise":
            _shard_cols(d, s, rank, world)
        elif isinstance(s, nn.Embedding):  # colwise embedding: a block of columns (heads)
            n = d.embedding_dim
            d.weight.data.copy_(s.weight.data[:, rank * n:(rank + 1) * n])
        else:
            _shard_rows(d, s, rank, world)


def _transformer_shard_case(preset: str, overrides: dict, module: type):
    cfg = get_config(preset, **overrides)
    half = cfg.with_shard(0.5)  # half the heads, kv heads and ffn; same hidden and head_dim
    make = {Attention: lambda c: Attention(c), MoE: lambda c: MoE(c),
            MLP: lambda c: MLP(c.hidden, c.ffn_hidden, c.mlp, c.bias)}[module]
    return cfg.hidden, make(cfg), [make(half) for _ in range(2)]


def _swin_shard_case(_preset: str, shift: int, module: type):
    # dim 32, 4 heads of 8 -> 2 heads of 8 per rank; resolution 8 with window 4.
    full = WindowAttention(32, 4, resolution=8, window=4, shift=shift)
    halves = [WindowAttention(32, 2, resolution=8, window=4, shift=shift, head_dim=8) for _ in range(2)]
    return 32, full, halves


SHARD_CASES = {
    "gpt-attention": (_transformer_shard_case, "gpt-tiny", {}, Attention),
    "gpt-mlp": (_transformer_shard_case, "gpt-tiny", {}, MLP),
    "llama-gqa-attention": (_transformer_shard_case, "llama-tiny", {}, Attention),
    "llama-math-attention": (_transformer_shard_case, "llama-tiny", {"attention": "math"}, Attention),
    "llama-swiglu": (_transformer_shard_case, "llama-tiny", {}, MLP),
    "qwen2-qkv-bias-attention": (_transformer_shard_case, "llama-tiny", {"qkv_bias": True}, Attention),
    "qwen3-head-qk-norm-attention": (_transformer_shard_case, "llama-tiny", {"qk_norm": "head"}, Attention),
    "gemma2-attention": (_transformer_shard_case, "llama-tiny",
                         dict(sliding_window=4, attn_softcap=5.0, attn_scale=0.3), Attention),
    "gemma2-geglu": (_transformer_shard_case, "llama-tiny", {"mlp": "geglu"}, MLP),
    "bert-attention": (_transformer_shard_case, "bert-tiny", {}, Attention),
    "moe-experts": (_transformer_shard_case, "moe-tiny", {}, MoE),
    "swin-window": (_swin_shard_case, "swin", 0, WindowAttention),
    "swin-shifted-window": (_swin_shard_case, "swin", 2, WindowAttention),
}


@pytest.mark.parametrize("case", SHARD_CASES, ids=list(SHARD_CASES))
def test_per_rank_shapes_reproduce_the_full_module(case):
    """Modules built at per-rank shard shapes (how the planner measures a TP rank) run, and
    two of them holding the colwise/rowwise shards sum to the unsharded output; this is what
    DTensor Colwise/RowwiseParallel does, so local head counts and GQA grouping are right."""
    factory, preset, arg, module = SHARD_CASES[case]
    torch.manual_seed(0)
    hidden, full, halves = factory(preset, arg, module)
    init_parameters(full)
    if isinstance(full, MoE):
        for h in halves:
            h.gate.weight.data.copy_(full.gate.weight.data)  # the router is replicated
    for rank, h in enumerate(halves):
        _shard_like_tp(h, full, full.tp_plan(), rank, len(halves))
    tokens = 64 if module is WindowAttention else 8
    x = torch.randn(2, tokens, hidden)
    torch.testing.assert_close(sum(h(x) for h in halves), full(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["gpt", "bert"], ids=["gpt", "bert"])
def test_tied_embeddings_share_one_tensor(case):
    model = build(case)
    assert model.layers[-1].output.weight is model.layers[0].tok_embeddings.weight
    untied = build_model(dataclasses.replace(tiny(case), tie_embeddings=False))
    assert sum(p.numel() for p in untied.parameters()) > sum(p.numel() for p in model.parameters())


EXAMPLE_CASES = {
    "gpt-meta": ("gpt", "meta"),
    "gpt-cpu": ("gpt", "cpu"),
    "swin-meta": ("swin", "meta"),
    "swin-cpu": ("swin", "cpu"),
}


@pytest.mark.parametrize("case", EXAMPLE_CASES, ids=list(EXAMPLE_CASES))
def test_example_inputs(case):
    arch, device = EXAMPLE_CASES[case]
    cfg = tiny(arch)
    x, y = example_inputs(cfg, 3, device)
    assert x.device.type == y.device.type == device
    if cfg.arch == "swin":
        assert (x.shape, x.dtype) == ((3, cfg.in_channels, cfg.image_size, cfg.image_size), torch.float32)
        assert (y.shape, y.dtype) == ((3,), torch.long)
        classes = cfg.num_classes
    else:
        assert x.shape == y.shape == (3, cfg.seq_len)
        assert x.dtype == y.dtype == torch.long
        classes = cfg.vocab
    if device != "meta":
        assert 0 <= y.min() and y.max() < classes
        again = example_inputs(cfg, 3, device, torch.Generator().manual_seed(7))
        assert all(torch.equal(a, b) for a, b in
                   zip(again, example_inputs(cfg, 3, device, torch.Generator().manual_seed(7))))


def test_build_model_rejects_other_configs():
    with pytest.raises(TypeError, match="TransformerConfig or SwinConfig"):
        build_model({"arch": "gpt"})
