"""Mixture-of-experts cost terms: routing load, expert GEMMs under expert parallelism, the
all-to-all on the links it crosses, expert states split by ep, against closed forms."""
from __future__ import annotations

import math

import pytest

import autoplan
from autoplan.models.spec import ExpertSpec, Gemm, Split
from autoplan.units import GB
from costmodel import EstimateOptions, experts
from costmodel.comm import collective_time
from costmodel.efficiency import default_efficiency
from costmodel.memory import model_state_bytes

H100 = "H100-SXM5-80GB"


def _spec(capacity_factor=None, top_k=2) -> ExpertSpec:
    return ExpertSpec(num_experts=8, top_k=top_k, params=Split(sharded=1e9), activation_bytes=Split(sharded=1e6),
                      dispatch_bytes=1e6, capacity_factor=capacity_factor)


LOADS = {
    # name: (spec, ep, tokens, stated, expected)
    "dense-layer": (None, 8, 4096, None, 1.0),
    "capacity-factor": (_spec(1.25), 8, 4096, None, 1.25),
    "stated-overrides": (_spec(1.25), 8, 4096, 1.1, 1.1),
    "dropless-one-rank": (_spec(), 1, 4096, None, 1.0),
    # Busiest of 8 ranks receiving Binomial(8 * 4096 * 2, 1/8) copies: mean 8192.
    "dropless-ep8": (_spec(), 8, 4096, None, 1 + math.sqrt(2 * math.log(8) * (7 / 8) * 8192) / 8192),
}


@pytest.mark.parametrize("name", list(LOADS), ids=list(LOADS))
def test_expert_load(name):
    spec, ep, tokens, stated, expected = LOADS[name]
    assert experts.expert_load(spec, ep, tokens, stated) == pytest.approx(expected)


def test_dropless_imbalance_grows_with_ep_and_shrinks_with_tokens():
    loads = [experts.expert_load(_spec(), ep, 4096) for ep in (2, 4, 8, 64)]
    assert loads == sorted(loads) and loads[0] > 1
    assert experts.expert_load(_spec(), 8, 512) > experts.expert_load(_spec(), 8, 8192)


@pytest.mark.parametrize("ep,load", [(1, 1.0), (4, 1.0), (8, 1.25)], ids=str)
def test_expert_gemm_shape_under_expert_parallelism(ep, load):
    """A rank holds count / ep experts, each on ep x load times the balanced token slots: the
    same FLOPs as all experts on its own tokens, times the load."""
    fwd = Gemm(m=1024, n=14336, k=4096, count=8, shard_dim="n", expert=True)
    wgrad = Gemm(m=14336, n=4096, k=1024, count=8, shard_dim="m", batch_dim="k", expert=True)
    for g, tokens_dim in ((fwd, 0), (wgrad, 2)):
        shape = g.shape(2, 2, ep, load)
        assert shape[3] == 8 / ep
        assert shape[tokens_dim] == 1024 * 2 * ep * load
        assert 2 * math.prod(shape) == pytest.approx(g.flops * 2 / 2 * load)   # micro-batch 2, tp 2
    dense = Gemm(m=1024, n=4096, k=4096)
    assert dense.shape(1, 1, 8, 2.0) == dense.shape(1, 1)


def _cluster(nodes, per_node, intra=100.0, inter=10.0):
    return autoplan.Cluster.homogeneous(H100, nodes, per_node, intra_node_GBps=intra, inter_node_GBps=inter,
                                        intra_node_latency_us=0, inter_node_latency_us=0)


def test_all_to_all_inside_a_node_runs_at_the_intra_node_link():
    cluster = _cluster(1, 8)
    eff = default_efficiency(H100).network
    t = collective_time(cluster, range(8), 8e8, "all_to_all")
    assert t == pytest.approx(7 / 8 * 8e8 / (100 * GB * eff))


def test_all_to_all_across_nodes_is_bound_by_the_nic_share():
    """8 ranks, 4 per node: each sends 3/8 of its buffer over NVLink and 4/8 through its NIC,
    at once; with a NIC 10x slower the NIC part sets the time."""
    eff = default_efficiency(H100).network
    cluster = _cluster(2, 4)
    t = collective_time(cluster, range(8), 8e8, "all_to_all")
    assert t == pytest.approx(4 / 8 * 8e8 / (10 * GB * eff))
    # Far slower than inside one node, but not the whole buffer at NIC speed.
    assert collective_time(_cluster(1, 8), range(8), 8e8, "all_to_all") < t < 7 / 8 * 8e8 / (10 * GB * eff)


