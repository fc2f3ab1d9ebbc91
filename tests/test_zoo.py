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
from autoplan.models.zoo.latent_attention import LatentAttention
from autoplan.models.zoo.moe import GroupedExperts, MoE
from autoplan.models.zoo.transformer import MLP, Attention, Block

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
    "moe-capacity": ("moe-tiny", {"capacity_factor": 1.0}),
    "deepseek-mla": ("deepseek-tiny", {}),
    "deepseek-mla-math": ("deepseek-tiny", {"attention": "math", "q_lora_rank": 0}),
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
            # The router and latent attention's low-rank down projections stay replicated.
            routers = {n for n in linears if n.endswith(("moe.gate", "attention.q_a", "attention.kv_a"))}
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
        if style == "head_shared":   # no weights; only its gradient is summed over ranks
            continue
        if style == "experts":   # stacked [experts, out, in]: w1/w3 by output rows, w2 by input columns
            for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                n = getattr(d, name).shape[dim]
                getattr(d, name).data.copy_(getattr(s, name).data.narrow(dim, rank * n, n))
        elif style == "head_norm":   # replicated: every rank holds the whole scale
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
    make = {Attention: lambda c: Attention(c), MoE: lambda c: MoE(c), LatentAttention: lambda c: LatentAttention(c),
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
    "moe-shared-experts": (_transformer_shard_case, "deepseek-tiny", {}, MoE),
    "latent-attention": (_transformer_shard_case, "deepseek-tiny", {}, LatentAttention),
    "latent-attention-full-rank-q": (_transformer_shard_case, "deepseek-tiny", {"q_lora_rank": 0}, LatentAttention),
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
    plan = full.tp_plan()
    for h in halves:   # what the plan leaves out is replicated (the router, MLA's latent projections)
        for name, p in full.named_parameters():
            if not any(name.startswith(f"{fqn}.") for fqn in plan):
                h.get_parameter(name).data.copy_(p.data)
    for rank, h in enumerate(halves):
        _shard_like_tp(h, full, plan, rank, len(halves))
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


def _per_token_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Top-k token choice written token by token: sum_j w_j expert_{e_j}(x_t) (+ shared)."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.gate(flat), -1)
    w, e = probs.topk(moe.top_k, -1)
    if moe.normalize_top_k:
        w = w / w.sum(-1, keepdim=True)
    ex = moe.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(moe.top_k):
            i = e[t, j]
            h = (flat[t] @ ex.w1[i].T) * torch.nn.functional.silu(flat[t] @ ex.w3[i].T)
            out[t] += w[t, j] * (h @ ex.w2[i].T)
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.view_as(x)


ROUTING = {
    "dropless": ("moe-tiny", {}),
    "dropless-not-renormalised": ("moe-tiny", {"normalize_top_k": False}),
    "dropless-shared-experts": ("deepseek-tiny", {}),
}


@pytest.mark.parametrize("case", ROUTING, ids=list(ROUTING))
def test_token_choice_routing_matches_per_token_reference(case):
    preset, overrides = ROUTING[case]
    torch.manual_seed(0)
    moe = MoE(get_config(preset, **overrides))
    init_parameters(moe)
    x = torch.randn(2, 8, moe.gate.in_features)
    torch.testing.assert_close(moe(x), _per_token_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_capacity_drops_overflowing_tokens_only():
    """With capacity factor 1 a token's choice past its expert's slots contributes nothing;
    every other choice is exactly the dropless result, and shapes do not depend on routing."""
    torch.manual_seed(0)
    cfg = get_config("moe-tiny", capacity_factor=1.0)
    capped, free = MoE(cfg), MoE(dataclasses.replace(cfg, capacity_factor=None))
    init_parameters(capped)
    free.load_state_dict(capped.state_dict())
    x = torch.randn(2, 8, cfg.hidden)
    assert capped.capacity(16) == 8 and free.capacity(16) == 16     # 16 tokens x 2 / 4 experts
    diff = (capped(x) - free(x)).reshape(16, -1).abs().sum(-1)
    assert 0 < int((diff > 1e-6).sum()) < 16     # some tokens lost a choice, most did not


def test_load_balancing_loss_gradient():
    """The balance term adds d(coeff * N_E * sum_i f_i p_i)/d(probs) in backward and nothing in
    forward: equal to differentiating the loss written out with f held constant."""
    torch.manual_seed(0)
    cfg = get_config("moe-tiny", aux_loss_coeff=0.5)
    moe = MoE(cfg)
    init_parameters(moe)
    x = torch.randn(2, 8, cfg.hidden)
    plain = MoE(dataclasses.replace(cfg, aux_loss_coeff=0.0))
    plain.load_state_dict(moe.state_dict())
    torch.testing.assert_close(moe(x), plain(x), rtol=0, atol=0)
    moe(x).sum().backward()
    probs = torch.softmax(plain.gate(x.reshape(16, -1)), -1)
    f = torch.nn.functional.one_hot(probs.topk(2, -1).indices, 4).sum((0, 1)).float() / 32
    lbl = 4 * (f * probs.mean(0)).sum()
    (plain(x).sum() + 0.5 * lbl).backward()
    torch.testing.assert_close(moe.gate.weight.grad, plain.gate.weight.grad, rtol=1e-5, atol=1e-7)
    moe.balance.records = []
    with torch.no_grad():
        moe(x)          # evaluation: nothing recorded
    assert moe.balance.value() is None
    moe(x)
    assert moe.balance.value() == pytest.approx(float(lbl.detach()), rel=1e-6)


def test_grouped_experts_init_and_shapes():
    torch.manual_seed(0)
    ex = GroupedExperts(4, 8, 16)
    init_parameters(ex)
    assert ex.w1.shape == ex.w3.shape == (4, 16, 8) and ex.w2.shape == (4, 8, 16)
    assert 0.01 < float(ex.w1.detach().std()) < 0.03
    assert ex(torch.randn(4, 5, 8)).shape == (4, 5, 8)
