"""Check a profile against the thing it predicts: the whole model's training step.

``measure_model`` times forward + loss + backward of a complete (small) model on this
machine; ``check_model`` compares it with what the cost model predicts from a profile
store for the same model on a one-device cluster. Used by the tests and by
``benchmarks/profile_accuracy.py``. Builds the whole model, so it is for models that fit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoplan.profiler.layers import TORCH_DTYPES
from autoplan.profiler.timing import STATISTICS, CacheFlush, Clock, RepeatPolicy, flush_bytes, spread


@dataclass(frozen=True)
class ModelTiming:
    """Measured seconds of one training step's passes of a whole model (median)."""

    forward_s: float
    """Forward including the loss."""
    backward_s: float
    """Backward of the loss."""
    statistic: str
    """'median' or 'p10' of the repeats (match the profile's)."""
    spread: float
    """Interquartile range over median of forward+backward."""
    repeats: int
    """Timed steps."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def measure_model(cfg, micro_batch: int, device: str = "cpu", dtype: str = "fp32",
                  policy: RepeatPolicy = RepeatPolicy(warmup=3, repeats=15, min_time_s=0.3)) -> ModelTiming:
    """Median forward and backward of the whole model ``cfg`` (a resolved config) for one
    micro-batch, gradients accumulating as in a training step with several micro-batches."""
    from autoplan.models.zoo import build_model, example_inputs, measured_loss_fn

    torch.manual_seed(0)
    model = build_model(cfg).to(device=device, dtype=TORCH_DTYPES[dtype]).train()
    x, y = example_inputs(cfg, micro_batch, device=device, generator=torch.Generator().manual_seed(0))
    clock = Clock(device, policy.clock)
    working_set = sum(p.numel() * p.element_size() for p in model.parameters())
    flush = CacheFlush(device, flush_bytes(device, working_set) if policy.flush else 0)

    criterion = measured_loss_fn(cfg)

    def fwd():
        return criterion(model(x), y)

    fs, bs = [], []
    n = spent = 0
    for _ in range(policy.warmup):
        fwd().backward()
    while n < policy.repeats or (spent < policy.min_time_s and n < policy.max_repeats):
        flush()
        tf, loss = clock.time(fwd)
        flush()
        tb, _ = clock.time(loss.backward)
        fs.append(tf)
        bs.append(tb)
        spent += tf + tb
        n += 1
    stat = STATISTICS[policy.statistic]
    return ModelTiming(forward_s=stat(fs), backward_s=stat(bs), statistic=policy.statistic,
                       spread=spread([a + b for a, b in zip(fs, bs)]), repeats=n)


@dataclass(frozen=True)
class Check:
    """Predicted against measured forward+backward of one model."""

    model: str
    """Model name."""
    micro_batch: int
    """Samples per micro-batch."""
    seq_len: int
    """Tokens per sample."""
    predicted_s: float
    """The cost model's compute time (forward + backward) with the profile."""
    roofline_s: float
    """The same without the profile (catalog roofline)."""
    measured: ModelTiming
    """The whole model's measured step."""
    sources: dict
    """Estimate.sources of the profiled prediction ('measured', 'roofline' or 'mixed')."""

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_s / self.measured.total_s - 1

    @property
    def roofline_error(self) -> float:
        return self.roofline_s / self.measured.total_s - 1


def predict(cfg, micro_batch: int, store, device_name: str = "CPU", dtype: str = "fp32") -> tuple[float, dict]:
    """(forward+backward seconds the cost model predicts on one device, sources)."""
    from autoplan import models
    from autoplan.cluster import Cluster
    from autoplan.plan import Plan
    from costmodel import estimate

    spec = models.from_config(cfg, dtype)
    cluster = Cluster.homogeneous(device_name, 1, 1)
    plan = Plan.uniform(spec, cluster, tp=1, pp=1, dp=1, micro_batch=micro_batch, global_batch=micro_batch,
                        dtype=dtype)
    est = estimate(spec, cluster, plan, profiles=store)
    return est.breakdown["compute"], est.sources


def check_model(cfg, micro_batch: int, store, device: str = "cpu", dtype: str = "fp32",
                policy: RepeatPolicy | None = None, device_name: str = "CPU") -> Check:
    """Predict with ``store`` (and without), then measure the whole model with the same
    statistic as the store reads."""
    predicted, sources = predict(cfg, micro_batch, store, device_name, dtype)
    roofline, _ = predict(cfg, micro_batch, None, device_name, dtype)
    policy = policy or RepeatPolicy(warmup=3, repeats=15, min_time_s=0.3)
    if store.statistic and store.statistic != policy.statistic:
        import dataclasses
        policy = dataclasses.replace(policy, statistic=store.statistic)
    clocks = {f.settings.get("clock", "wall") for f in store.files}
    if len(clocks) == 1 and policy.clock not in clocks:
        import dataclasses
        policy = dataclasses.replace(policy, clock=clocks.pop())
    measured = measure_model(cfg, micro_batch, device, dtype, policy)
    return Check(model=cfg.name, micro_batch=micro_batch, seq_len=cfg.seq_len, predicted_s=predicted,
                 roofline_s=roofline, measured=measured, sources=sources)