@pytest.fixture(scope="module")
def mixtral():
    return autoplan.models.get("mixtral-8x7b")


@pytest.fixture(scope="module")
def dgx8():
    return autoplan.Cluster.load("examples/clusters/dgx-h100-8nodes.json")


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_expert_states_are_split_by_ep_and_zero_shards_over_the_rest(mixtral, zero):
    from autoplan.stacks import get_stack
    stack = get_stack("megatron-core")
    layers = list(mixtral.layers)
    one = model_state_bytes(layers, 1, 8, zero, stack, ep=1)
    eight = model_state_bytes(layers, 1, 8, zero, stack, ep=8)
    expert = experts.expert_params(layers, 1)
    saved = expert * (1 - 1 / 8)
    # Unsharded components shrink by the experts' 7/8; ZeRO-sharded ones are the same
    # (experts / ep over dp / ep ranks = experts / dp); ZeRO-3's working set (one gather's
    # whole gradient) follows the gathered unit, which holds 1/ep of the experts.
    working = 0.0
    if zero >= 3:
        from costmodel.memory import zero3_gathered_params
        working = (max(zero3_gathered_params(l, 1, 1, stack) for l in layers)
                   - max(zero3_gathered_params(l, 1, 8, stack) for l in layers)) * stack.gathered_weights_bytes_per_param
        assert working > 0
    assert one.gradients - eight.gradients == pytest.approx(
        saved * stack.gradient_bytes_per_param if zero < 2 else working)
    optim = stack.master_weights_bytes_per_param + stack.optimizer_bytes_per_param
    assert one.optimizer - eight.optimizer == pytest.approx(saved * optim if zero < 1 else 0)


def _plan(model, cluster, **kw):
    base = dict(tp=1, pp=4, dp=16, micro_batch=1, global_batch=256, schedule="1f1b", zero=1, recompute="selective")
    return autoplan.Plan.uniform(model, cluster, **{**base, **kw})


def test_expert_parallel_estimate(mixtral, dgx8):
    no_ep = autoplan.estimate(mixtral, dgx8, _plan(mixtral, dgx8), stack="megatron-core")
    ep8 = autoplan.estimate(mixtral, dgx8, _plan(mixtral, dgx8, ep=8), stack="megatron-core")
    assert no_ep.breakdown["ep_communication"] == 0 < ep8.breakdown["ep_communication"]
    assert ep8.peak_memory_bytes < no_ep.peak_memory_bytes
    # Balanced routing stated: no imbalance, so only the all-to-all separates the two.
    even = autoplan.estimate(mixtral, dgx8, _plan(mixtral, dgx8, ep=8), stack="megatron-core", expert_load=1.0)
    assert even.iteration_time_s < ep8.iteration_time_s
    assert even.breakdown["compute"] == pytest.approx(no_ep.breakdown["compute"], rel=0.05)


def test_expert_groups_inside_a_node_communicate_faster(mixtral, dgx8):
    """tp=1: 8 consecutive replicas are one node (NVLink); tp=2: they span two nodes (NIC)."""
    inside = autoplan.estimate(mixtral, dgx8, _plan(mixtral, dgx8, ep=8), stack="megatron-core")
    across = autoplan.estimate(mixtral, dgx8, _plan(mixtral, dgx8, tp=2, dp=8, ep=8, sequence_parallel=True),
                               stack="megatron-core")
    per_layer = lambda e: e.breakdown["ep_communication"]  # noqa: E731
    assert per_layer(across) > 3 * per_layer(inside)


def test_capacity_factor_costs_compute_and_memory(dgx8):
    dropless = autoplan.models.get("mixtral-8x7b", layers=8)
    padded = autoplan.models.get("mixtral-8x7b", layers=8, capacity_factor=2.0)
    plan = dict(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8, zero=3, ep=8)
    a = autoplan.estimate(dropless, dgx8, autoplan.Plan.uniform(dropless, dgx8, **plan), stack="megatron-core",
                          expert_load=1.0)
    b = autoplan.estimate(padded, dgx8, autoplan.Plan.uniform(padded, dgx8, **plan), stack="megatron-core")
    assert b.iteration_time_s > a.iteration_time_s
    assert b.memory_by_group[0].activations > a.memory_by_group[0].activations
    assert b.mfu < a.mfu   # model FLOPs are the active ones either way


def test_bad_expert_load_is_refused():
    with pytest.raises(autoplan.ConfigError) as e:
        EstimateOptions(expert_load=0.5)
    assert e.value.field == "expert_load"
