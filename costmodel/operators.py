"""Compute time of one operator under one layout on one device: measured per-operator
profiles when they cover it, otherwise the same roofline as :mod:`costmodel.compute`
(matmul shapes with wave quantization, fused-attention FLOPs, bandwidth-bound bytes,
kernel launches) applied to the operator's measured shard shapes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from autoplan.catalog import DeviceSpec
from autoplan.models.opmeasure import OpCost
from costmodel.compute import _gemms_time
from costmodel.efficiency import Efficiency, default_efficiency


@dataclass(frozen=True)
class OpTiming:
    """Seconds one operator takes for one micro-batch on one rank."""

    forward: float
    backward_input: float
    backward_weight: float
    source: str = "roofline"
    """'measured' (an operator profile of this device) or 'roofline'."""

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight


class OperatorProfileSource(Protocol):
    """Anything that times operators from measurements (see autoplan.profiler.operators)."""

    def op_timing(self, device: DeviceSpec, key: str, micro_batch: int) -> OpTiming | None: ...


def roofline_op_timing(device: DeviceSpec, eff: Efficiency, cost: OpCost, micro_batch: int,
                       dtype: str, attention: str = "flash2") -> OpTiming:
    """As :func:`costmodel.compute.roofline_timing`, for one operator; ``attention`` is the
    stack's fused attention kernel class."""
    b = micro_batch
    peak = device.peak(dtype)
    bw = device.memory_bandwidth * eff.memory
    causal = 0.5 if cost.causal else 1.0
    att_fwd, att_bwd = eff.attention(attention)

    def gemms(gs, select=lambda g: True):
        # (The layer roofline's GEMM time, unaligned weights at the device's unaligned rate included.)
        return _gemms_time(device, eff, gs, b, 1, dtype, select)

    fwd = (gemms(cost.gemms_fwd) + cost.attention_flops_fwd * b * causal / (peak * att_fwd)
           + cost.memory_bytes_fwd * b / bw + cost.kernels_fwd * eff.launch_s)
    weight = gemms(cost.gemms_bwd, lambda g: g.batch_dim == "k")
    data = (gemms(cost.gemms_bwd, lambda g: g.batch_dim != "k")
            + cost.attention_flops_bwd * b * causal / (peak * att_bwd)
            + cost.memory_bytes_bwd * b / bw + cost.kernels_bwd * eff.launch_s)
    return OpTiming(forward=fwd, backward_input=data, backward_weight=weight, source="roofline")


def op_timing(device: DeviceSpec, cost: OpCost, micro_batch: int, dtype: str,
              profiles: OperatorProfileSource | None = None, key: str = "", attention: str = "flash2",
              efficiency: Efficiency | None = None) -> OpTiming:
    """Measured timing when a profile covers this operator on this device, else the roofline
    at ``efficiency`` (the device family's defaults when None: operator profiles fit none)."""
    if profiles is not None and key:
        measured = profiles.op_timing(device, key, micro_batch)
        if measured is not None:
            return measured
    return roofline_op_timing(device, efficiency or default_efficiency(device.name), cost, micro_batch, dtype,
                              attention)
