"""An operator-level plan for a model the zoo has never seen runs on 4 gloo ranks and
computes what one process computes.

The models are written here, as a user would write them: a small GPT-style transformer
(separate q/k/v, learned positions, GELU MLP, untied head) and an MLP-Mixer (token mixing
through a transposed linear). Each is searched as an ``nn.Module`` at the size one would
train it (on a DGX A100 node, so the layouts are the ones tensor parallelism needs), and
the plan's layouts are run on a small instance of the same code: the loss and every
gradient must equal a single-process reference, and the collectives the runtime issues in
the forward must be exactly the ones the plan implies.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplan

WORLD = 4
GRAD_ATOL = 1e-5


# ------------------------------------------------------------------ user models
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, ids):
        return self.tok(ids) + self.pos


class LMHead(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2, seq=16):
        super().__init__()
        self.layers = nn.ModuleList([Embed(vocab, dim, seq), *(Layer(dim, heads) for _ in range(layers)),
                                     LMHead(vocab, dim)])

    def forward(self, ids):
        for unit in self.layers:
            ids = unit(ids)
        return ids


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.norm1, self.tok1, self.tok2 = nn.LayerNorm(dim), nn.Linear(tokens, 2 * tokens), nn.Linear(2 * tokens, tokens)
        self.norm2, self.ch1, self.ch2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        y = self.norm1(x).transpose(1, 2)
        x = x + self.tok2(F.gelu(self.tok1(y))).transpose(1, 2)
        return x + self.ch2(F.gelu(self.ch1(self.norm2(x))))


class Stem(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(patch, dim)

    def forward(self, patches):
        return self.proj(patches)


class Classifier(nn.Module):
    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        return self.out(self.norm(x).mean(dim=1))


class Mixer(nn.Module):
    def __init__(self, tokens=16, patch=48, dim=64, layers=2, classes=32):
        super().__init__()
        self.layers = nn.ModuleList([Stem(patch, dim), *(MixerBlock(tokens, dim) for _ in range(layers)),
                                     Classifier(dim, classes)])

    def forward(self, x):
        for unit in self.layers:
            x = unit(x)
        return x


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def cls_loss(logits, target):
    return F.cross_entropy(logits, target)


# The model searched (at scale, on meta) and the one run (small, on 4 CPU ranks): same code and
# depth (layouts are per unit), different widths.
MODELS = {
    "gpt": dict(big=lambda: TinyGPT(vocab=32768, dim=2048, heads=16, layers=2, seq=1024),
                small=lambda: TinyGPT(vocab=256, dim=64, heads=4, layers=2, seq=16),
                inputs=lambda b, g, big: torch.randint(0, 32768 if big else 256, (b, 1024 if big else 16), generator=g),
                targets=lambda b, g, big: torch.randint(0, 32768 if big else 256, (b, 1024 if big else 16), generator=g),
                loss=lm_loss),
    "mixer": dict(big=lambda: Mixer(tokens=256, patch=768, dim=2048, layers=2, classes=21840),
                  small=lambda: Mixer(tokens=16, patch=48, dim=64, layers=2, classes=32),
                  inputs=lambda b, g, big: torch.randn(b, 256 if big else 16, 768 if big else 48, generator=g),
                  targets=lambda b, g, big: torch.randint(0, 21840 if big else 32, (b,), generator=g),
                  loss=cls_loss),
}
# name -> (model, tp degree the layouts are searched for, dp, co-shard factor of the blocks)
CASES = {
    "gpt-tp4": ("gpt", 4, 1, 1),
    "gpt-dp2-tp2": ("gpt", 2, 2, 1),
    "gpt-tp4-coshard2": ("gpt", 4, 1, 2),
    "mixer-tp4": ("mixer", 4, 1, 1),
}
MICRO_BATCH = 4


def _search(model: str, tp: int):
    spec = MODELS[model]
    with torch.device("meta"):
        big = spec["big"]()
    g = torch.Generator().manual_seed(0)
    x, y = spec["inputs"](1, g, True), spec["targets"](1, g, True)
    cluster = autoplan.Cluster.load("examples/clusters/dgx-a100-1node.json")
    res = autoplan.search(big, cluster, 32, layouts=True, example_inputs=x, loss_target=y, loss=spec["loss"],
                          tp=(tp,), coshard=(), interlace=False, pp=(1,), schedules=("1f1b",))
    return res.best.plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_case(rank: int, name: str, layouts, out: Path) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from autoplan.models.opview import implied_collectives
    from autoplan.runtime.operators import OperatorParallel, build_mesh

    model_name, tp, dp, _ = CASES[name]
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec["small"]()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = spec["inputs"](MICRO_BATCH * dp, g, False), spec["targets"](MICRO_BATCH * dp, g, False)
    mesh = build_mesh(dp, tp)
    d = mesh["dp"].get_local_rank()
    xs, ys = x[d * MICRO_BATCH:(d + 1) * MICRO_BATCH], y[d * MICRO_BATCH:(d + 1) * MICRO_BATCH]
    par = OperatorParallel(model, layouts, mesh, xs, target=ys, loss=spec["loss"], micro_batch=MICRO_BATCH,
                           dp_group=mesh["dp"].get_group())
    with CommDebugMode() as comm:
        loss = par(xs, ys)
    ran = Counter({str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()})
    par.backward(loss)
    par.finish_gradients()
    grads = par.full_gradients()
    ref_loss = spec["loss"](ref(x), y)
    ref_loss.backward()
    ref_grads = {f"{i}.{n}": p.grad for i, u in enumerate(ref.layers) for n, p in u.named_parameters()}
    expected = Counter()
    for u in par.units:
        for r in implied_collectives(u.graph, u.strategies, u.pout):
            if r.collective.phase == "forward":
                expected[r.collective.kind] += u.coshard
    names = {"all_gather": "all_gather_into_tensor", "all_reduce": "all_reduce",
             "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}
    loss_all = loss.detach().clone()
    dist.all_reduce(loss_all, group=mesh["dp"].get_group())
    return {"loss": loss_all.item() / dp, "ref_loss": ref_loss.item(),
            "grad_err": max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
            "missing": sorted(set(ref_grads) - set(grads)),
            "ran": dict(ran), "expected": {names[k]: v for k, v in expected.items()},
            "sharded": sum(1 for u in par.units for n, p in u.unit.named_parameters()
                           if any(pl.is_shard() for pl in p.placements))}


def _worker(rank: int, port: int, plans: dict, out: str) -> None:
    import warnings
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    try:
        for name, layouts_json in plans.items():
            layouts = autoplan.layouts.Layouts.from_dict(layouts_json) if layouts_json else None
            try:
                results[name] = _run_case(rank, name, layouts, Path(out))
            except Exception:
                results[name] = {"error": traceback.format_exc()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp
    import autoplan.layouts  # noqa: F401  (spawned ranks import it by name)
    plans = {}
    searched = {}
    for name, (model, tp, dp, coshard) in CASES.items():
        if (model, tp) not in searched:
            searched[(model, tp)] = _search(model, tp)
        lay = searched[(model, tp)].layouts
        if coshard > 1:
            lay = dataclasses.replace(lay, units=tuple(
                dataclasses.replace(u, coshard=coshard) if 0 not in u.units and len(u.units) > 0 and
                max(u.units) < 3 else u for u in lay.units))
        plans[name] = lay.to_dict()
    out = tmp_path_factory.mktemp("oprt")
    mp.spawn(_worker, args=(_free_port(), plans, str(out)), nprocs=WORLD)
    return {r: json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)}, searched


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_operator_plan_runs_equivalently(runs, case):
    results, searched = runs
    r = results[0][case]
    assert "error" not in r, r.get("error")
    assert r["sharded"] > 0, "the searched plan should shard parameters (it is tensor parallel)"
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_err"] < GRAD_ATOL
    assert r["missing"] == []
    # The runtime communicated exactly what the plan's data dependencies say.
    assert r["ran"] == r["expected"]


@pytest.mark.slow
def test_searched_plans_are_megatron_like(runs):
    """The searched transformer layouts shard q/k/v/up column-wise and o/down row-wise."""
    _, searched = runs
    lay = searched[("gpt", 4)].layouts
    block = lay.for_unit(1).param_placements()
    assert [block[k] for k in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "up.weight")] == ["S0"] * 4
    assert [block[k] for k in ("attn.o.weight", "down.weight")] == ["S1"] * 2
