"""How autoplan's runtime realises a plan's data-parallel dimension: plain modules under
autocast, DistributedDataParallel, or the FSDP-family wrappers with their mixed-precision
policy. The runtime builds by it (:mod:`autoplan.runtime.build`) and the cost model reads it,
since the two paths move different bytes (``autoplan.stacks.Stack.traffic_for``); it needs
no torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelChoice:
    """How the data-parallel dimension is realised for one plan."""

    wrapper: str
    """'none' (dp = 1), 'ddp' (DistributedDataParallel, ZeRO-0), 'replicate' (FSDP-family
    replicate, ZeRO-0 where DDP cannot run) or 'fully_shard' (FSDP2)."""
    reshard_after_forward: bool
    """FSDP2: free gathered parameters after each unit's forward (true ZeRO-3). Otherwise
    the gathered parameters stay from the step's first forward to its last backward."""
    note: str
    """One line for logs and the run record: what the plan's zero stage became."""
    reduce_every_micro_batch: bool = False
    """FSDP2: reduce-scatter the gradients in every micro-batch's backward, so a rank keeps
    only its shard of them (ZeRO-2 and -3). Otherwise they accumulate whole, in the reduce
    dtype, and are reduced once, in the step's last backward (ZeRO-1)."""

    @property
    def under_autocast(self) -> bool:
        """The plan's layers compute under autocast on fp32 weights (no wrapper, or DDP); the
        FSDP-family wrappers compute on half-precision weight copies instead
        (MixedPrecisionPolicy)."""
        return self.wrapper in ("none", "ddp")


def data_parallel_choice(dp: int, zero: int, pp: int, tp: int = 1, schedule: str = "1f1b",
                         ep: int = 1) -> DataParallelChoice:
    """The wrapper for ``dp`` data-parallel shards (context ranks included) at ZeRO stage
    ``zero``, with the plan's pipeline, tensor and expert parallelism and schedule."""
    if dp == 1:
        return DataParallelChoice("none", False, "dp=1: no data parallelism (ZeRO has nothing to shard)")
    if zero == 0:
        if tp == 1 and pp == 1 and ep == 1:
            # Plain DDP: one bucketed all-reduce overlapped with backward, the fastest ZeRO-0.
            return DataParallelChoice("ddp", False, "ZeRO-0: DistributedDataParallel (bucketed all-reduce)")
        # replicate_with_fsdp, not the older torch.distributed._composable.replicate, which
        # computes silently wrong gradients under pipelining. DDP cannot hold DTensor
        # (tensor-parallel) weights, and under the pipeline runtime's action lists its
        # reducer asserts on the second step (it sees every parameter's gradient once per
        # micro-batch), with interleaved and zero-bubble schedules as with 1F1B.
        # Expert-parallel experts are DTensors too, averaged over their own replicas.
        why = "tensor-parallel weights" if tp > 1 else "expert-parallel weights" if ep > 1 else "pipeline stages"
        return DataParallelChoice("replicate", False, f"ZeRO-0: replicate (FSDP-family all-reduce; DDP cannot "
                                  f"run {why})")
    if pp > 1:
        # torch.distributed.pipelining's stages keep FSDP from resharding and reducing until
        # the step's last backward (PipelineStage.perform_reduce_grad), and FSDP2 with
        # reshard_after_forward=True under pipelining computes silently wrong gradients with
        # the split-backward (zero-bubble) schedules; torchtitan never reshards after forward
        # under PP, and neither do we. So every stage runs as ZeRO-1 does.
        return DataParallelChoice("fully_shard", False,
                                  f"ZeRO-{zero} under pipelining: FSDP2 with reshard_after_forward=False; the "
                                  "pipeline keeps gathered parameters and whole gradients until the step's last "
                                  "backward (as ZeRO-1)")
    if zero == 1:
        return DataParallelChoice("fully_shard", False,
                                  "ZeRO-1: FSDP2 with reshard_after_forward=False (parameters and optimizer "
                                  "states sharded; parameters stay gathered and gradients whole until the "
                                  "step's last backward)")
    if zero == 2:
        return DataParallelChoice("fully_shard", False,
                                  "ZeRO-2: FSDP2 with reshard_after_forward=False (parameters stay gathered "
                                  "through the step; gradients reduce-scattered every micro-batch)",
                                  reduce_every_micro_batch=True)
    return DataParallelChoice("fully_shard", True, "ZeRO-3: FSDP2 with reshard_after_forward=True",
                              reduce_every_micro_batch=True)


def runs_under_autocast(dp: int, zero: int, pp: int, tp: int = 1, schedule: str = "1f1b", ep: int = 1) -> bool:
    """Whether the runtime computes a mixed-precision plan's layers under autocast (fp32
    weights cast every forward): without data parallelism or with DDP. The FSDP-family
    wrappers compute on bf16 copies of the weights instead (MixedPrecisionPolicy)."""
    return data_parallel_choice(dp, zero, pp, tp, schedule, ep).under_autocast
