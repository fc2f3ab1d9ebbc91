"""Fit a :class:`costmodel.calibration.Calibration` from measured runs.

Measured runs come from run records (``autoplan run --out run.json``) or from a CSV with
one run per row. Each run is estimated with the uncalibrated cost model; then, per
device type, three parameters are fitted by least squares on log(measured/predicted)
step time -- a compute scale, a fixed cost per kernel and a fixed cost per step
(host-side work the roofline does not see: Python, the optimizer's per-tensor loops,
synchronisation; on a CPU they add to its compute, on an accelerator the host runs beside
the device, ``costmodel.host``) -- and, where peak memory was measured on a GPU, an activation scale
and a constant overhead per rank. Each run is then predicted by a calibration fitted on
all the *other* runs (leave-one-out), which is the error the calibration reports and
the interval its estimates carry.

CSV columns (one row per run; ``status`` is ``ok`` or ``oom``):
``model, seq_len, device, gpus_per_node, nodes, tp, pp, dp, micro_batch, global_batch,
schedule, virtual_stages, recompute, sequence_parallel, zero, dtype, stack, status,
step_time_s, peak_memory_GiB`` (``gpus_per_node``, ``nodes``, ``schedule``,
``virtual_stages``, ``sequence_parallel``, ``dtype``, ``stack`` and the two measurements
may be left out or empty; other columns are ignored, one spelled almost like these refused).
"""
from __future__ import annotations

import csv
import difflib
import dataclasses
import datetime
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autoplan.catalog import is_accelerator
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.models.spec import ModelSpec
from autoplan.plan import Plan
from autoplan.stacks import DEFAULT_STACK, Stack, get_stack
from autoplan.units import GiB
from costmodel.calibration import Calibration, DeviceCalibration
from costmodel.host import HOST_OVERLAP_NORM, with_host

MIN_RUNS = 2
"""Fewest measured runs with a step time a calibration is fitted from. With fewer than four,
the cost per kernel keeps its default (the device family's launch cost on a CPU, the stack's
host cost per kernel on a GPU) and only the compute scale and the cost per step are fitted
(two parameters need two runs)."""
FULL_FIT_RUNS = 4
"""Runs from which all three timing parameters are fitted."""
CSV_REQUIRED = ("model", "seq_len", "device", "tp", "pp", "dp", "micro_batch", "global_batch", "recompute",
                "zero", "status")
CSV_OPTIONAL = ("gpus_per_node", "nodes", "schedule", "virtual_stages", "sequence_parallel", "dtype", "stack",
                "step_time_s", "peak_memory_GiB", "peak_reserved_GiB", "device_used_GiB")
"""Columns read when present (the last two are recorded by ``benchmarks/gpu_memory.py`` and
not used). Other columns are ignored, unless one is spelled almost like a known column: a
misspelt ``sequence_parallel`` would otherwise drop silently."""


@dataclass(frozen=True)
class MeasuredRun:
    """One run of a plan as measured, with everything needed to estimate it."""

    name: str
    """Where it came from (file, or file:row)."""
    model: ModelSpec
    cluster: Cluster
    plan: Plan
    stack: str
    ran: bool
    """False: the run went out of memory."""
    step_time_s: float | None
    peak_memory_bytes: float | None
    """Peak of the allocator's live tensors (GPU), None when not measured."""


def _spec(model, seq_len: int, dtype: str, stack: str) -> ModelSpec:
    from autoplan import models
    return models.for_stack(model, stack, dtype=dtype, **({"seq_len": seq_len} if seq_len else {}))


