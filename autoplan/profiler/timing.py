"""Clocks and memory probes for one device.

* GPU: CUDA events around the work (the GPU's own timeline, launch gaps included),
  memory from the caching allocator's statistics (``max_memory_allocated``).
* CPU: ``time.perf_counter`` wall clock (or the measuring thread's CPU time); memory
  from the allocation records of ``torch.profiler`` (every CPU allocation and free
  with its size), and saved activations from autograd's saved-tensor hooks on both
  devices.

Every timing is a summary (median by default) of repeats after warm-up: the first runs
pay for lazy initialisation (allocator growth, kernel selection, oneDNN primitive
caches) and a shared machine adds one-sided outliers that a median ignores.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
                      "aten::_addmm_activation", "aten::_scaled_mm"})
"""Operators counted as matrix multiplies in per-operator breakdowns."""
ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
"""Substrings of fused-attention operator names."""


@dataclass(frozen=True)
class RepeatPolicy:
    """How often each quantity is timed."""

    warmup: int = 3
    """Untimed runs first."""
    repeats: int = 10
    """Timed runs at least."""
    min_time_s: float = 0.05
    """Keep repeating until the timed runs add up to this many seconds (short kernels
    need many samples for a stable summary on a shared machine)..."""
    max_repeats: int = 200
    """... but never more than this many."""
    clock: str = "wall"
    """CPU timer: 'wall' (``time.perf_counter``) or 'thread' (``time.thread_time``, the CPU
    time of the measuring thread). 'thread' needs one torch thread (then every kernel and
    the autograd engine's CPU work run on the calling thread) and leaves out the time
    the thread waited for a core, so it still measures the kernels when other jobs
    share the machine. Ignored on GPU (CUDA events)."""
    flush: bool = True
    """Evict caches before every timed pass (as GPU kernel benchmarks do, e.g. Triton's
    ``do_bench``): in a model, other layers run between a layer's forward and its next
    use, so a layer timed in a hot loop (its weights and activations still cached, and
    on CPU its small kernels at their fastest) looks faster than it is in the model."""
    statistic: str = "median"
    """What a profile entry's times are: 'median' of the repeats, 'p10' (the first
    decile) or 'min'. A machine shared with other jobs should use 'p10': preemption only
    ever adds time, and when other processes hold the cores for seconds at a time even
    the median moves (all three are always recorded; this picks the headline one)."""

    def validate(self) -> "RepeatPolicy":
        from autoplan.errors import ConfigError
        if self.warmup < 0:
            raise ConfigError("warmup", f"must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise ConfigError("repeats", f"must be >= 1, got {self.repeats}")
        if self.max_repeats < self.repeats:
            raise ConfigError("max_repeats", f"must be >= repeats ({self.repeats}), got {self.max_repeats}")
        if self.min_time_s < 0:
            raise ConfigError("min_time_s", f"must be >= 0, got {self.min_time_s}")
        if self.clock not in CLOCKS:
            raise ConfigError("clock", f"{self.clock!r} is not one of {list(CLOCKS)}")
        if self.statistic not in STATISTICS:
            raise ConfigError("statistic", f"{self.statistic!r} is not one of {list(STATISTICS)}")
        return self


CLOCKS = ("wall", "thread")


class Clock:
    """Times a callable on one device: CUDA events on GPU, else the policy's CPU clock."""

    def __init__(self, device: str, clock: str = "wall"):
        from autoplan.errors import ConfigError
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if clock not in CLOCKS:
            raise ConfigError("clock", f"{clock!r} is not one of {list(CLOCKS)}")
        if clock == "thread" and not self.cuda and torch.get_num_threads() != 1:
            raise ConfigError("clock", f"'thread' times only the calling thread, but torch uses "
                              f"{torch.get_num_threads()} threads", "add --threads 1, or use --clock wall")
        self.name = "cuda events" if self.cuda else clock
        self._now = time.thread_time if clock == "thread" else time.perf_counter

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        """(seconds, fn's result)."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            # Earlier work must not leak into this interval.
            torch.cuda.synchronize(self.device)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = self._now()
        out = fn()
        return self._now() - t0, out


def cache_sizes(device: str) -> tuple[int, int]:
    """(per-core L2, last-level) cache bytes of the device (sysfs on Linux for the CPU;
    the GPU's L2 for both on CUDA); conservative defaults when unknown."""
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        l2 = int(getattr(props, "L2_cache_size", 0) or 64 * 2 ** 20)
        return l2, l2
    sizes = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            with open(f"{base}/{entry}/level") as f:
                level = int(f.read())
            with open(f"{base}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip()
            mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
            if kind != "Instruction":
                sizes[level] = int(text.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    l2 = sizes.get(2, 2 ** 20)
    return l2, sizes.get(max(sizes), 32 * 2 ** 20) if sizes else 32 * 2 ** 20


class CacheFlush:
    """Overwrites a buffer of ``nbytes`` on the device, evicting what the caches held."""

    def __init__(self, device: str, nbytes: int):
        self.nbytes = int(nbytes)
        self.buffer = torch.empty(max(1, self.nbytes // 4), dtype=torch.float32, device=device) if nbytes else None
        self._n = 0

    def __call__(self) -> None:
        if self.buffer is not None:
            self._n += 1
            self.buffer.fill_(float(self._n))


def flush_bytes(device: str, working_set: float) -> int:
    """How much to overwrite before a timed pass of a layer touching ``working_set``
    bytes: enough to evict it (4x, caches are not perfectly LRU), at least twice the
    per-core cache, at most twice the last-level cache (beyond that nothing is left)."""
    l2, llc = cache_sizes(device)
    return int(max(2 * l2, min(2 * llc, 4 * working_set)))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def p10(xs: list[float]) -> float:
    """First decile (linear interpolation between order statistics)."""
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=10, method="inclusive")[0]


STATISTICS = {"median": median, "p10": p10, "min": min}
"""The summaries of repeated timings a profile records."""


def spread(xs: list[float]) -> float:
    """Interquartile range over the median: how noisy the samples were."""
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    m = statistics.median(xs)
    return (q[2] - q[0]) / m if m > 0 else 0.0


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward, parameters excluded
    (they are held anyway). Use as ``torch.autograd.graph.saved_tensors_hooks(s.pack, s.unpack)``."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.params:
            self.seen.setdefault(key, st.nbytes())
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what native code writes to file descriptor 2 while the profiler starts and
    stops (some builds print trace-point lines there). Python exceptions still propagate."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


@dataclass
class OpProfile:
    """What one pass (forward or backward) spent, from ``torch.profiler``."""

    times_ms: dict[str, float]
    """Milliseconds of operator self time by category: 'gemm', 'attention', 'other'
    (device kernel time on GPU, CPU self time on CPU), and 'profiled' (the pass's wall
    time under the profiler, which adds its own per-operator cost)."""
    peak_bytes: float | None
    """Largest net allocation during the pass (CPU allocation records), None if unavailable."""
    end_bytes: float | None
    """Net allocation left at the end of the pass."""


def _category(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if any(m in name for m in ATTENTION_MARKERS):
        return "attention"
    return "other"


def _allocation_trace(prof) -> list[tuple[int, int]]:
    """(time_ns, bytes) of every allocation (+) and free (-) the profiler recorded.
    Uses the profiler's event tree, which carries the allocator's records."""
    try:
        from torch._C._profiler import _EventType
        tree = prof.profiler.kineto_results.experimental_event_tree()
    except Exception:  # noqa: BLE001 - a private API; its absence only loses CPU peaks
        return []
    out = []
    stack = list(tree)
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if getattr(f, "device", torch.device("cpu")).type == "cpu":
                out.append((e.start_time_ns, int(f.alloc_size)))
        stack.extend(e.children)
    out.sort()
    return out


def profile_pass(fn: Callable[[], object], clock: Clock, memory: bool) -> tuple[OpProfile, object]:
    """Run ``fn`` once under ``torch.profiler``: time by operator category and, on CPU
    with ``memory``, the allocation peak."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    clock.sync()
    with quiet_native_stderr():
        with profile(activities=activities, profile_memory=memory and not clock.cuda) as prof:
            t0 = time.perf_counter()
            out = fn()
            clock.sync()
            wall_us = (time.perf_counter() - t0) * 1e6
    by_cat = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        if not evt.key.startswith("aten::"):
            continue
        if clock.cuda:
            # Kernel time attributed to the operator that launched it (older torch: "cuda").
            t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        else:
            t = evt.self_cpu_time_total
        by_cat[_category(evt.key)] += float(t) / 1e3
    times = {f"{k}_ms": v for k, v in by_cat.items()}
    times["profiled_ms"] = wall_us / 1e3
    peak = end = None
    if memory and not clock.cuda:
        trace = _allocation_trace(prof)
        if trace:
            cur = top = 0
            for _t, nbytes in trace:
                cur += nbytes
                top = max(top, cur)
            peak, end = float(top), float(cur)
    return OpProfile(times_ms=times, peak_bytes=peak, end_bytes=end), out


def repeat_timed(policy: RepeatPolicy, step) -> dict[str, list[float]]:
    """Run ``step`` (which times several things and returns their seconds by name) after
    warm-up, until the policy's count and time are both met; the samples by name."""
    # Warm up by count and by time: the first runs in a process also pay for thread
    # pools, page faults and kernel caches that a few tiny runs do not exhaust.
    t0 = time.perf_counter()
    n = 0
    while n < policy.warmup or (n < policy.max_repeats and time.perf_counter() - t0 < policy.min_time_s / 2):
        step()
        n += 1
    samples: dict[str, list[float]] = {}
    spent, n, glitches = 0.0, 0, 0
    while n < policy.repeats or (spent < policy.min_time_s and n < policy.max_repeats):
        got = step()
        if any(not v > 0 for v in got.values()) and glitches < policy.max_repeats:
            # No work takes no time: a zero reading is the CPU clock's glitch (seen once in a
            # long while with the thread clock), and kept it would be the minimum, a time the
            # profile file cannot hold. The step is timed again instead.
            glitches += 1
            continue
        for k, v in got.items():
            samples.setdefault(k, []).append(v)
        spent += sum(got.values())
        n += 1
    return samples
