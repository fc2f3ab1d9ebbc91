"""Per-rank memory: model states (weights, gradients, optimizer) under ZeRO 0-3, and the
activation working set. Activations *in flight* come from the schedule simulation (how
many micro-batches each stage holds at once under the plan's schedule); this module
gives the bytes per micro-batch and the static part.

Mixed-precision Adam, as Megatron-LM and DeepSpeed train (Rajbhandari et al., ZeRO,
SC20, §3.1): 2-byte weights, fp32 gradient accumulation buffers (Megatron's
``accumulate_allreduce_grads_in_fp32``), and 12 bytes of optimizer state per parameter
(fp32 master copy, Adam first and second moments).
"""
from __future__ import annotations

from dataclasses import dataclass

from autoplan.models.spec import LayerSpec
from autoplan.units import DTYPE_BYTES, GiB

OPTIMIZER_BYTES_PER_PARAM = 12.0
"""fp32 master weights + Adam m + Adam v."""
GRAD_BYTES_PER_PARAM = 4.0
"""fp32 gradient accumulation buffer."""
FRAMEWORK_OVERHEAD_BYTES = 1.0 * GiB
"""CUDA context, cuBLAS/NCCL workspaces and communication buffers per GPU."""


def framework_overhead_bytes(device_name: str) -> float:
    """Fixed per-device memory outside the model: the CUDA/ROCm context and collective
    buffers on accelerators; none is counted on a CPU 'device'."""
    return 0.0 if device_name.upper().startswith("CPU") else FRAMEWORK_OVERHEAD_BYTES
FRAGMENTATION = 0.05
"""Share of dynamic memory lost to caching-allocator fragmentation."""


@dataclass(frozen=True)
class ModelStateBytes:
    """Static bytes on one rank."""

    weights: float
    gradients: float
    optimizer: float
    zero3_working: float
    """Full parameters of the layers being gathered under ZeRO-3 (current + prefetched)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.zero3_working


def model_state_bytes(layers: list[LayerSpec], tp: int, dp: int, zero: int, dtype: str) -> ModelStateBytes:
    """Weights, gradients and optimizer states of ``layers`` on one rank."""
    params = sum(l.params.at(tp) for l in layers)
    w = DTYPE_BYTES[dtype]
    weights = params * w / (dp if zero >= 3 else 1)
    grads = params * GRAD_BYTES_PER_PARAM / (dp if zero >= 2 else 1)
    optim = params * OPTIMIZER_BYTES_PER_PARAM / (dp if zero >= 1 else 1)
    working = 0.0
    if zero >= 3 and dp > 1 and layers:
        # FSDP gathers one unit at a time and prefetches the next.
        biggest = max(l.params.at(tp) for l in layers)
        working = 2 * biggest * w
    return ModelStateBytes(weights, grads, optim, working)


def activation_bytes(layers: list[LayerSpec], recompute: str, micro_batch: int, tp: int,
                     sequence_parallel: bool) -> float:
    """Bytes one micro-batch keeps on one rank between its forward and backward."""
    return micro_batch * sum(l.activation_bytes[recompute].at(tp, sequence_parallel) for l in layers)


def transient_bytes(layers: list[LayerSpec], recompute: str, micro_batch: int, tp: int,
                    sequence_parallel: bool) -> float:
    """Peak temporary memory while one unit runs its backward: under full recomputation the
    unit's whole activation set is rebuilt; otherwise the gradient buffers of its output
    and input. The head's logits gradient (fp32, vocabulary-wide) is the usual maximum."""
    worst = 0.0
    for l in layers:
        rebuilt = l.activation_bytes["none"].at(tp, sequence_parallel) if recompute == "full" else 0.0
        if l.kind == "head":
            # d(loss)/d(logits) in fp32 next to the saved logits.
            grads = l.activation_bytes["none"].at(tp, sequence_parallel)
        else:
            grads = 2 * l.output_bytes
        worst = max(worst, micro_batch * (rebuilt + grads))
    return worst
