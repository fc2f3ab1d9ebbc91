"""Compute time of one layer on one device: from a measured profile when there is one,
otherwise a roofline over the layer's measured matmul shapes, fused-attention FLOPs and
bandwidth-bound bytes, with shape-dependent efficiency (wave quantization, short
reductions) from :mod:`costmodel.efficiency`."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

from autoplan.catalog import DeviceSpec
from autoplan.models.spec import Gemm, LayerSpec
from autoplan.units import DTYPE_BYTES
from costmodel.efficiency import Efficiency, default_efficiency


@dataclass(frozen=True)
class LayerTiming:
    """Seconds one layer takes for one micro-batch on one tensor-parallel rank
    (tensor-parallel communication excluded; the stage model adds it)."""

    forward: float
    backward: float
    """Full backward (input + weight gradients)."""
    backward_input: float
    """Input-gradient part of the backward (zero-bubble's I)."""
    backward_weight: float
    """Weight-gradient part (zero-bubble's W)."""
    recompute_selective: float
    """Extra backward time when the attention core is recomputed."""
    recompute_early_stop: float | None = None
    """Extra backward time when a checkpoint that stops early recomputes the whole layer
    (``LayerSpec.recompute_prefix``); None: not known, the forward's time."""
    source: str = "roofline"
    """'measured' (a profile of this device) or 'roofline' (catalog peaks x efficiency)."""
    forward_host_wait: float = 0.0
    """The part of ``forward`` the device waits on a host slower than its kernels (the
    stack's ``forward_host_s_per_kernel``): the host issues the layer's tensor-parallel
    collectives too and goes on while they run, so they fill this wait before they add
    time (``hidden_tp_forward``)."""


def hidden_tp_forward(comm: float, host_wait: float) -> float:
    """Seconds of a layer's forward tensor-parallel communication ``comm`` that add to its
    forward: what the device's wait on the host (``LayerTiming.forward_host_wait``) does
    not already cover."""
    return max(0.0, comm - host_wait)


class ProfileSource(Protocol):
    """Anything that can time a layer from measurements (see autoplan.profiler.ProfileStore)."""

    def layer_timing(self, device: DeviceSpec, layer: LayerSpec, micro_batch: int, tp: int,
                     sequence_parallel: bool, dtype: str) -> LayerTiming | None: ...

    def efficiency(self, device: DeviceSpec) -> Efficiency | None: ...


def gemm_time(device: DeviceSpec, eff: Efficiency, m: float, n: float, k: float, count: float,
              dtype: str, aligned: bool = True) -> float:
    """Seconds for ``count`` GEMMs of (m x k) @ (k x n).

    Output tiles of ``eff.tile`` x ``eff.tile`` are spread over the device's SMs in waves;
    partial edge tiles and a part-filled last wave idle SMs. When there are fewer output
    tiles than SMs and the reduction is long, the library splits it (cuBLAS split-K /
    stream-K): ``split`` slices of at least ``eff.split_k_min`` each run on otherwise idle
    SMs and their partial sums are added (the extra traffic counted in the memory term).
    Each tile's (or slice's) short-reduction loss is k / (k + k_half). The kernel takes the
    longer of its compute and its memory traffic. Without 16-byte aligned rows (``aligned``
    False) the library's fallback kernels run at ``eff.unaligned_matmul`` of the aligned rate,
    measured flat in the shape."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    flops = 2.0 * m * n * k * count
    util, split = 1.0, 1.0
    fallback = not aligned and eff.unaligned_matmul < 1.0
    if fallback:
        util = eff.unaligned_matmul
    elif device.compute_units and eff.tile > 1:
        tm, tn = math.ceil(m / eff.tile), math.ceil(n / eff.tile)
        tiles = tm * tn * math.ceil(count)
        if tiles < device.compute_units and eff.split_k_min > 0:
            split = float(max(1, min(device.compute_units // tiles, math.ceil(k / eff.split_k_min))))
        work = tiles * split
        waves = math.ceil(work / device.compute_units)
        util = (work / (waves * device.compute_units)) * (m * n) / (tm * tn * eff.tile ** 2)
    k_slice = k / split
    k_eff = 1.0 if fallback else k_slice / (k_slice + eff.k_half)
    t_compute = flops / (device.peak(dtype) * eff.matmul * util * k_eff)
    elem = DTYPE_BYTES[dtype]
    out = 2 if dtype == "fp8" else elem   # (fp8 GEMMs write their output in bf16)
    traffic = (m * k + k * n) * elem + m * n * out + (split - 1) * m * n * 4 * 2   # fp32 partials written and read
    t_memory = traffic * count / (device.memory_bandwidth * eff.memory)
    return max(t_compute, t_memory)


ALIGNMENT_BYTES = 16
"""Row alignment the GEMM libraries' fast kernels load with (cuBLAS, CUTLASS: 128-bit loads)."""


def _rows(g: Gemm, shape: tuple[float, float, float, float]) -> tuple[float, ...]:
    """The row lengths a GEMM loads, in elements: a linear layer's two weight dimensions (the
    token dimension is never a row length); all three of an attention's batched product,
    each of which is the row length of one of its operands as stored (queries, keys, values
    and their gradients are rows of the head size, scores rows of the sequence length). A
    head size that is not a multiple of 8 in a 2-byte type also misaligns each head's base
    address in the [sequence, batch x heads, head size] layout Megatron's batched products
    read."""
    m, n, k, _ = shape
    if g.batch_dim == "count":
        return m, n, k
    return (n, k) if g.batch_dim == "m" else (m, n)


def _aligned(g: Gemm, shape: tuple[float, float, float, float], dtype: str) -> bool:
    """Whether every row the GEMM loads on this rank (:func:`_rows`) is a whole multiple of
    16 bytes."""
    elements = ALIGNMENT_BYTES / DTYPE_BYTES[dtype]
    return all(float(d) % elements == 0 for d in _rows(g, shape))


@lru_cache(maxsize=4096)   # a uniform stack asks for the same block at every layer
def unaligned_rows(layer: LayerSpec, tp: int, dtype: str, fp8_cast: tuple | None = None) -> tuple[float, ...]:
    """The row lengths (elements, on one rank of ``tp``) of ``layer``'s GEMMs that are not
    whole multiples of 16 bytes (:func:`_aligned`), distinct and sorted: where the library's
    fallback kernels run."""
    fp8 = _fp8_layer(layer, fp8_cast)
    rows: set[float] = set()
    for g in layer.gemms_fwd + layer.gemms_bwd:
        elements = ALIGNMENT_BYTES / DTYPE_BYTES["fp8" if fp8 and _fp8_gemm(g) else dtype]
        rows.update(d for d in _rows(g, g.shape(1, tp)) if float(d) % elements)
    return tuple(sorted(rows))


def _gemms_time(device, eff, gemms: tuple[Gemm, ...], micro_batch: int, tp: int, dtype: str,
                select=lambda g: True, ep: int = 1, load: float = 1.0, fp8: bool = False) -> float:
    """Seconds of the selected GEMMs; with ``fp8``, those of linear layers (see
    :func:`_fp8_gemm`) at the device's fp8 rate and the others in ``dtype``."""
    total = 0.0
    for g in gemms:
        if select(g):
            shape = g.shape(micro_batch, tp, ep, load)
            kind = "fp8" if fp8 and _fp8_gemm(g) else dtype
            total += gemm_time(device, eff, *shape, kind, _aligned(g, shape, kind))
    return total


def _fp8_layer(layer: LayerSpec, fp8_cast: tuple | None) -> bool:
    """Whether ``layer``'s linears run in fp8: a transformer block of a stack with fp8 linears
    (the LM head stays in the plan's dtype: torchtitan's float8 converter and Megatron's
    output layer leave it out)."""
    return fp8_cast is not None and layer.kind == "block"


def _fp8_gemm(g: Gemm) -> bool:
    """A linear layer's GEMM, the kind fp8 training converts (Float8Linear, TE's Linear):
    not attention's batched products, not a grouped expert matmul."""
    return g.batch_dim != "count" and not g.expert


def _fp8_casts(layer: LayerSpec, micro_batch: int, tp: int, fp8_cast: tuple) -> tuple[float, float, float, float]:
    """(forward bytes, backward bytes, forward kernels, backward kernels) of the casts the fp8
    linears add: each one's input and weight before its forward GEMM, its output gradient
    before its backward GEMMs (``Stack.fp8_cast``)."""
    per_activation, per_weight, kernels_activation, kernels_weight = fp8_cast
    fwd = bwd = 0.0
    linears = 0
    for g in layer.gemms_fwd:
        if _fp8_gemm(g):
            m, n, k, count = g.shape(micro_batch, tp)
            fwd += (m * k * per_activation + k * n * per_weight) * count
            bwd += m * n * per_activation * count
            linears += 1
    return fwd, bwd, linears * (kernels_activation + kernels_weight), linears * kernels_activation


def _weight_traffic(layer: LayerSpec, tp: int, ep: int, traffic: tuple | None) -> tuple[float, float, float]:
    """(activation traffic scale, forward bytes, backward bytes) a layer's stack adds to the
    zoo's measured traffic (``Stack.traffic``): the scale applies to the measured bytes, the
    bytes come from the weights this rank holds (its share of routed experts under ``ep``)."""
    if traffic is None:
        return 1.0, 0.0, 0.0
    scale, fwd_per_param, bwd_per_param = traffic
    if layer.kind == "embedding":
        return scale, 0.0, 0.0
    params = layer.params_at(tp)
    if layer.experts is not None and ep > 1:
        params -= layer.experts.params.at(tp) * (1 - 1 / ep)
    return scale, fwd_per_param * params, bwd_per_param * params


def _roofline_terms(device: DeviceSpec, eff: Efficiency, layer: LayerSpec, micro_batch: int, tp: int,
                    sequence_parallel: bool, dtype: str, attention: str, ep: int, load: float,
                    fp8_cast: tuple | None = None, traffic: tuple | None = None) -> tuple[float, ...]:
    """Seconds of one layer's roofline by kind of work: (GEMMs forward, weight-gradient GEMMs,
    input-gradient GEMMs, fused attention forward, backward, bandwidth-bound kernels forward,
    backward, launches forward, backward). ``fp8_cast``: the blocks' linears run in fp8
    (``Stack.fp8_cast``), their casts counted with the bandwidth-bound kernels; ``traffic``:
    the stack's own bandwidth-bound traffic (``Stack.traffic``), counted there too."""
    b, sp = micro_batch, sequence_parallel
    scale, weight_f, weight_b = _weight_traffic(layer, tp, ep, traffic)
    peak = device.peak(dtype)
    causal = (0.5 if layer.causal else 1.0) * layer.attention_fraction
    bw = device.memory_bandwidth * eff.memory
    att_fwd, att_bwd = eff.attention(attention)
    fp8 = _fp8_layer(layer, fp8_cast)
    cast_f, cast_b, kernels_f, kernels_b = _fp8_casts(layer, b, tp, fp8_cast) if fp8 else (0.0, 0.0, 0, 0)
    return (_gemms_time(device, eff, layer.gemms_fwd, b, tp, dtype, ep=ep, load=load, fp8=fp8),
            _gemms_time(device, eff, layer.gemms_bwd, b, tp, dtype, lambda g: g.batch_dim == "k", ep, load, fp8),
            _gemms_time(device, eff, layer.gemms_bwd, b, tp, dtype, lambda g: g.batch_dim != "k", ep, load, fp8),
            layer.attention_flops_fwd.at(tp) * b * causal / (peak * att_fwd),
            layer.attention_flops_bwd.at(tp) * b * causal / (peak * att_bwd),
            (layer.memory_bytes_fwd.at(tp, sp) * b * scale + cast_f + weight_f) / bw,
            (layer.memory_bytes_bwd.at(tp, sp) * b * scale + cast_b + weight_b) / bw,
            (layer.kernels_fwd + kernels_f) * eff.launch_s, (layer.kernels_bwd + kernels_b) * eff.launch_s)


@lru_cache(maxsize=65536)
def roofline_timing(device: DeviceSpec, eff: Efficiency, layer: LayerSpec, micro_batch: int, tp: int,
                    sequence_parallel: bool, dtype: str, attention: str = "flash2", ep: int = 1,
                    load: float = 1.0, fp8_cast: tuple | None = None, traffic: tuple | None = None) -> LayerTiming:
    """Roofline estimate of one layer (cached: the search asks for the same layer often).
    ``attention`` is the fused attention kernel class of the training stack; ``ep`` and
    ``load`` shape a mixture-of-experts unit's expert GEMMs (see ``Gemm.shape``);
    ``fp8_cast``: fp8 linears (``Stack.fp8_cast``); ``traffic``: the stack's own
    bandwidth-bound traffic (``Stack.traffic``)."""
    gemm_f, weight, data, attn_f, attn_b, mem_f, mem_b, launch_f, launch_b = _roofline_terms(
        device, eff, layer, micro_batch, tp, sequence_parallel, dtype, attention, ep, load, fp8_cast, traffic)
    fwd = gemm_f + attn_f + mem_f + launch_f
    other = attn_b + mem_b + launch_b
    bw = device.memory_bandwidth * eff.memory
    fp8 = _fp8_layer(layer, fp8_cast)
    scale = traffic[0] if traffic is not None else 1.0   # (the activation traffic scale)
    core = (_gemms_time(device, eff, layer.gemms_fwd, micro_batch, tp, dtype, lambda g: g.in_core, fp8=fp8) + attn_f
            + layer.core_memory_bytes_fwd.at(tp, sequence_parallel) * micro_batch * scale / bw)
    early, pre = None, layer.recompute_prefix
    if pre is not None:
        # What an early-stopping checkpoint re-runs (LayerSpec.recompute_prefix): the forward
        # less the GEMMs, bytes and kernels after the unit's last save (every cast of a
        # weight or fp8 input stays: each runs before the GEMM that saves it), plus the
        # checkpoint's own hooks, a pack and an unpack per saved tensor, each charged as a
        # launch (Python calls, like an op's dispatch).
        tail_bytes = (layer.memory_bytes_fwd.at(tp, sequence_parallel)
                      - pre.memory_bytes.at(tp, sequence_parallel)) * micro_batch * scale
        early = (_gemms_time(device, eff, layer.gemms_fwd[:pre.gemms], micro_batch, tp, dtype, ep=ep, load=load,
                             fp8=fp8)
                 + attn_f * pre.attention_share + mem_f - tail_bytes / bw
                 + launch_f + (2 * pre.saved_tensors - (layer.kernels_fwd - pre.kernels)) * eff.launch_s)
    return LayerTiming(forward=fwd, backward=weight + data + other, backward_input=data + other,
                       backward_weight=weight, recompute_selective=core, source="roofline",
                       recompute_early_stop=early)


def roofline_parts(device: DeviceSpec, eff: Efficiency, layer: LayerSpec, micro_batch: int, tp: int,
                   sequence_parallel: bool, dtype: str, attention: str = "flash2",
                   fp8_cast: tuple | None = None, traffic: tuple | None = None) -> dict[str, float]:
    """Seconds of one forward and backward of ``layer`` under :func:`roofline_timing`, by kind
    of work: 'gemm', 'attention' (fused attention FLOPs), 'bandwidth' (bandwidth-bound
    kernels, fp8 casts and the stack's own traffic included) and 'launch'; they add up to its
    forward + backward."""
    gemm_f, weight, data, attn_f, attn_b, mem_f, mem_b, launch_f, launch_b = _roofline_terms(
        device, eff, layer, micro_batch, tp, sequence_parallel, dtype, attention, 1, 1.0, fp8_cast, traffic)
    return {"gemm": gemm_f + weight + data, "attention": attn_f + attn_b, "bandwidth": mem_f + mem_b,
            "launch": launch_f + launch_b}


def layer_timing(device: DeviceSpec, layer: LayerSpec, micro_batch: int, tp: int, sequence_parallel: bool,
                 dtype: str, profiles: ProfileSource | None = None, attention: str = "flash2",
                 efficiency: Efficiency | None = None, ep: int = 1, load: float = 1.0,
                 forward_host_s_per_kernel: float = 0.0,
                 fp8_cast: tuple | None = None, traffic: tuple | None = None) -> LayerTiming:
    """Measured timing when a profile covers this device and layer, else the roofline with
    ``efficiency`` (a calibration's), efficiencies fitted from profiles of this device, or
    the device family's defaults, in that order. Profiles time expert units on one rank at
    balanced load, so with expert parallelism or another load the roofline times them.

    ``forward_host_s_per_kernel`` is the host's time to issue one forward kernel from the
    training stack's model code: a roofline forward that the GPU would finish sooner waits
    on the host (measured profiles already hold it), ``forward_host_wait`` says how long.
    ``fp8_cast``: the blocks' linears run in fp8 (``Stack.fp8_cast``); profiles measure the
    plan's dtype, so the roofline times the blocks then. ``traffic``: the stack's own
    bandwidth-bound traffic (``Stack.traffic``; a measured profile holds its runtime's)."""
    eff = efficiency
    if profiles is not None:
        if (layer.experts is None or (ep == 1 and load == 1.0)) and not _fp8_layer(layer, fp8_cast):
            measured = profiles.layer_timing(device, layer, micro_batch, tp, sequence_parallel, dtype)
            if measured is not None:
                return measured
        eff = eff or profiles.efficiency(device)
    timing = roofline_timing(device, eff or default_efficiency(device.name), layer, micro_batch, tp,
                             sequence_parallel, dtype, attention, ep, load, fp8_cast, traffic)
    host = layer.kernels_fwd * forward_host_s_per_kernel
    if host > timing.forward:
        timing = replace(timing, forward=host, forward_host_wait=host - timing.forward)
    return timing
