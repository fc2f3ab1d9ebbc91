"""Communication time: alpha-beta costs of collectives and point-to-point transfers over
the actual ranks of a group.

A ring visits every member once, so it runs at the slowest link it crosses; a group
that spans nodes moves its bytes hierarchically (reduce-scatter inside each node, the
network phase among nodes on 1/k of the data per GPU, all-gather inside the node), as
NCCL's tree/ring algorithms effectively do on rail-optimized clusters, and pays the
latency of the algorithm NCCL runs (``collective_latency``). An all-to-all
(mixture-of-experts dispatch) sends each peer its share over the link between the two.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from autoplan.cluster import Cluster
from costmodel.efficiency import default_efficiency

# Fraction of the transferred data each primitive moves per rank, relative to
# an all-reduce's 2(n-1)/n (all-gather and reduce-scatter are half of it).
_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def _net_eff(cluster: Cluster, ranks: Sequence[int]) -> float:
    if len(cluster.groups) == 1:   # one device type: no need to visit every rank
        return default_efficiency(cluster.groups[0].device.name).network
    return min(default_efficiency(cluster.slots[r].device.name).network for r in ranks)


def collective_time(cluster: Cluster, ranks: Sequence[int], nbytes: float, kind: str = "all_reduce") -> float:
    """Seconds for a collective of ``nbytes`` (the full tensor size) over ``ranks``."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = _FACTOR[kind]
    eff = _net_eff(cluster, ranks)
    per_node = Counter(cluster.slots[r].node for r in ranks)
    nodes = len(per_node)
    if kind == "all_to_all":
        return _all_to_all_time(cluster, ranks, nbytes, eff, per_node)
    link, intra = _links(cluster, ranks, per_node)
    if nodes == 1:
        moved = factor * (n - 1) / n * nbytes / (link.bandwidth * eff)
    else:
        # Hierarchical: k GPUs per node (the smallest share bounds the network phase).
        k = min(per_node.values())
        moved = factor * (nodes - 1) / nodes * (nbytes / k) / (link.bandwidth * eff)
        if k > 1:
            moved += factor * (k - 1) / k * nbytes / (intra.bandwidth * eff)
    return moved + _latency(n, per_node, link, intra, kind)


def collective_latency(cluster: Cluster, ranks: Sequence[int], kind: str) -> float:
    """Seconds a collective over ``ranks`` costs whatever its size (``collective_time`` of a
    vanishing message): what each further collective of a split transfer adds."""
    if len(ranks) <= 1:
        return 0.0
    per_node = Counter(cluster.slots[r].node for r in ranks)
    return _latency(len(ranks), per_node, *_links(cluster, ranks, per_node), kind)


def _links(cluster: Cluster, ranks: Sequence[int], per_node: Counter):
    """(the slowest link between the group's nodes, or inside its one node; the slowest link
    inside a node where the group has more ranks than nodes, else None)."""
    if len(per_node) == 1:
        return cluster.slowest_link(ranks), None
    nodes_ranks = {}
    for r in ranks:
        nodes_ranks.setdefault(cluster.slots[r].node, r)
    inter = cluster.slowest_link(list(nodes_ranks.values()))
    intra = None
    if len(ranks) > len(per_node):
        intra = min((cluster.groups[cluster.slots[r].group].intra_node for r in ranks), key=lambda l: l.bandwidth)
    return inter, intra


def _latency(n: int, per_node: Counter, link, intra, kind: str) -> float:
    """The size-independent part of a collective over ``n`` ranks (``per_node`` of them on each
    node; ``link``, ``intra`` as ``_links`` gives them). Inside one node, a ring's n - 1
    steps. NCCL runs all-gather and reduce-scatter as one ring through every rank, whose
    n - 1 steps cross the network nodes - 1 times and stay inside a node the other times
    (src/graph/tuning.cc: nsteps - nInterSteps intra-node latencies plus nInterSteps network
    ones); an all-reduce across nodes goes by tree or a ring per node, latency growing with
    the nodes and the GPUs of one node."""
    nodes = len(per_node)
    if nodes == 1:
        return _FACTOR[kind] * (n - 1) * link.latency
    if kind in ("all_gather", "reduce_scatter"):
        return (n - nodes) * (intra.latency if intra else 0.0) + (nodes - 1) * link.latency
    k = min(per_node.values())
    return _FACTOR[kind] * ((nodes - 1) * link.latency + ((k - 1) * intra.latency if k > 1 else 0.0))


