"""Run one iteration's schedule program on this rank.

The program comes from :func:`autoplan.schedule.build_program` -- the very action lists
the cost model simulates. With several pipeline ranks it is handed, as compute-only
actions, to ``torch.distributed.pipelining``'s ``_PipelineScheduleRuntime``, which adds
the sends/receives (and FSDP unshard/reshard/reduce steps) from data dependencies, as
autoplan's own schedule module does. With one pipeline rank there is nothing to send
and the actions run here directly, so FSDP's per-unit hooks (true ZeRO-3 resharding)
stay in charge of memory.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from autoplan.data_parallel import DataParallelChoice
from autoplan.schedule import ScheduleProgram

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LocalExecutor:
    """A single pipeline rank holding the whole model (pp = 1).

    Forward ``F m`` keeps micro-batch m's loss; backward ``B m`` (or ``I m``) back-propagates
    it scaled by 1/num_micro_batches, so the accumulated gradient is that of the mean loss.
    With one stage there is no pipeline bubble for deferred weight gradients to fill, so a
    zero-bubble program's ``I m`` runs the whole backward and its ``W m`` has nothing left
    to do; the gradients are the same."""

    def __init__(self, stage: torch.nn.Module, program: ScheduleProgram, loss_fn: LossFn,
                 device: torch.device, choice: DataParallelChoice,
                 before_compute: Callable[[], None] | None = None):
        self.stage = stage
        self.choice = choice
        """How the stage was wrapped for data parallelism: when FSDP reduces and reshards."""
        self.before_compute = before_compute or (lambda: None)
        """Called at the start of every run, right before the first real forward."""
        self.actions = program.ranks[0]
        self.num_micro_batches = program.num_micro_batches
        self.loss_fn = loss_fn
        self.device = device
        self.program = program

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
        m_total = self.num_micro_batches
        xs = torch.tensor_split(inputs, m_total)
        ys = torch.tensor_split(targets, m_total)
        pending: dict[int, torch.Tensor] = {}
        losses: dict[int, float] = {}
        backwards = 0
        sharded = isinstance(self.stage, FSDPModule)
        self.before_compute()
        ddp = isinstance(self.stage, DistributedDataParallel)
        for action in self.actions:
            m = action.micro_batch
            if action.kind == "F":
                # DDP would prepare a reduction at every forward: run forwards under
                # no_sync and prepare it by hand before the last backward, as
                # torch.distributed.pipelining's stages do, so any program order works.
                with self.stage.no_sync() if ddp else contextlib.nullcontext():
                    out = self.stage(xs[m].to(self.device))
                loss = self.loss_fn(out, ys[m].to(self.device))
                pending[m] = loss
                losses[m] = float(loss.detach())
            elif action.kind in ("B", "I"):
                backwards += 1
                last = backwards == m_total
                loss = pending.pop(m)
                if sharded:
                    # ZeRO-1 reduces the gradients once, in the step's last backward, and
                    # accumulates them whole before; ZeRO-2/3 reduce-scatter every
                    # micro-batch's and keep their shard. ZeRO-1/2 keep the gathered
                    # parameters until the last backward (one all-gather per step); ZeRO-3
                    # frees them after each unit's backward.
                    self.stage.set_requires_gradient_sync(last or self.choice.reduce_every_micro_batch)
                    self.stage.set_reshard_after_backward(last or self.choice.reshard_after_forward)
                if ddp and last:
                    self.stage.reducer.prepare_for_backward(list(_find_tensors(loss)))
                with self.stage.no_sync() if ddp and not last else contextlib.nullcontext():
                    (loss / m_total).backward()
            # 'W': already done by the full backward at 'I' (see class docstring).
        return [losses[m] for m in sorted(losses)]


class PipelineExecutor:
    """Several pipeline ranks: ``_PipelineScheduleRuntime`` executing the program."""

    def __init__(self, stage_modules: dict[int, torch.nn.Module], num_stages: int, program: ScheduleProgram,
                 loss_fn: LossFn, device: torch.device, pp_group: dist.ProcessGroup,
                 before_compute: Callable[[], None] | None = None):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

        self.stages = [PipelineStage(stage_modules[s], s, num_stages, device, group=pp_group)
                       for s in sorted(stage_modules)]
        self.is_first = 0 in stage_modules
        self.is_last = num_stages - 1 in stage_modules
        self.device = device
        # scale_grads=True divides by the number of micro-batches: the loss is a mean.
        self.schedule = _PipelineScheduleRuntime(self.stages, n_microbatches=program.num_micro_batches,
                                                 loss_fn=loss_fn, scale_grads=True)
        actions = {g: [_Action.from_str(a) for a in row] for g, row in enumerate(program.to_compute_only())}
        self.schedule._prepare_schedule_with_comms(actions, format="compute_only")
        self.program = program
        if before_compute is not None:
            # The schedule initialises its stages at the start of every step (the first time
            # by running each stage forward and backward on placeholder tensors to learn the
            # shapes); the step's real compute follows. Per-step state (the load-balancing
            # loss's counts) is reset after that, so placeholder passes never count.
            initialize = self.schedule._initialize_stages

            def initialize_then_reset(*args, **kwargs):
                initialize(*args, **kwargs)
                before_compute()
            self.schedule._initialize_stages = initialize_then_reset

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self.is_first else ()
        target = targets.to(self.device) if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses if self.is_last else None,
                           return_outputs=False)
        return [float(l.detach()) for l in losses]
