"""Run a plan on PyTorch's own distributed stack.

``train(plan, model, steps=...)`` trains inside an initialised process group (what the
``autoplan run`` CLI's torchrun workers call); ``load_record`` and
``compare_with_estimate`` read what a run measured and set it beside the cost model's
prediction. See docs/runtime.md.
"""
from __future__ import annotations

from autoplan.runtime.record import RankMemory, RunRecord, StepRecord, compare_with_estimate, load_record

__all__ = ["train", "Trainer", "TrainOptions", "RunRecord", "StepRecord", "RankMemory", "load_record",
           "compare_with_estimate"]


def __getattr__(name):
    # The trainer pulls in torch.distributed's parallel APIs; reading a record should not.
    if name in ("train", "Trainer", "TrainOptions"):
        from autoplan.runtime import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'autoplan.runtime' has no attribute {name!r}")
