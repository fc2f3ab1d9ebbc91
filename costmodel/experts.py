"""Costs of routed experts (mixture of experts) under expert parallelism.

A ModelSpec measures an expert unit at balanced load: every expert gets tokens x top_k /
num_experts token slots (``ExpertSpec``), so its FLOPs are the active-parameter FLOPs. A
plan changes that in four ways, computed here from plain arguments:

* **load** (:func:`expert_load`): the busiest expert-parallel rank's tokens over the
  balanced share. With a capacity factor every slot is computed and sent, full or not, so
  the load is the capacity factor. Dropless routing sends what the router chose; a stated
  (e.g. measured) load is used when given, else the expected maximum over the ``ep`` ranks
  under uniform, independent routing (a floor: trained routers are less even);
* **expert GEMMs at their real token counts**: a rank holds num_experts / ep experts,
  each receiving its tokens from all ep ranks, times the load
  (``Gemm.shape(micro_batch, tp, ep, load)``, timed by ``costmodel.compute``);
* **dispatch and combine** (:func:`dispatch_time`): two all-to-alls of the routed token
  copies per expert unit in forward and two in backward, on the links each pair of ranks
  crosses (``costmodel.comm``), on the critical path;
* **memory**: expert weights, gradients and optimizer states divided by ep, with ZeRO
  sharding them over the dp / ep ranks that hold the same experts (:func:`state_params`);
  the experts' saved activations grow with the load (:func:`activation_bytes`); the
  all-to-all's send and receive buffers are a transient of the unit's backward
  (:func:`transient_bytes`); expert gradients are reduced over the expert-data-parallel
  groups only (:func:`grad_reduce_time`).
"""
from __future__ import annotations

import math
from typing import Sequence

from autoplan.cluster import Cluster
from autoplan.models.spec import ExpertSpec, LayerSpec
from costmodel.comm import collective_time


def expert_load(experts: ExpertSpec | None, ep: int, tokens: float, stated: float | None = None) -> float:
    """The busiest expert-parallel rank's routed tokens over the balanced share, for a
    micro-batch of ``tokens`` tokens per rank (see the module docstring)."""
    if experts is None:
        return 1.0
    if stated is not None:
        return stated
    if experts.capacity_factor is not None:
        return experts.capacity_factor
    if ep <= 1 or tokens <= 0:
        return 1.0
    # A rank receives Binomial(ep * tokens * top_k, 1 / ep) token copies: mean tokens * top_k,
    # and the largest of ep such counts lies about sqrt(2 ln ep) deviations above it.
    mean = tokens * experts.top_k
    return 1.0 + math.sqrt(2.0 * math.log(ep) * (1.0 - 1.0 / ep) * mean) / mean


def expert_params(layers: Sequence[LayerSpec], tp: int) -> float:
    """Routed-expert parameters of ``layers`` on one tensor-parallel rank, before expert
    parallelism divides them."""
    return sum(l.experts.params.at(tp) for l in layers if l.experts is not None)


def state_params(layers: Sequence[LayerSpec], tp: int, ep: int) -> tuple[float, float]:
    """(parameters a rank holds, parameters ZeRO divides by the data-parallel degree).

    A rank holds the dense parameters and 1/ep of the experts. ZeRO shards the dense ones
    over dp ranks and the experts over the dp / ep ranks holding the same ones, so a ZeRO
    shard is (dense + experts / ep) / ... = (dense + experts) / dp: the second figure over dp."""
    total = sum(l.params.at(tp) for l in layers)
    experts = expert_params(layers, tp)
    return total - experts + experts / ep, total


def dispatch_bytes(layer: LayerSpec, micro_batch: int, load: float) -> float:
    """Bytes one rank sends and receives in one dispatch or combine of ``layer``."""
    return 0.0 if layer.experts is None else micro_batch * layer.experts.dispatch_bytes * load


def dispatch_time(cluster: Cluster, ep_groups: Sequence[Sequence[int]], layer: LayerSpec, micro_batch: int,
                  load: float) -> float:
    """Seconds of one all-to-all (dispatch or combine) of ``layer``'s routed tokens: the
    slowest of the expert-parallel groups (one per tensor shard and data replica set)."""
    nbytes = dispatch_bytes(layer, micro_batch, load)
    if nbytes <= 0:
        return 0.0
    return max((collective_time(cluster, g, nbytes, "all_to_all") for g in ep_groups if len(g) > 1), default=0.0)


def activation_bytes(layer: LayerSpec, recompute: str, tp: int, sequence_parallel: bool, load: float) -> float:
    """Per-sample change to ``layer``'s measured activations: the routed experts' saved
    tensors scale with the load, and under sequence parallelism they are not divided by tp
    (the experts see the gathered tokens, not a sequence shard, though the spec's
    replicated activations are otherwise sequence-sharded)."""
    if layer.experts is None or recompute == "full":
        return 0.0
    e = layer.experts.activation_bytes
    return e.at(tp) * load - e.at(tp, sequence_parallel)


def transient_bytes(layer: LayerSpec, micro_batch: int, ep: int, load: float) -> float:
    """The routed tokens' gradients while the unit's backward runs, and with expert
    parallelism the all-to-all's second buffer beside them."""
    return dispatch_bytes(layer, micro_batch, load) * (2 if ep > 1 else 1)


def grad_reduce_time(cluster: Cluster, dp_groups: Sequence[Sequence[int]], expert_dp_groups: Sequence[Sequence[int]],
                     dense_bytes: float, expert_bytes: float, kind: str) -> float:
    """Data-parallel gradient reduction: dense gradients over the dp groups, expert gradients
    over the groups holding the same experts, one after the other on the same stream."""
    def worst(groups, nbytes):
        return max((collective_time(cluster, g, nbytes, kind) for g in groups), default=0.0)
    return worst(dp_groups, dense_bytes) + (worst(expert_dp_groups, expert_bytes) if expert_bytes > 0 else 0.0)
