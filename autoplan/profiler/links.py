"""Link benchmarks with torch.distributed among the local ranks of this machine.

N local processes are started (gloo on CPU, nccl on GPUs, one GPU per process) and time
all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point over a sweep of
message sizes. Each repeat starts together on every rank after a barrier and lasts
as long as its slowest rank; a size's time is the median (or the chosen statistic)
of its repeats. Every operation is then fitted to the alpha-beta
form the cost model uses (:mod:`costmodel.comm`), with the same step and byte counts:
a ring all-reduce of N bytes over n ranks costs ``2(n-1) alpha + 2(n-1)/n N / beta``,
all-gather and reduce-scatter half of that, all-to-all ``(n-1) alpha + (n-1)/n N / beta``
and a one-way transfer ``alpha + N / beta``. All operations together give the link
class's single (latency, bandwidth) pair; ranks spawned on one machine measure the
``intra_node`` class.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from autoplan.errors import ConfigError
from autoplan.profiler.fit import AlphaBeta, fit_alpha_beta
from autoplan.profiler.timing import STATISTICS

LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(0, 8))
"""1 KiB to 16 MiB: latency-bound to bandwidth-bound on any link."""


@dataclass(frozen=True)
class LinkSettings:
    """What the link benchmark runs."""

    world_size: int = 2
    """Local ranks to spawn (GPUs on cuda)."""
    backend: str = "gloo"
    """'gloo' (CPU tensors) or 'nccl' (one GPU per rank)."""
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Message sizes in bytes (the full tensor, as the cost model counts a collective)."""
    ops: tuple[str, ...] = LINK_OPS
    """Operations to time, from LINK_OPS."""
    warmup: int = 2
    """Untimed runs per operation and size."""
    repeats: int = 7
    """Timed runs per operation and size, at least..."""
    min_time_s: float = 0.05
    """... and until this many seconds were timed (capped at 10x repeats)."""
    statistic: str = "median"
    """Summary of the repeats the fit uses: 'median', 'p10' or 'min' (all are recorded)."""
    timeout_s: float = 300.0
    """The whole benchmark is abandoned (ranks killed) after this long."""

    def validate(self) -> "LinkSettings":
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError("backend", f"{self.backend!r} is not 'gloo' or 'nccl'")
        if self.world_size < 2:
            raise ConfigError("link_world_size", f"a link benchmark needs >= 2 ranks, got {self.world_size}")
        unknown = set(self.ops) - set(LINK_OPS)
        if unknown:
            raise ConfigError("link_ops", f"unknown {sorted(unknown)}", f"choose from {list(LINK_OPS)}")
        if self.statistic not in STATISTICS:
            raise ConfigError("statistic", f"{self.statistic!r} is not one of {list(STATISTICS)}")
        if not self.sizes or min(self.sizes) < 4 * self.world_size:
            raise ConfigError("link_sizes", f"sizes must be >= {4 * self.world_size} bytes")
        return self


def steps_and_bytes(op: str, n: int, nbytes: float) -> tuple[float, float]:
    """(latency steps, bytes over the bottleneck link) the cost model charges ``op``."""
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n * nbytes
    if op == "p2p":
        return 1.0, float(nbytes)
    raise ValueError(op)


def fit_samples(samples: list[dict], world_size: int) -> tuple[AlphaBeta | None, dict[str, AlphaBeta]]:
    """Alpha-beta fits of all samples together and of each operation."""
    by_op: dict[str, list[dict]] = {}
    for s in samples:
        by_op.setdefault(s["op"], []).append(s)

    def fit(rows):
        sb = [steps_and_bytes(r["op"], world_size, r["bytes"]) for r in rows]
        return fit_alpha_beta([a for a, _ in sb], [b for _, b in sb], [r["time_us"] * 1e-6 for r in rows])
    per = {op: fit(rows) for op, rows in by_op.items() if len(rows) >= 2}
    return (fit(samples) if len(samples) >= 2 else None), per


def benchmark_links(settings: LinkSettings) -> dict:
    """Start the ranks, time the operations and fit them. Returns the ``links`` record
    of a profile file for the ``intra_node`` class.

    The ranks are fresh interpreters (``python -m autoplan.profiler._link_worker``), not
    multiprocessing children, so the caller's main module need not guard itself."""
    settings.validate()
    if settings.backend == "nccl":
        import torch
        if torch.cuda.device_count() < settings.world_size:
            raise ConfigError("link_world_size", f"{settings.world_size} ranks need as many GPUs; "
                              f"this machine has {torch.cuda.device_count()}")
    import autoplan
    root = str(Path(autoplan.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="autoplan-links-") as tmp:
        init_file, out_file = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "result.json")
        procs, logs = [], []
        for rank in range(settings.world_size):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "autoplan.profiler._link_worker", str(rank), str(settings.world_size), init_file,
                 out_file, json.dumps(asdict(settings))], stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + settings.timeout_s
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            logs[bad[0]].seek(0)
            tail = " | ".join(logs[bad[0]].read().strip().splitlines()[-3:])
            for log in logs:
                log.close()
            late = time.monotonic() > deadline
            raise ConfigError("link benchmark", (f"did not finish in {settings.timeout_s:.0f} s" if late else
                                                 f"rank {bad[0]} failed: {tail}"),
                              "use --no-links to profile layers only")
        for log in logs:
            log.close()
        result = json.loads(Path(out_file).read_text())
    samples = result["samples"]
    overall, per = fit_samples(samples, settings.world_size)
    if overall is None:
        raise ConfigError("link benchmark", "no operation could be timed", str(result["unsupported"]))
    return {"backend": settings.backend, "world_size": settings.world_size,
            **overall.to_dict(), "by_op": {op: f.to_dict() for op, f in per.items()},
            "unsupported": result["unsupported"], "samples": samples}