def runs_from_records(paths, stack: str | None = None) -> list[MeasuredRun]:
    """Measured runs from run records (``autoplan run --out``)."""
    from autoplan.models.config import SwinConfig, TransformerConfig
    from autoplan.profiler.environment import catalog_device_for_gpu
    from autoplan.runtime.record import MEMORY_SOURCE_CUDA, load_record

    out = []
    for path in paths:
        rec = load_record(path)
        if not rec.steps:
            raise ConfigError(f"{Path(path).name}.steps", "the run record has no measured steps",
                              "record a run with --steps larger than the step it resumed from")
        cfg = dict(rec.model.get("config") or {})
        if not cfg:
            raise ConfigError(f"{Path(path).name}.model.config", "is missing: the run's architecture is unknown")
        cls = SwinConfig if cfg.get("arch") == "swin" else TransformerConfig
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        try:
            arch = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in names})
        except TypeError as e:
            raise ConfigError(f"{Path(path).name}.model.config", f"does not describe a zoo model ({e})") from None
        env = rec.environment
        world = int(env.get("world_size", rec.plan.num_gpus))
        names_ = sorted(set(env.get("device_names") or ["cpu"]))
        if env.get("device_type") == "cuda":
            device = catalog_device_for_gpu(names_[0], 0.0)
        else:
            device = "CPU"
        nodes = max(1, int(env.get("num_nodes", 1) or 1))
        cluster = Cluster.homogeneous(device, nodes, max(1, world // nodes))
        stack_name = stack or DEFAULT_STACK
        get_stack(stack_name)
        dtype = rec.plan.dtype if env.get("device_type") == "cuda" else "fp32"
        plan = dataclasses.replace(rec.plan, dtype=dtype)
        gpu_memory = bool(rec.memory) and rec.memory[0].memory_source == MEMORY_SOURCE_CUDA
        # The fastest step after the first (which pays for set-up): on a shared machine other
        # work only ever adds time to a step, so the fastest is the least disturbed.
        times = [s.step_time_s for s in rec.steps]
        step = min(times[1:] or times)
        out.append(MeasuredRun(name=Path(path).name, model=_spec(arch, 0, dtype, stack_name), cluster=cluster,
                               plan=plan, stack=stack_name, ran=True, step_time_s=step,
                               peak_memory_bytes=float(rec.peak_memory_bytes) if gpu_memory else None))
    return out


def runs_from_csv(path, stack: str | None = None) -> list[MeasuredRun]:
    """Measured runs from a CSV (see the module docstring for its columns)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "CSV of measured runs not found") from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), "is not UTF-8 text") from None
    rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ConfigError(str(path), "has no rows", "one run per row under a header line")
    known = CSV_REQUIRED + CSV_OPTIONAL
    for column in rows[0]:
        close = difflib.get_close_matches(column or "", known, n=1, cutoff=0.8) if column not in known else []
        if close:
            raise ConfigError(f"{path.name}: column {column!r}", "is not a column autoplan reads",
                              f"did you mean {close[0]!r}?")
    missing = [c for c in CSV_REQUIRED if c not in rows[0]]
    if missing:
        raise ConfigError(f"{path.name}: column {missing[0]!r}", "is missing",
                          f"required columns: {', '.join(CSV_REQUIRED)}")
    out = []
    for i, row in enumerate(rows, start=2):
        where = f"{path.name}:{i}"

        def num(key, cast=int, default=None, minimum=None):
            raw = (row.get(key) or "").strip()
            if raw == "":
                if default is None:
                    raise ConfigError(f"{where}.{key}", "is empty")
                return default
            try:
                v = cast(float(raw)) if cast is int else cast(raw)
            except ValueError:
                raise ConfigError(f"{where}.{key}", f"is not a number: {raw!r}") from None
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{where}.{key}", f"must be finite, got {raw!r}")
            if minimum is not None and v < minimum:
                raise ConfigError(f"{where}.{key}", f"must be >= {minimum}, got {raw!r}")
            return v
        status = (row.get("status") or "").strip().lower()
        if status not in ("ok", "oom"):
            raise ConfigError(f"{where}.status", f"is {status!r}", "use 'ok' (it ran) or 'oom' (out of memory)")
        stack_name = (row.get("stack") or "").strip() or stack or DEFAULT_STACK
        get_stack(stack_name)
        dtype = (row.get("dtype") or "").strip() or "bf16"
        nodes = num("nodes", default=1, minimum=1)
        tp, pp, dp = num("tp", minimum=1), num("pp", minimum=1), num("dp", minimum=1)
        per_node = num("gpus_per_node", default=max(1, tp * pp * dp // nodes), minimum=1)
        device = (row.get("device") or "").strip()
        try:
            from autoplan.catalog import get_device
            get_device(device)
        except ConfigError:
            from autoplan.profiler.environment import catalog_device_for_gpu
            device = catalog_device_for_gpu(device, 0.0).name
        cluster = Cluster.homogeneous(device, nodes, per_node)
        model = _spec((row.get("model") or "").strip(), num("seq_len", minimum=1), dtype, stack_name)
        v = num("virtual_stages", default=1, minimum=1)
        sched = (row.get("schedule") or "").strip() or ("interleaved-1f1b" if v > 1 else "1f1b")
        plan = Plan.uniform(model, cluster, tp=tp, pp=pp, dp=dp, micro_batch=num("micro_batch", minimum=1),
                            global_batch=num("global_batch", minimum=1), schedule=sched, virtual_stages=v,
                            recompute=(row.get("recompute") or "none").strip(),
                            sequence_parallel=(row.get("sequence_parallel") or "").strip().lower() in ("1", "true", "yes"),
                            zero=num("zero", minimum=0), dtype=dtype)
        ran = status == "ok"
        step = num("step_time_s", float, default=-1.0) if ran else -1.0
        mem = num("peak_memory_GiB", float, default=-1.0) if ran else -1.0
        if ran and step <= 0 and mem <= 0:
            raise ConfigError(f"{where}.step_time_s", "a run that ran needs a step time or a peak memory")
        out.append(MeasuredRun(name=where, model=model, cluster=cluster, plan=plan, stack=stack_name, ran=ran,
                               step_time_s=step if step > 0 else None,
                               peak_memory_bytes=mem * GiB if mem > 0 else None))
    return out


# ----------------------------------------------------------------------- fitting
@dataclass
class _Decomposed:
    """One run's estimate split into the parts the parameters scale."""

    run: MeasuredRun
    device: str
    asynchronous: bool
    """The device runs kernels while its host goes on (an accelerator; ``costmodel.host``)."""
    stack: Stack
    compute: float
    """Seconds of roofline compute on the critical path (on a CPU without its launches)."""
    kernels: float
    """Kernels on the critical path (a CPU) or issued by the busiest host (an accelerator)."""
    other: float
    """Seconds the calibration does not touch (communication, optimizer, bubble ...)."""
    default_s: float
    """The uncalibrated estimate."""
    states: float
    dynamic: float
    fixed: float


def _decompose(run: MeasuredRun) -> _Decomposed:
    """Estimate a run a few times to separate compute, kernels and the rest: with compute
    doubled, and on a CPU with no launch cost and one of 1 ms (kernels on the critical
    path); on an accelerator the host's kernels are counted as the estimate counts them."""
    from costmodel import estimate
    from costmodel.estimate import EstimateOptions, host_time
    devices = {run.cluster.slots[r].device.name for g in run.plan.groups for r in g.ranks}
    device = sorted(devices)[0]
    asynchronous = is_accelerator(device)

    def cal(scale: float, launch: float) -> Calibration:
        return Calibration(stack=run.stack, devices={d: DeviceCalibration(scale, launch, 0.0) for d in devices})

    def calibrated(scale: float, launch: float) -> float:
        return estimate(run.model, run.cluster, run.plan, stack=run.stack,
                        calibration=cal(scale, launch)).iteration_time_s

    base = estimate(run.model, run.cluster, run.plan, stack=run.stack)
    t0 = calibrated(1.0, 0.0)      # CPU: no launches; accelerator: no host
    compute = max(calibrated(2.0, 0.0) - t0, 0.0)
    if asynchronous:   # (one second per kernel, none per step: the host time is the count)
        kernels = host_time(run.model, run.cluster, run.plan,
                            EstimateOptions(stack=run.stack, calibration=cal(1.0, 1.0)))
    else:
        kernels = max(calibrated(1.0, 1e-3) - t0, 0.0) / 1e-3
    g = max(base.memory_by_group, key=lambda m: m.allocated)
    return _Decomposed(run=run, device=device, asynchronous=asynchronous, stack=get_stack(run.stack),
                       compute=compute, kernels=kernels, other=max(t0 - compute, 0.0),
                       default_s=base.iteration_time_s, states=g.weights + g.gradients + g.optimizer,
                       dynamic=g.activations + g.transient, fixed=g.buffers)


def _predict_time(d: _Decomposed, scale: float, per_kernel: float, per_step: float,
                  norm: float = HOST_OVERLAP_NORM) -> float:
    """A run's step time under a compute scale and the costs per kernel and per step: on a
    CPU they add to its compute; an accelerator's host runs beside its device."""
    if d.asynchronous:
        return with_host(scale * d.compute + d.other, d.kernels * per_kernel + per_step, norm)
    return scale * (d.compute + d.kernels * per_kernel) + d.other + per_step


def _fit_time(ds: list[_Decomposed], fit_scale: bool = True,
              norm: float = HOST_OVERLAP_NORM) -> tuple[float, float, float]:
    """(compute scale, seconds per kernel, seconds per step) minimising squared log error;
    with fewer than FULL_FIT_RUNS runs the cost per kernel stays at its default
    (``_default_per_kernel``); ``fit_scale=False`` holds the compute scale at 1."""
    from scipy.optimize import least_squares

    meas = np.array([d.run.step_time_s for d in ds])
    default = _default_per_kernel(ds[0])
    full = len(ds) >= FULL_FIT_RUNS
    names = (["scale"] if fit_scale else []) + ["step_ms"] + (["kernel_us"] if full else [])

    def unpack(x):
        v = dict(zip(names, x))
        return (np.exp(v.get("scale", 0.0)), v["kernel_us"] * 1e-6 if full else default, v["step_ms"] * 1e-3)

    def resid(x):
        scale, per_kernel, per_step = unpack(x)
        return np.log(np.array([_predict_time(d, scale, per_kernel, per_step, norm) for d in ds]) / meas)

    lo = {"scale": -5.0, "step_ms": 0.0, "kernel_us": 0.0}
    hi = {"scale": 5.0, "step_ms": 1e5, "kernel_us": 1e5}
    # Several starts: where a host stays far below its device the error is flat in the
    # host's costs, so a start there would stay put.
    starts = [{"scale": 0.0, "step_ms": step, "kernel_us": kernel}
              for step in (1.0, 10.0, 100.0) for kernel in (max(default * 1e6, 1.0), 10.0, 50.0)]
    fit = min((least_squares(resid, x0=[x[n] for n in names], bounds=([lo[n] for n in names],
                                                                       [hi[n] for n in names]))
               for x in starts), key=lambda f: f.cost)
    scale, per_kernel, per_step = unpack(fit.x)
    return float(scale), float(per_kernel), float(per_step)


def fit_host(runs: list[MeasuredRun], norm: float = HOST_OVERLAP_NORM) -> tuple[float, float, float]:
    """(seconds per kernel, seconds per step, mean |relative error|) of a stack's host on
    accelerators, fitted on measured runs with the compute model as it is (scale 1): how a
    stack's ``host_s_per_kernel`` and ``host_s_per_step`` are fitted (``norm``: another way
    of combining host and device time, to compare)."""
    ds = [_decompose(r) for r in runs if r.ran and r.step_time_s]
    if len(ds) < FULL_FIT_RUNS or not all(d.asynchronous for d in ds):
        raise ConfigError("runs", f"{len(ds)} timed accelerator runs; fitting a host needs {FULL_FIT_RUNS}")
    _, per_kernel, per_step = _fit_time(ds, fit_scale=False, norm=norm)
    error = float(np.mean([abs(d.run.step_time_s / _predict_time(d, 1.0, per_kernel, per_step, norm) - 1)
                           for d in ds]))
    return per_kernel, per_step, error


def _fit_memory(ds: list[_Decomposed]) -> tuple[float, float]:
    """(activation scale, overhead bytes) with measured = states + fixed + a * dynamic + b."""
    y = np.array([d.run.peak_memory_bytes - d.states - d.fixed for d in ds])
    X = np.column_stack([[d.dynamic for d in ds], np.ones(len(ds))])
    if len(ds) == 1 or np.ptp(X[:, 0]) == 0:
        return 1.0, float(np.mean(y - X[:, 0]))
    (a, b), *_ = np.linalg.lstsq(X, y, rcond=None)
    # (Runs whose dynamic memory hardly varies can give a near-zero or negative slope; a
    # scale under 5% of the modelled activations is no physical reading of them.)
    return float(max(a, 0.05)), float(b)


def _quantiles(errors: list[float]) -> tuple[float, float]:
    if not errors:
        return (0.0, 0.0)
    return (float(np.percentile(errors, 10)), float(np.percentile(errors, 90)))


def calibrate(runs: list[MeasuredRun], command: str = "", progress=None) -> tuple[Calibration, list[dict]]:
    """Fit a calibration; returns it and a row per run (measured, predicted before, predicted
    by the leave-one-out fit)."""
    if not runs:
        raise ConfigError("runs", "no measured runs given", "pass --runs run.json ... or --csv measured.csv")
    stacks = sorted({r.stack for r in runs})
    if len(stacks) > 1:
        raise ConfigError("runs", f"mix training stacks {stacks}", "calibrate one stack at a time")
    timed = [r for r in runs if r.ran and r.step_time_s]
    if len(timed) < MIN_RUNS:
        raise ConfigError("runs", f"{len(timed)} runs with a measured step time; a calibration needs at least "
                          f"{MIN_RUNS}", "measure more plans (different micro-batches, degrees, schedules)")
    ds = []
    for i, r in enumerate(runs):
        ds.append(_decompose(r))
        if progress:
            progress(i + 1, len(runs))
    devices = sorted({d.device for d in ds})
    fitted: dict[str, DeviceCalibration] = {}
    step_overhead: dict[str, float] = {}
    for dev in devices:
        mine = [d for d in ds if d.device == dev and d.run.ran and d.run.step_time_s]
        if len(mine) < MIN_RUNS:
            raise ConfigError("runs", f"only {len(mine)} timed runs on {dev}", f"measure at least {MIN_RUNS} per device")
        scale, launch, overhead = _fit_time(mine)
        fitted[dev] = DeviceCalibration(compute_scale=scale, launch_s=launch, step_overhead_s=overhead)
        step_overhead[dev] = overhead
    mem_runs = [d for d in ds if d.run.ran and d.run.peak_memory_bytes]
    act_scale, overhead_bytes = _fit_memory(mem_runs) if len(mem_runs) >= 2 else (1.0, 0.0)

    # Leave one out.
    rows, t_err, m_err = [], [], []
    for i, d in enumerate(ds):
        row = {"run": d.run.name, "plan": d.run.plan.describe(), "ran": d.run.ran,
               "measured_s": d.run.step_time_s, "measured_GiB": (d.run.peak_memory_bytes or 0) / GiB or None,
               "default_s": d.default_s}
        others = [o for j, o in enumerate(ds) if j != i and o.device == d.device and o.run.ran and o.run.step_time_s]
        if d.run.step_time_s and len(others) >= MIN_RUNS:
            s, l_, o = _fit_time(others)
            row["loo_s"] = _predict_time(d, s, l_, o)
            t_err.append(d.run.step_time_s / row["loo_s"] - 1)
        if d.run.peak_memory_bytes:
            others_m = [o for j, o in enumerate(mem_runs) if o is not d]
            if len(others_m) >= 2:
                a, b = _fit_memory(others_m)
                row["loo_GiB"] = (d.states + d.fixed + a * d.dynamic + b) / GiB
                m_err.append(d.run.peak_memory_bytes / (row["loo_GiB"] * GiB) - 1)
        rows.append(row)
    cal = Calibration(
        stack=stacks[0], devices=fitted, activation_scale=act_scale if mem_runs else 1.0,
        memory_overhead_bytes=overhead_bytes if mem_runs else 0.0, time_error=_quantiles(t_err),
        memory_error=_quantiles(m_err), runs=len(timed),
        loo_time_mape=float(np.mean(np.abs(t_err))) if t_err else 0.0,
        loo_memory_mape=float(np.mean(np.abs(m_err))) if m_err else None,
        source={"command": command, "runs": [r.name for r in runs],
                "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    return cal, rows


def _default_per_kernel(d: _Decomposed) -> float:
    """The cost per kernel a calibration keeps when too few runs fit it: the device family's
    launch cost on a CPU, the stack's host cost on an accelerator."""
    if d.asynchronous:
        return d.stack.host_s_per_kernel
    from costmodel.efficiency import default_efficiency
    return default_efficiency(d.device).launch_s
