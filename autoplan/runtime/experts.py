"""Expert parallelism and the load-balancing loss for the zoo's mixture-of-experts units.

Expert parallelism (:class:`ExpertParallel`, a DTensor ``ParallelStyle`` like torchtitan's):
the stacked expert weights of a :class:`~autoplan.models.zoo.moe.GroupedExperts` are
``Shard(0)`` (by expert) over the plan's expert-parallel mesh axis and, under tensor
parallelism, ``Shard(1)``/``Shard(2)`` (w1/w3 by output rows, w2 by input columns) over the
tensor axis. Around the experts' forward:

* **dispatch**: the routed token slots ``[E, C, h]`` are cut into ``ep`` runs of ``E / ep``
  experts and exchanged by an all-to-all over the ``ep`` group, so a rank receives
  ``[E / ep, ep * C, h]``: its own experts' slots from every rank of the group;
* the experts run on that as DTensors (the grouped matmuls keep the expert dimension
  sharded; with tensor parallelism their output is ``Partial`` and is all-reduced);
* **combine**: the reverse all-to-all returns every rank its own tokens' results.

The all-to-alls are ``torch.distributed._functional_collectives.all_to_all_single_autograd``,
so backward runs the mirrored exchanges. Shapes are static (the zoo routes into fixed
capacity), so every rank sends and receives the same sizes.

Gradients of expert weights are reduced only over the ranks holding the same experts (the
plan's ``expert_dp_groups``, dp / ep of them); each already sums the contributions of all
``ep`` ranks' tokens through the all-to-all, so the experts' backward runs scaled by 1/ep
(and the tokens' gradient is scaled back at the dispatch) to make the result the mean
over all dp ranks, whatever the collective backend.

Load balancing (:func:`configure_load_balancing`): ``micro`` keeps the zoo's default (f from
the micro-batch on this rank); ``global`` (Qiu et al. 2025) all-reduces each micro-batch's
expert counts over the data-parallel ranks and accumulates them over the step's micro-
batches; the loss's backward reads the accumulated counts when it runs, so f is the global
batch's whenever every forward of a stage precedes its first backward (GPipe, or one micro-
batch per replica), and the counts of the micro-batches seen so far otherwise (the buffer of
Qiu et al. and Megatron-Core's ``global_aux_loss``).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from autoplan.models.zoo.moe import GroupedExperts, LoadBalancingLoss, MicroBatchFrequencies

LOAD_BALANCING = ("micro", "global")
"""Where the load-balancing loss takes its expert frequencies f from."""

_TP_SHARD_DIM = {"w1": 1, "w3": 1, "w2": 2}
"""Tensor-parallel shard dimension of each stacked expert weight ([experts, out, in])."""


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all along dim 0, differentiable."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class ExpertParallel(ParallelStyle):
    """Shard a GroupedExperts over a 2-D ("ep", "tp") mesh and exchange its token slots by
    all-to-all over "ep" (see the module docstring). Either axis may have size 1."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"ExpertParallel applies to GroupedExperts, not {type(module).__name__}")
        ep = device_mesh.size(0)
        group = device_mesh.get_group(0) if ep > 1 else None

        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                placements = [Shard(0), Shard(_TP_SHARD_DIM[pname])]
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, placements)))

        def dispatch(mod, inputs, mesh):
            x = inputs[0]                                        # [E, C, h], the same on every tp rank
            e, c, h = x.shape
            if ep > 1:
                x = _all_to_all(x, group)                        # [ep (source), E/ep, C, h] flattened
                x = x.view(ep, e // ep, c, h).transpose(0, 1).reshape(e // ep, ep * c, h)
                x = _ScaleGradient.apply(x, float(ep))           # undoes combine's 1/ep for the tokens
            return (DTensor.from_local(x, mesh, [Shard(0), Replicate()], run_check=False),)

        def combine(mod, out, mesh):
            local = out.redistribute(mesh, [Shard(0), Replicate()]).to_local()   # [E/ep, ep*C, h]
            if ep > 1:
                # An expert's weight gradient sums the tokens of all ep ranks, and data
                # parallelism then averages it over the dp / ep ranks holding the same
                # experts; 1/ep inside the experts makes that the mean over all dp ranks.
                local = _ScaleGradient.apply(local, 1.0 / ep)
                el, slots, h = local.shape
                local = local.view(el, ep, slots // ep, h).transpose(0, 1)       # [ep (dest), E/ep, C, h]
                local = _all_to_all(local, group).view(el * ep, slots // ep, h)
            return local

        return distribute_module(module, device_mesh, partition, dispatch, combine)


def expert_modules(units: Iterable[nn.Module]) -> list[GroupedExperts]:
    return [m for u in units for m in u.modules() if isinstance(m, GroupedExperts)]


def balance_modules(units: Iterable[nn.Module]) -> list[LoadBalancingLoss]:
    return [m for u in units for m in u.modules() if isinstance(m, LoadBalancingLoss)]


class _Accumulated:
    def __init__(self, owner: "GlobalBatchFrequencies"):
        self.owner = owner

    def resolve(self) -> torch.Tensor:
        total = self.owner.total
        return total / total.sum().clamp_min(1)


class GlobalBatchFrequencies:
    """f over the global batch: each call's expert counts are summed over the data-parallel
    ranks (one all-reduce of num_experts numbers) and accumulated over the step's
    micro-batches; handles resolve to the accumulated counts when backward reads them."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.total: torch.Tensor | None = None

    def register(self, counts: torch.Tensor) -> _Accumulated:
        counts = counts.detach().to(torch.float64)
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        self.total = counts if self.total is None else self.total + counts
        return _Accumulated(self)

    def reset(self) -> None:
        self.total = None


def configure_load_balancing(units: Iterable[nn.Module], mode: str, dp_group: dist.ProcessGroup | None,
                             grad_scale: float) -> list[LoadBalancingLoss]:
    """Set every MoE unit's load-balancing loss to ``mode`` ('micro' or 'global' over
    ``dp_group``), scale its gradient by ``grad_scale`` (the factor the executor applies
    to each micro-batch's loss) and keep its per-step values; returns the modules."""
    mods = balance_modules(units)
    for m in mods:
        m.frequencies = GlobalBatchFrequencies(dp_group) if mode == "global" else MicroBatchFrequencies()
        m.grad_scale = grad_scale
        m.records = []
    return mods


def start_step(mods: Iterable[LoadBalancingLoss]) -> None:
    for m in mods:
        m.reset()
        if isinstance(m.frequencies, GlobalBatchFrequencies):
            m.frequencies.reset()


def step_value(mods: list[LoadBalancingLoss]) -> tuple[float, int]:
    """(sum over this rank's MoE layers of their mean loss value this step, layers counted)."""
    vals = [v for v in (m.value() for m in mods) if v is not None]
    return sum(vals), len(vals)
