"""Per-rank memory: model states under ZeRO 0-3, the activation working set, the loss's
logits, communication buffers, the CUDA context and the allocator's loss, for the
training stack the plan runs on (:class:`autoplan.stacks.Stack`).

Activations *in flight* come from the schedule simulation (how many micro-batches each
stage holds at once under the plan's schedule); this module gives the bytes per
micro-batch, the static part and the peak of a rank, component by component.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoplan.models.spec import LayerSpec
from autoplan.stacks import Stack
from costmodel import experts
from autoplan.units import DTYPE_BYTES

DEFAULT_MEMORY_MARGIN = 0.03
"""Plans whose predicted peak is within this share of a device's memory are 'tight': the
prediction's own error (see the validation report) is of this order, so they are ranked
after plans with room rather than called fits at 79.9 of 80 GiB."""


@dataclass(frozen=True)
class ModelStateBytes:
    """Static bytes on one rank."""

    weights: float
    """Persistent weights, plus the units ZeRO-3 gathers."""
    gradients: float
    optimizer: float
    """Master weights and optimizer moments."""
    casts: float = 0.0
    """Half-precision copies of fp32 weights the forward and backward read (autocast's, or
    FSDP's unsharded compute copy): alive during forward/backward, gone at the optimizer step."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


@dataclass
class GroupMemory:
    """Peak bytes on each rank of one pipeline group, by component."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    """Saved activations of the micro-batches in flight at the peak (the loss's saved
    logits included)."""
    transient: float
    """Working memory on top of the activations at the peak: a unit's backward, the loss's
    backward, or the optimizer step's temporaries, whichever is largest."""
    buffers: float
    """Communication buckets the framework allocates for data-parallel reduction and gather
    (DeepSpeed's), besides the gradients themselves."""
    nccl: float
    """NCCL's own buffers, per communicator the rank belongs to (outside the allocator)."""
    context: float
    """CUDA context outside the allocator (0 on CPU)."""
    fragmentation: float
    """Allocator bytes lost to fragmentation of the dynamic working set."""

    @property
    def total(self) -> float:
        return self.allocated + self.nccl + self.context + self.fragmentation

    @property
    def allocated(self) -> float:
        """Live tensors at the peak: what the allocator's max_memory_allocated measures."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.transient + self.buffers

    @property
    def overhead(self) -> float:
        """Everything that is not a model state, an activation or a temporary."""
        return self.buffers + self.nccl + self.context + self.fragmentation


def zero3_gathered_params(layer: LayerSpec, tp: int, ep: int, stack: Stack) -> float:
    """Parameters one ZeRO-3 gather of ``layer`` brings onto a rank: the unit's own, or under
    a stack that gathers per sub-module (``Stack.zero3_gather_unit``) its largest weight."""
    held = experts.state_params([layer], tp, ep)[0]
    return min(layer.largest_weight(tp), held) if stack.zero3_gather_unit == "module" else held


def zero3_working_set(gathered_params, stack: Stack):
    """(weights, gradient) bytes ZeRO-3 holds on a rank beyond its shards, for a largest
    gather of ``gathered_params`` (a number or an array of them): the gather in use and the
    next one, prefetched, and the whole gradient the one in use produces before the
    reduce-scatter shards it, all in the gathered weights' dtype."""
    one = gathered_params * stack.gathered_weights_bytes_per_param
    return 2 * one, one


def model_state_bytes(layers: Sequence[LayerSpec], tp: int, dp: int, zero: int, stack: Stack,
                      ep: int = 1, cast_all: bool = False) -> ModelStateBytes:
    """Weights, gradients and optimizer states of ``layers`` on one rank under ``stack`` at
    ZeRO stage ``zero``, the one the plan runs at (``Stack.realized_zero``); routed experts
    split over ``ep`` ranks, see ``costmodel.experts.state_params``. ``cast_all``: the
    compute copy covers the embedding tables too (``Stack.casts_all_weights``)."""
    held, sharded = experts.state_params(layers, tp, ep)
    weights, grads, optim = ((sharded / dp if zero >= stage else held) * b for b, stage in stack.state_parts)
    if zero >= 3 and dp > 1 and layers:
        gathered_w, gathered_g = zero3_working_set(max(zero3_gathered_params(l, tp, ep, stack) for l in layers),
                                                   stack)
        weights += gathered_w
        grads += gathered_g
    casts = 0.0
    if stack.weight_cast_bytes_per_param and not (zero >= 3 and dp > 1):
        # Half-precision copies of fp32 weights: those the matmuls read under autocast
        # (embedding tables are looked up, not cast), every one under FSDP's mixed precision.
        casts = experts.state_params([l for l in layers if cast_all or l.kind != "embedding"], tp, ep)[0] * \
            stack.weight_cast_bytes_per_param
    return ModelStateBytes(weights, grads, optim, casts)


def logits_per_sample(layer: LayerSpec, dtype: str) -> float:
    """Logit elements the loss sees per sample: the head's output (0 for other units)."""
    if layer.kind != "head":
        return 0.0
    return layer.output_bytes / DTYPE_BYTES[dtype]


def loss_logits(layer: LayerSpec, tp: int, dtype: str, stack: Stack) -> float:
    """Logit elements per sample one tensor-parallel rank runs the loss over."""
    n = logits_per_sample(layer, dtype)
    return n / tp if stack.vocab_parallel_loss else n


def activation_bytes(layers: Sequence[LayerSpec], recompute: str, micro_batch: int, tp: int,
                     sequence_parallel: bool, stack: Stack | None = None, dtype: str = "bf16",
                     expert_load: float = 1.0) -> float:
    """Bytes one micro-batch keeps on one rank between its forward and backward (with a
    stack: the loss's saved logits on the stage that holds the head; routed experts at
    ``expert_load``, see ``costmodel.experts``)."""
    saved = sum(l.activation_bytes[recompute].at(tp, sequence_parallel)
                + experts.activation_bytes(l, recompute, tp, sequence_parallel, expert_load) for l in layers)
    if (stack is not None and stack.sequence_parallel_keeps_gathered_inputs and sequence_parallel and tp > 1
            and recompute != "full"):
        # The attention and MLP inputs (each the size of the block's output) are kept whole,
        # where the measured layers keep 1/tp of them.
        saved += sum(2 * l.output_bytes * (1 - 1 / tp) for l in layers if l.kind == "block")
    if stack is not None:
        saved = saved * stack.activation_scale + sum(
            loss_logits(l, tp, dtype, stack) for l in layers) * stack.loss_saved_bytes_per_logit
    return micro_batch * saved


def transient_bytes(layers: Sequence[LayerSpec], recompute: str, micro_batch: int, tp: int,
                    sequence_parallel: bool, stack: Stack | None = None, dtype: str = "bf16",
                    ep: int = 1, expert_load: float = 1.0) -> float:
    """Peak temporary memory while one unit runs its backward, on top of the saved
    activations: under full recomputation the unit's whole activation set is rebuilt, and
    every backward holds the gradients of its output and input (and of its routed tokens,
    see ``costmodel.experts.transient_bytes``); the loss's backward holds its gradient
    buffers over the logits (with a stack)."""
    worst = 0.0
    scale = stack.activation_scale if stack is not None else 1.0
    for l in layers:
        rebuilt = ((l.activation_bytes["none"].at(tp, sequence_parallel)
                    + experts.activation_bytes(l, "none", tp, sequence_parallel, expert_load)) * scale
                   if recompute == "full" else 0.0)
        grads = 2 * l.output_bytes if l.kind != "head" else 0.0
        grads += experts.transient_bytes(l, 1, ep, expert_load)
        if stack is not None and l.kind == "head":
            extra = stack.loss_peak_bytes_per_logit - stack.loss_saved_bytes_per_logit
            grads = loss_logits(l, tp, dtype, stack) * max(extra, 0.0)
        # Temporaries an operator layout declares (a co-sharded unit rebuilding one chunk,
        # an interlaced unit's share).
        extra = l.transient_bytes.at(tp, sequence_parallel)
        worst = max(worst, micro_batch * (rebuilt + grads + extra))
    return worst


def optimizer_step_bytes(layers: Sequence[LayerSpec], tp: int, dp: int, zero: int, stack: Stack,
                         ep: int = 1) -> float:
    """Temporaries after the backward, when activations are gone (``after_backward_bytes``)."""
    held, sharded = experts.state_params(layers, tp, ep)
    return float(after_backward_bytes(held, sharded, dp, zero, stack))


def after_backward_bytes(held, sharded, dp: int, zero: int, stack: Stack):
    """Bytes a rank holding ``held`` parameters (``sharded`` of them under ZeRO's division by
    ``dp``; floats or arrays alike, for the search's tables) keeps after the backward: the
    optimizer step's temporaries, or the copy the gradient reduction makes in its
    communication dtype (``Stack.grad_reduce_copy_bytes_per_param``, below ZeRO-2 where a
    rank reduces its whole gradients), whichever is larger: the copy is freed before the
    step begins."""
    step = (sharded / dp if zero >= 1 else held) * stack.optimizer_step_bytes_per_param
    copy = held * (stack.grad_reduce_copy_bytes_per_param if dp > 1 and zero < 2 else 0.0)
    return np.maximum(step, copy)


def communicators(tp: int, shards: int, cp: int, pp: int, ep: int) -> int:
    """Process groups of two or more ranks a rank talks in, each holding NCCL's buffers:
    tensor, data x context (``shards``: gradients are reduced over both), context, pipeline,
    expert, and the expert-data group when experts are sharded over fewer ranks."""
    return (tp > 1) + (shards > 1) + (cp > 1) + (pp > 1) + (ep > 1) + (ep > 1 and shards > ep)


def group_memory(states: ModelStateBytes, in_flight: float, backward_transient: float, step_bytes: float,
                 communicators: int, dp: int, stack: Stack, accelerator: bool) -> GroupMemory:
    """The peak of one rank, by component: the forward/backward peak (activations in flight,
    the largest backward working set and the weights' half-precision casts) or the optimizer
    step's temporaries, whichever is larger, on top of the model states."""
    compute_phase = in_flight + backward_transient + states.casts
    dynamic = max(compute_phase, step_bytes)
    casts = states.casts if compute_phase >= step_bytes else 0.0
    return GroupMemory(weights=states.weights + casts, gradients=states.gradients, optimizer=states.optimizer,
                       activations=in_flight, transient=dynamic - in_flight - casts,
                       buffers=stack.dp_buffer_bytes if dp > 1 and accelerator else 0.0,
                       nccl=communicators * stack.nccl_bytes_per_group if accelerator else 0.0,
                       context=stack.cuda_context_bytes if accelerator else 0.0,
                       fragmentation=stack.allocator_fragmentation * dynamic)