def _all_to_all_time(cluster: Cluster, ranks: Sequence[int], nbytes: float, eff: float,
                     per_node: Counter) -> float:
    """Every rank sends nbytes / n to each other member: to the peers on its own node over
    the intra-node link, to the rest through its NIC at the bandwidth of each destination's
    link, both at once (NVLink and the network are separate paths). The slowest rank bounds
    the exchange. Ranks of one node group on one node cost the same, so one of each is timed."""
    n = len(ranks)
    share = nbytes / n
    rep: dict[int, int] = {}
    for r in ranks:
        rep.setdefault(cluster.slots[r].node, r)
    worst = 0.0
    timed: set[tuple[int, int]] = set()
    for r in ranks:
        slot = cluster.slots[r]
        if (slot.node, slot.group) in timed:
            continue
        timed.add((slot.node, slot.group))
        local = per_node[slot.node] - 1
        t_local = t_remote = 0.0
        if local:
            link = cluster.groups[slot.group].intra_node
            t_local = local * (link.latency + share / (link.bandwidth * eff))
        for node, count in per_node.items():
            if node != slot.node:
                link = cluster.link(r, rep[node])
                t_remote += count * (link.latency + share / (link.bandwidth * eff))
        worst = max(worst, t_local, t_remote)
    return worst


def p2p_time(cluster: Cluster, src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]],
             nbytes: float, split: bool = True) -> float:
    """Seconds to pass one micro-batch's activation (``nbytes`` per data-parallel replica)
    from one pipeline group to the next. ``src``/``dst`` list each replica's
    tensor-parallel ranks. Each replica sends its own micro-batch, and within a replica
    each tensor-parallel rank sends to its counterpart in parallel: 1/t of it (``split``:
    a sequence shard, or Megatron's scatter/gather) or the whole of it; the slowest pair
    link bounds the transfer."""
    if nbytes <= 0:
        return 0.0
    worst = 0.0
    # A pair's time depends only on its link class and the two devices: (same node, node
    # group of each end) and the share. Large groups repeat a few classes thousands of times.
    slots = cluster.slots
    seen: set = set()
    for s_ranks, d_ranks in zip(src, dst):
        width = min(len(s_ranks), len(d_ranks))
        share = nbytes / width if split else nbytes
        for i in range(width):
            a, b = s_ranks[i], d_ranks[i]
            if a == b:
                continue
            sa, sb = slots[a], slots[b]
            key = (sa.node == sb.node, sa.group, sb.group, width)
            if key in seen:
                continue
            seen.add(key)
            link = cluster.link(a, b)
            eff = _net_eff(cluster, (a, b))
            worst = max(worst, link.latency + share / (link.bandwidth * eff))
    return worst


def zero3_collectives(layers: Sequence, stack) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of ``layers`` in one ZeRO-3 gather pass and one
    gradient reduction: one each per unit, or, where the stack gathers per sub-module
    (``Stack.zero3_gather_unit``), one all-gather per weight matrix (its small tensors stay
    whole on every rank) and one reduce-scatter per parameter tensor."""
    if stack.zero3_gather_unit == "module":
        return (sum(layer.weight_tensors() for layer in layers), sum(layer.parameter_tensors() for layer in layers))
    return len(layers), len(layers)


def zero3_gather_passes(stack, recompute: str) -> int:
    """Times a micro-batch gathers every ZeRO-3 parameter: for its forward and its backward,
    and once more for a fully recomputed forward where the stack releases a sub-module's
    parameters after each of its forwards (``Stack.zero3_gather_unit``)."""
    return 3 if stack.zero3_gather_unit == "module" and recompute == "full" else 2


def zero3_rank_overhead(stack, device) -> float:
    """Seconds each ZeRO-3 collective costs per member of its group in the stack's own code
    (``Stack.zero3_host_s_per_rank``, ``Stack.zero3_kernels_per_rank``)."""
    return stack.zero3_host_s_per_rank + stack.zero3_kernels_per_rank * default_efficiency(device.name).launch_s
