"""Context parallelism: what a layer costs one rank when ``cp`` ranks split every sequence.

* **Work** (:func:`context_shard`): every token-wise quantity of a layer (matmul rows,
  bandwidth-bound bytes, saved activations, the output a pipeline send carries) is
  divided by ``cp``. Attention is too: the runtime and Megatron-Core split the sequence
  zig-zag (rank r holds chunks r and 2cp-1-r of 2cp), which gives every rank the same
  share of the causal triangle, and the head scatter (a2a) gives each rank whole
  sequences for 1/cp of the heads. Parameters are not split.
* **Exchange** (:func:`exchange_times`), per layer with attention and micro-batch:

  - ``p2p``: cp-1 ring steps; each passes one rank's key/value chunk to the next rank
    while the attention block of the chunk at hand is computed (Megatron-Core,
    torchtitan and this project's runtime overlap them), so only the part of a transfer
    longer than 1/cp of the attention is exposed. Backward passes key/values and their
    gradients (twice the bytes) per step, and the last gradient hop is exposed.
  - ``all_gather``: one all-gather of every rank's key/values, overlapped with the
    local block (the first of cp); backward gathers again and reduce-scatters the
    key/value gradients, which nothing hides.
  - ``a2a`` (DeepSpeed-Ulysses): all-to-alls of q, k, v before attention and of the
    output after it (the reverse in backward), on the critical path.

  Transfers are priced by :mod:`costmodel.comm` over the actual context-parallel ranks,
  so a ring that leaves the node pays the network.
* **Memory** (:func:`exchange_buffer_bytes`): the buffers the exchange holds while one
  attention runs (two chunks for the ring, the gathered key/values, the head-layout
  copies of q/k/v/output), on top of the divided activations.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Sequence

from autoplan.catalog import DeviceSpec
from autoplan.cluster import Cluster
from autoplan.models.spec import Gemm, LayerSpec, ModelSpec
from autoplan.plan import CP_COMMS
from costmodel.comm import collective_time, p2p_time
from costmodel.efficiency import Efficiency, default_efficiency


@lru_cache(maxsize=4096)
def context_shard(layer: LayerSpec, cp: int) -> LayerSpec:
    """The work one of ``cp`` context-parallel ranks does for ``layer`` (see the module
    docstring): every quantity that grows with the tokens is divided by ``cp``."""
    if cp == 1:
        return layer
    k = 1.0 / cp

    def gemm(g: Gemm) -> Gemm:
        # The dimension that grows with the micro-batch is the token dimension of a linear
        # (rows m, or the reduction k of a weight gradient); for batched attention products
        # it is the batch x heads count, and dividing it divides their FLOPs the same way.
        return dataclasses.replace(g, **{g.batch_dim: getattr(g, g.batch_dim) * k})

    acts = layer.activation_bytes
    routed = layer.experts
    if routed is not None:   # a rank routes only its own tokens
        routed = dataclasses.replace(routed, activation_bytes=routed.activation_bytes.scaled(k),
                                     dispatch_bytes=routed.dispatch_bytes * k)
    return dataclasses.replace(
        layer, experts=routed,
        flops_fwd=layer.flops_fwd.scaled(k), flops_bwd=layer.flops_bwd.scaled(k),
        gemms_fwd=tuple(gemm(g) for g in layer.gemms_fwd), gemms_bwd=tuple(gemm(g) for g in layer.gemms_bwd),
        attention_flops_fwd=layer.attention_flops_fwd.scaled(k),
        attention_flops_bwd=layer.attention_flops_bwd.scaled(k),
        memory_bytes_fwd=layer.memory_bytes_fwd.scaled(k), memory_bytes_bwd=layer.memory_bytes_bwd.scaled(k),
        core_memory_bytes_fwd=layer.core_memory_bytes_fwd.scaled(k),
        activation_bytes=dataclasses.replace(acts, none=acts.none.scaled(k), selective=acts.selective.scaled(k),
                                             full=acts.full.scaled(k)),
        output_bytes=layer.output_bytes * k)


def has_attention(layer: LayerSpec) -> bool:
    """Whether the layer mixes tokens (fused attention, or explicit attention products)."""
    return layer.attention_flops_fwd.total > 0 or any(g.in_core for g in layer.gemms_fwd)


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    """Bytes one context-parallel rank holds of one layer's attention tensors, for one
    micro-batch (its 1/cp of the sequence, its tensor-parallel share of the heads)."""

    q: float
    """Queries (the output has the same size)."""
    kv: float
    """Keys and values together."""

    @classmethod
    def of(cls, micro_batch: int, seq_len: int, cp: int, heads: int, kv_heads: int, head_dim: int,
           tp: int, dtype_bytes: float) -> "AttentionShapes":
        tokens = micro_batch * seq_len / cp
        local_heads = heads / tp
        local_kv = max(kv_heads / tp, 1.0)   # tp beyond the kv heads replicates one per rank
        return cls(q=tokens * local_heads * head_dim * dtype_bytes, kv=2 * tokens * local_kv * head_dim * dtype_bytes)


def head_dim(model: ModelSpec) -> int:
    """Width of one attention head of ``model``."""
    return getattr(model.config, "head_dim", None) or model.hidden // max(model.heads, 1)


def attention_seconds(device: DeviceSpec, eff: Efficiency, layer: LayerSpec, micro_batch: int, tp: int,
                      dtype: str, kernel: str = "flash2") -> tuple[float, float]:
    """(forward, backward) seconds of the fused attention kernels (the stack's ``kernel``) of
    ``layer`` (already divided by cp) at the roofline: the compute a ring step can hide a
    transfer behind."""
    frac = (0.5 if layer.causal else 1.0) * layer.attention_fraction
    peak = device.peak(dtype)
    att_fwd, att_bwd = eff.attention(kernel)
    fwd = layer.attention_flops_fwd.at(tp) * micro_batch * frac / (peak * att_fwd)
    bwd = layer.attention_flops_bwd.at(tp) * micro_batch * frac / (peak * att_bwd)
    return fwd, bwd


def _ring_hop(cluster: Cluster, cp_groups: Sequence[Sequence[int]], nbytes: float) -> float:
    """Seconds for every rank of every ring to pass ``nbytes`` to its neighbour at once:
    the slowest neighbour link of any ring bounds the step."""
    worst = 0.0
    for ring in cp_groups:
        n = len(ring)
        for i in range(n):
            a, b = ring[i], ring[(i + 1) % n]
            worst = max(worst, p2p_time(cluster, [(a,)], [(b,)], nbytes))
    return worst


def _collective(cluster: Cluster, cp_groups: Sequence[Sequence[int]], nbytes: float, kind: str) -> float:
    return max((collective_time(cluster, g, nbytes, kind) for g in cp_groups), default=0.0)


def exchange_times(cluster: Cluster, cp_groups: Sequence[Sequence[int]], cp_comm: str, shapes: AttentionShapes,
                   attention_fwd_s: float, attention_bwd_s: float, overlap: bool = True) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one attention layer's context-parallel
    exchange for one micro-batch. ``attention_*_s`` is the rank's attention compute,
    which ring steps overlap when ``overlap`` (the training stack does it)."""
    cp = len(cp_groups[0]) if cp_groups else 1
    if cp <= 1:
        return 0.0, 0.0
    if cp_comm == "p2p":
        step_f = attention_fwd_s / cp if overlap else 0.0
        step_b = attention_bwd_s / cp if overlap else 0.0
        hop_f = _ring_hop(cluster, cp_groups, shapes.kv)
        hop_b = _ring_hop(cluster, cp_groups, 2 * shapes.kv)   # key/values and their gradients
        fwd = (cp - 1) * max(0.0, hop_f - step_f)
        bwd = (cp - 1) * max(0.0, hop_b - step_b) + _ring_hop(cluster, cp_groups, shapes.kv)
        return fwd, bwd
    if cp_comm == "all_gather":
        gather = _collective(cluster, cp_groups, cp * shapes.kv, "all_gather")
        scatter = _collective(cluster, cp_groups, cp * shapes.kv, "reduce_scatter")
        first_f = attention_fwd_s / cp if overlap else 0.0
        first_b = attention_bwd_s / cp if overlap else 0.0
        return max(0.0, gather - first_f), max(0.0, gather - first_b) + scatter
    if cp_comm == "a2a":
        # Forward: q, k, v to head shards, the output back; backward: the reverse.
        per_pass = (2 * _collective(cluster, cp_groups, shapes.q, "all_to_all")
                    + 2 * _collective(cluster, cp_groups, shapes.kv / 2, "all_to_all"))
        return per_pass, per_pass
    raise ValueError(f"unknown context-parallel exchange {cp_comm!r}; expected one of {CP_COMMS}")


def exchange_buffer_bytes(cp: int, cp_comm: str, shapes: AttentionShapes) -> float:
    """Bytes the exchange holds while one attention layer runs on one rank."""
    if cp <= 1:
        return 0.0
    if cp_comm == "p2p":
        return 2 * shapes.kv            # the chunk being sent and the one arriving
    if cp_comm == "all_gather":
        return cp * shapes.kv           # every rank's key/values
    return 2 * shapes.q + shapes.kv     # head-layout copies of q, k, v and the output


def stage_exchange(cluster: Cluster, cp_groups: Sequence[Sequence[int]], cp_comm: str, model: ModelSpec,
                   layers: Sequence[LayerSpec], devices: Sequence[DeviceSpec], micro_batch: int, tp: int,
                   dtype: str, dtype_bytes: float, overlap: bool = True,
                   kernel: str = "flash2") -> tuple[float, float, float]:
    """(forward seconds, backward seconds, buffer bytes) of the context-parallel exchange of
    a stage's ``layers`` (already divided by cp) for one micro-batch on the slowest of
    ``devices``. A stage without attention layers exchanges nothing."""
    cp = len(cp_groups[0]) if cp_groups else 1
    attention = [l for l in layers if has_attention(l)]
    if cp <= 1 or not attention:
        return 0.0, 0.0, 0.0
    shapes = AttentionShapes.of(micro_batch, model.seq_len, cp, model.heads, model.kv_heads or model.heads,
                                head_dim(model), tp, dtype_bytes)
    fwd = bwd = 0.0
    for layer in attention:
        # The slowest device computes longest and so hides the most; a group runs at the pace
        # of the slowest anyway, so take the fastest attention as the overlap it can count on.
        att_f, att_b = min(attention_seconds(d, default_efficiency(d.name), layer, micro_batch, tp, dtype, kernel)
                           for d in devices)
        f, b = exchange_times(cluster, cp_groups, cp_comm, shapes, att_f, att_b, overlap)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd, exchange_buffer_bytes(cp, cp_comm, shapes)
