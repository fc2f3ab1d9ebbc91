"""The host's share of a training step.

An accelerator runs kernels asynchronously: the host (Python model code, the framework's
dispatcher, autograd, the launch itself) queues them and moves on. A step whose host
issues kernels faster than the device runs them takes the device's time; one whose host
is slower (small layers, many kernels) takes the host's, the device idling between
kernels. Within a step the two alternate (a layer's forward may wait on the host, its
backward not), so the step takes a smoothed maximum of the two: the
``HOST_OVERLAP_NORM``-norm of (device time, host time), which is the larger within 1% once
one is under half the other and at most 2^(1/8) = 9% above it where they are equal. Host
work follows a pipeline as device work does (:func:`pipeline_host_time`).

On a CPU standing in for an accelerator (CI's gloo runs) the host *is* the device: every
kernel runs when it is issued, so its cost per kernel is part of the roofline (the
efficiency's ``launch_s``, a calibration's ``launch_s``) and nothing here applies.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoplan.catalog import is_accelerator
from autoplan.models.spec import LayerSpec

HOST_OVERLAP_NORM = 8.0
"""Exponent of the norm that combines device and host time (the larger of the two, smoothed
where they are close). On the autoplan stack's fitting sweep
(``benchmarks/results/gpu/h100/memory_runs.csv``, its host costs fitted at each norm by
``python benchmarks/published/validate.py --fit``) the step-time error is 6.8% at 2, 5.7% at
4, 5.2% at 8 and 5.0% for a hard maximum: flat from 8 up. 8 keeps some smoothing, as a step
whose phases alternate between waiting on the host and on the device needs."""


@dataclass(frozen=True)
class HostCosts:
    """What the host spends per training step on one device type."""

    per_kernel_s: float = 0.0
    """Seconds to issue one kernel of the forward or backward pass."""
    per_step_s: float = 0.0
    """Seconds per step besides those kernels (the optimizer's per-tensor loops, gradient
    clipping, zeroing, logging). Charged to every rank in full, whatever share of the model
    it holds: the runs it is fitted on hold the whole model on one GPU."""


NO_HOST = HostCosts()


def host_costs(device_name: str, stack, calibration=None) -> HostCosts:
    """The host costs of a step on ``device_name`` under ``stack``: a calibration's for this
    device when it has them (its ``launch_s`` and ``step_overhead_s`` are then the host's;
    either None keeps the stack's), else the stack's; none on a CPU (see the module
    docstring)."""
    if not is_accelerator(device_name):
        return NO_HOST
    cal = calibration.device(device_name) if calibration is not None else None
    if cal is None:
        return HostCosts(stack.host_s_per_kernel, stack.host_s_per_step)
    per_kernel = stack.host_s_per_kernel if cal.launch_s is None else cal.launch_s
    per_step = stack.host_s_per_step if cal.step_overhead_s is None else cal.step_overhead_s
    return HostCosts(per_kernel, per_step)


def layer_host_kernels(layer: LayerSpec, recompute: str, stack, autocast: bool = False) -> float:
    """Kernels the host issues for one micro-batch of ``layer``: its forward, its backward,
    and what recomputation re-runs (full: the forward, or with an early-stopping checkpoint
    its prefix up to the last save plus the checkpoint's pack and unpack hook per saved
    tensor, as ``costmodel.compute.roofline_timing`` charges them; selective: the attention
    core, a few kernels, not counted). ``autocast``: the layer runs under autocast on fp32
    weights (``Stack.computes_under_autocast``), which issues a cast per weight and per
    activation changing precision, and their backward: the counts measured so
    (``LayerSpec.autocast_kernels_fwd``) where the spec has them. A recomputed forward
    opens a new autocast region, so it casts the weights again."""
    fwd, bwd = layer.kernels_fwd, layer.kernels_bwd
    pre = layer.recompute_prefix
    prefix = pre.kernels if pre is not None else 0
    if autocast and layer.autocast_kernels_fwd:
        fwd, bwd = layer.autocast_kernels_fwd, layer.autocast_kernels_bwd
        prefix = pre.autocast_kernels if pre is not None and pre.autocast_kernels else prefix
    kernels = fwd + bwd
    if recompute == "full":
        if stack.recompute_early_stop and pre is not None:
            kernels += prefix + 2 * pre.saved_tensors
        else:
            kernels += fwd
    return kernels


def pipeline_host_time(per_micro_batch: list[float], per_step: list[float], micro_batches: int) -> float:
    """Host seconds of a step whose pipeline groups' hosts spend ``per_micro_batch[g]``
    issuing one micro-batch's kernels and ``per_step[g]`` besides: a host issues a
    micro-batch's kernels of its stages once their input arrives, so host work follows
    the pipeline as device work does -- ``m - 1`` periods of the busiest host and one pass
    through every host (the textbook pipeline time, Narayanan et al. SC21 section 2.2),
    then the per-step work. One group: ``m`` times its work per micro-batch and its
    per-step work; a deep pipeline of one micro-batch gains nothing over one stage."""
    if not any(per_micro_batch) and not any(per_step):
        return 0.0
    return ((micro_batches - 1) * max(per_micro_batch) + sum(per_micro_batch)
            + max(per_step, default=0.0))


def device_budget(step_s: float, host_s: float) -> float:
    """The device time under which a step whose host takes at least ``host_s`` stays under
    ``step_s`` (the inverse of :func:`with_host` in its device time; 0 where the host alone
    reaches it). Lets a bound on the whole step prune device-only quantities."""
    if host_s <= 0.0 or step_s == float("inf"):
        return step_s
    if host_s >= step_s:
        return 0.0
    p = HOST_OVERLAP_NORM
    return step_s * (1.0 - (host_s / step_s) ** p) ** (1.0 / p)


def with_host(device_s: float, host_s: float, norm: float = HOST_OVERLAP_NORM) -> float:
    """A step's seconds from its device time and its host time (module docstring; ``norm``
    other than ``HOST_OVERLAP_NORM`` only to show how that choice was made)."""
    if host_s <= 0.0 or device_s == float("inf"):
        return device_s
    p = norm
    top = max(device_s, host_s)
    return top * ((device_s / top) ** p + (host_s / top) ** p) ** (1.0 / p)
