"""Context parallelism in the cost model: per-rank work and memory divided by cp, the
key/value exchange priced on the links it crosses and hidden behind attention where the
ring overlaps it, and weights' gradients and ZeRO over data x context ranks."""
from __future__ import annotations

from pathlib import Path

import pytest

import autoplan
from autoplan.plan import Plan
from costmodel import estimate
from costmodel.context import (AttentionShapes, context_shard, exchange_buffer_bytes, exchange_times,
                               has_attention)

CLUSTERS = Path(__file__).resolve().parents[1] / "examples" / "clusters"


@pytest.fixture(scope="module")
def cluster():
    return autoplan.Cluster.load(CLUSTERS / "dgx-h100-8nodes.json")


@pytest.fixture(scope="module")
def model():
    return autoplan.models.get("llama3-8b", layers=4, seq_len=32768)   # shared with test_search_context


def test_a_rank_does_1_over_cp_of_every_token_wise_quantity(model):
    block = next(l for l in model.layers if l.kind == "block")
    cp = 4
    part = context_shard(block, cp)
    assert part.params == block.params and part.tp_allreduces_fwd == block.tp_allreduces_fwd
    for name in ("flops_fwd", "flops_bwd", "attention_flops_fwd", "attention_flops_bwd", "memory_bytes_fwd"):
        assert getattr(part, name).total == pytest.approx(getattr(block, name).total / cp), name
    for mode in ("none", "selective", "full"):
        assert part.activation_bytes[mode].total == pytest.approx(block.activation_bytes[mode].total / cp)
    assert part.output_bytes == pytest.approx(block.output_bytes / cp)
    assert sum(g.flops for g in part.gemms_fwd) == pytest.approx(sum(g.flops for g in block.gemms_fwd) / cp)
    assert context_shard(block, 1) is block


def _ring(cluster, same_node: bool, cp: int = 8):
    stride = 1 if same_node else 8    # 8 GPUs per node: stride 8 puts each rank on another node
    return [tuple(r * stride for r in range(cp))]


SHAPES = AttentionShapes(q=64e6, kv=32e6)


def test_ring_transfers_hide_behind_long_attention(cluster):
    ring = _ring(cluster, same_node=False)
    exposed_f, _ = exchange_times(cluster, ring, "p2p", SHAPES, attention_fwd_s=10.0, attention_bwd_s=20.0)
    assert exposed_f == 0.0
    no_overlap_f, no_overlap_b = exchange_times(cluster, ring, "p2p", SHAPES, 10.0, 20.0, overlap=False)
    short_f, _ = exchange_times(cluster, ring, "p2p", SHAPES, attention_fwd_s=1e-6, attention_bwd_s=1e-6)
    assert no_overlap_f == pytest.approx(short_f, rel=1e-3) and no_overlap_f > 0
    # cp - 1 hops of the key/value chunk over a 50 GB/s NIC (latency and efficiency aside).
    assert no_overlap_f == pytest.approx(7 * SHAPES.kv / 50e9, rel=0.5)
    assert no_overlap_b > no_overlap_f


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_an_exchange_across_nodes_costs_more_than_inside_one(cluster, comm):
    inside = exchange_times(cluster, _ring(cluster, True), comm, SHAPES, 0.0, 0.0)
    across = exchange_times(cluster, _ring(cluster, False), comm, SHAPES, 0.0, 0.0)
    assert across[0] > 3 * inside[0] and across[1] > 3 * inside[1]


def test_exchange_buffers():
    assert exchange_buffer_bytes(8, "p2p", SHAPES) == 2 * SHAPES.kv
    assert exchange_buffer_bytes(8, "all_gather", SHAPES) == 8 * SHAPES.kv
    assert exchange_buffer_bytes(1, "a2a", SHAPES) == 0.0


def _plan(model, cluster, **kw):
    base = dict(tp=8, pp=1, dp=1, micro_batch=1, global_batch=4, sequence_parallel=True, zero=1)
    return Plan.uniform(model, cluster, **{**base, **kw})


def test_estimate_divides_activations_and_compute_by_cp(model, cluster):
    one = estimate(model, cluster, _plan(model, cluster))
    four = estimate(model, cluster, _plan(model, cluster, cp=4))
    assert four.memory_by_group[0].activations == pytest.approx(one.memory_by_group[0].activations / 4, rel=1e-6)
    assert four.breakdown["compute"] == pytest.approx(one.breakdown["compute"] / 4, rel=0.15)
    assert "cp_communication" in four.breakdown and "cp_communication" not in one.breakdown
    assert four.breakdown["cp_communication"] > 0
    # Same samples per step; 4x the GPUs, each with a quarter of every sequence.
    assert four.tokens_per_s > 3 * one.tokens_per_s


def test_weights_are_sharded_and_reduced_over_data_and_context_ranks(model, cluster):
    dp2 = estimate(model, cluster, _plan(model, cluster, dp=2, global_batch=4))
    cp2 = estimate(model, cluster, _plan(model, cluster, cp=2, global_batch=2))
    # ZeRO-1 shards optimizer states over 2 ranks in both plans.
    assert cp2.memory_by_group[0].optimizer == pytest.approx(dp2.memory_by_group[0].optimizer)
    assert cp2.stage_costs[0].grad_reduce == pytest.approx(dp2.stage_costs[0].grad_reduce)


def test_recomputed_attention_repeats_the_exchange(model, cluster):
    plain = estimate(model, cluster, _plan(model, cluster, cp=4, cp_comm="all_gather")).stage_costs[0]
    again = estimate(model, cluster, _plan(model, cluster, cp=4, cp_comm="all_gather",
                                           recompute="selective")).stage_costs[0]
    assert again.cp_comm_backward == pytest.approx(plain.cp_comm_backward + plain.cp_comm_forward)


def test_only_attention_layers_exchange(model):
    kinds = {l.kind: has_attention(l) for l in model.layers}
    assert kinds == {"embedding": False, "block": True, "head": False}
    math = autoplan.models.get("llama-tiny", attention="math")
    assert has_attention(next(l for l in math.layers if l.kind == "block"))


def test_zig_zag_balance_is_what_the_model_assumes():
    """Rank r of cp holds chunks r and 2cp-1-r of 2cp; causal attention work per rank
    (keys seen by its queries) is then the same on every rank, 1/cp of the total."""
    from autoplan.runtime.context import shard_positions
    s, cp = 256, 8
    total = s * (s + 1) / 2
    for r in range(cp):
        work = sum(p + 1 for p in shard_positions(s, cp, r, "p2p", True).tolist())
        assert work == pytest.approx(total / cp, rel=0.01)
