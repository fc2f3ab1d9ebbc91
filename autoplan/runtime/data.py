"""Training data for the runtime: seeded synthetic batches, or a user's dataset.

Every source yields the *global* batch of a step (``plan.global_batch`` samples) and
every rank draws the same one; each data-parallel replica then takes its contiguous
slice and the pipeline splits that into micro-batches. So the samples a step trains on
do not depend on the plan, and two plans with the same global batch are comparable
step by step (the same losses up to float rounding).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from autoplan.errors import ConfigError
from autoplan.models.config import TransformerConfig
from autoplan.models.zoo import example_inputs

DATA_SEED_OFFSET = 7_777_777
"""Keeps the data stream's seeds apart from the weight-initialisation seeds."""

Batch = tuple[torch.Tensor, torch.Tensor]


def synthetic_batch(cfg, global_batch: int, index: int, seed: int) -> Batch:
    """Batch ``index`` (0-based) of the synthetic stream of run ``seed``.

    Language models: uniformly random token ids; the target of a token is a fixed,
    seed-derived permutation of it, a mapping the model can learn, so the loss visibly
    falls within a few steps. Other models: ``example_inputs`` (random images, labels).
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + DATA_SEED_OFFSET + index)
    inputs, targets = example_inputs(cfg, global_batch, "cpu", generator=g)
    if isinstance(cfg, TransformerConfig):
        perm = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(seed + DATA_SEED_OFFSET))
        targets = perm[inputs]
    return inputs, targets


class DataSource:
    """The global batch of every step, from the synthetic stream or a user's dataset.

    ``data`` may be
      * None: the synthetic stream;
      * a callable ``data(index) -> (inputs, targets)`` returning global batch ``index``
        (0-based); resuming just calls it with the next index;
      * an iterable of ``(inputs, targets)`` global batches; resuming re-creates the
        iterator and skips the batches already consumed, unless the object has
        ``state_dict()``/``load_state_dict()``, which checkpoints then store instead.
    Every rank must see the same batches (seed any shuffling identically on every rank).
    """

    def __init__(self, cfg, global_batch: int, seed: int, data: Callable[[int], Batch] | Iterable[Batch] | None = None):
        self.cfg = cfg
        self.global_batch = global_batch
        self.seed = seed
        self.data = data
        self.position = 0
        """Batches consumed so far (= completed steps)."""
        self._iter = None
        if data is not None and not callable(data) and not hasattr(data, "__iter__"):
            raise ConfigError("data", f"must be a callable index -> (inputs, targets) or an iterable of "
                              f"batches, got {type(data).__name__}")

    @property
    def kind(self) -> str:
        if self.data is None:
            return "synthetic"
        return "callable" if callable(self.data) and not hasattr(self.data, "__iter__") else "iterable"

    def next_batch(self) -> Batch:
        index = self.position
        if self.data is None:
            batch = synthetic_batch(self.cfg, self.global_batch, index, self.seed)
        elif self.kind == "callable":
            batch = self.data(index)
        else:
            if self._iter is None:
                self._iter = iter(self.data)
                if not hasattr(self.data, "load_state_dict"):
                    for _ in range(index):
                        next(self._iter)
            try:
                batch = next(self._iter)
            except StopIteration:
                raise ConfigError("data", f"the dataset ran out after {index} batches",
                                  "pass fewer steps or a longer/repeating dataset") from None
        self.position += 1
        return self._check(batch, index)

    def _check(self, batch: Any, index: int) -> Batch:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            raise ConfigError("data", f"batch {index} is not an (inputs, targets) pair of tensors")
        inputs, targets = batch
        for name, t in (("inputs", inputs), ("targets", targets)):
            if t.shape[0] != self.global_batch:
                raise ConfigError("data", f"batch {index} {name} has {t.shape[0]} samples, the plan's global "
                                  f"batch is {self.global_batch}", "yield whole global batches")
        return inputs, targets

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        state: dict[str, Any] = {"position": self.position, "kind": self.kind}
        if self.data is not None and hasattr(self.data, "state_dict"):
            state["dataset"] = self.data.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self._iter = None
        if "dataset" in state and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(state["dataset"])


def replica_slice(batch: Batch, dp_rank: int, dp: int) -> Batch:
    """Data-parallel replica ``dp_rank``'s contiguous share of a global batch."""
    inputs, targets = batch
    per = inputs.shape[0] // dp
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    return inputs[sl], targets[sl]
