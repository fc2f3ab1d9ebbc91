"""Least-squares fits: roofline efficiencies from measured layers, and alpha-beta link
models from measured collectives.

Efficiencies. The roofline of :func:`costmodel.compute.roofline_timing` is, per pass,
nearly

    t = G / matmul + A / attention + M / memory + K * launch_s

where G is the layer's GEMM time at 100% of peak, A its fused-attention time at peak,
M its bandwidth-bound bytes over the device's bandwidth and K its kernel count. The
terms are obtained from ``roofline_timing`` itself (by making all but one efficiency
infinitely large), so the fit stays true to whatever the roofline does, and the
reciprocals of the efficiencies are then linear unknowns. Each measured pass gives
one equation, or three when the per-operator profile splits its time into GEMM,
attention and the rest, which is what makes the unknowns separately identifiable
(the profiler's own per-operator cost inflates small passes, so only the GEMM and
attention operator times are taken from it; the rest is the unprofiled time less them).
Rows are divided by the measured time (every layer counts equally, small or large);
a weak prior row per unknown pulls an efficiency that the data cannot see (e.g.
attention on a model without fused attention) to its catalog default. Non-negative
least squares keeps every reciprocal >= 0. That linear solution then starts a
non-linear least-squares fit of ``roofline_timing`` itself (see :func:`fit_efficiency`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from autoplan.catalog import DeviceSpec, is_accelerator
from autoplan.models.spec import LayerSpec
from costmodel.compute import roofline_timing
from costmodel.efficiency import Efficiency, default_efficiency

_BIG = 1e12
"""An efficiency so large that its term vanishes: isolates one term of the roofline."""
PRIOR_WEIGHT = 0.1
"""Strength of the pull towards the catalog default, relative to the data on each unknown."""
UNKNOWNS = ("matmul", "attention_fwd", "attention_bwd", "memory", "launch_s")


@dataclass(frozen=True)
class MeasuredLayer:
    """One profile entry as the fit sees it."""

    spec: LayerSpec
    """The planner's spec of the unit (full width; ``tp`` picks the shard)."""
    tp: int
    """Tensor-parallel degree whose shard was measured."""
    micro_batch: int
    """Samples per micro-batch."""
    dtype: str
    """Compute dtype of the measurement."""
    forward_s: float
    """Measured forward seconds."""
    backward_s: float
    """Measured backward seconds."""
    ops_forward: dict = field(default_factory=dict, hash=False)
    """Milliseconds of the forward's operators by category ('gemm_ms', 'attention_ms', ...),
    from the per-operator profile; empty when not recorded."""
    ops_backward: dict = field(default_factory=dict, hash=False)
    """The same for the backward."""


@dataclass(frozen=True)
class EfficiencyFit:
    """A fitted :class:`Efficiency` and how well it explains the measurements."""

    device: str
    """Catalog name of the profiled device."""
    efficiency: Efficiency
    """The fitted efficiencies (tile and k_half stay the family defaults)."""
    layers: int
    """Measured entries used."""
    rows: int
    """Equations in the least-squares problem."""
    error_default: float
    """Median |predicted/measured - 1| of forward+backward with the catalog defaults."""
    error_fitted: float
    """The same with the fitted efficiencies."""
    warnings: tuple[str, ...] = ()
    """What looks off, e.g. an efficiency above 1 (a catalog peak below what was measured)."""

    def describe(self) -> str:
        e = self.efficiency
        return (f"{self.device}: matmul {e.matmul:.3g}, attention {e.attention_fwd:.3g}/{e.attention_bwd:.3g}, "
                f"memory {e.memory:.3g}, launch {e.launch_s * 1e6:.3g} us from {self.layers} layers "
                f"(median error {self.error_default:.0%} with defaults -> {self.error_fitted:.0%})")


def _terms(device: DeviceSpec, base: Efficiency, m: MeasuredLayer) -> tuple[np.ndarray, np.ndarray]:
    """(forward terms, backward terms), each over UNKNOWNS (reciprocals; launch per kernel)."""
    def run(**kw):
        eff = dataclasses.replace(base, **{"matmul": _BIG, "attention_fwd": _BIG, "attention_bwd": _BIG,
                                           "memory": _BIG, "launch_s": 0.0, **kw})
        return roofline_timing(device, eff, m.spec, m.micro_batch, m.tp, False, m.dtype)
    g = run(matmul=1.0)
    a = run(attention_fwd=1.0, attention_bwd=1.0)
    mem = run(memory=1.0)
    fwd = np.array([g.forward, a.forward, 0.0, mem.forward, float(m.spec.kernels_fwd)])
    bwd = np.array([g.backward, 0.0, a.backward, mem.backward, float(m.spec.kernels_bwd)])
    return fwd, bwd


def _rows(terms: np.ndarray, total: float, ops: dict) -> list[tuple[np.ndarray, float]]:
    """Equations of one pass, each divided by the pass's measured time. With a
    per-operator profile: GEMM time, attention time, and the rest (the measured time
    less those two: bandwidth-bound kernels and per-operator overhead) separately."""
    if total <= 0:
        return []
    if ops and "gemm_ms" in ops and "attention_ms" in ops:
        gemm, attn = ops["gemm_ms"] / 1e3, ops["attention_ms"] / 1e3
        rest = max(0.0, total - gemm - attn)
        out = []
        for target, cols in ((gemm, (0,)), (attn, (1, 2)), (rest, (3, 4))):
            row = np.zeros_like(terms)
            row[list(cols)] = terms[list(cols)]
            # A kind of work the roofline gives nothing to and the profile under 2% of the
            # layer is noise (a timer's rounding): no equation for it.
            if row.any() or target > 0.02 * total:
                out.append((row / total, target / total))
        return out
    return [(terms / total, 1.0)]


def _as_x(eff: Efficiency) -> np.ndarray:
    return np.array([1 / eff.matmul, 1 / eff.attention_fwd, 1 / eff.attention_bwd, 1 / eff.memory, eff.launch_s])


def _linear_start(device: DeviceSpec, base: Efficiency, measured: list[MeasuredLayer]) -> np.ndarray:
    """Reciprocal efficiencies (and launch seconds) from the linear model, by non-negative
    least squares: the starting point of the exact fit."""
    x0 = _as_x(base)
    rows, targets = [], []
    for m in measured:
        f, b = _terms(device, base, m)
        for terms, t, ops in ((f, m.forward_s, m.ops_forward), (b, m.backward_s, m.ops_backward)):
            for row, target in _rows(terms, t, ops):
                rows.append(row)
                targets.append(target)
    if not rows:
        return x0
    # Columns differ by orders of magnitude (seconds per kernel vs reciprocal
    # efficiencies): solve in units where the default is 1.
    col = np.where(x0 > 0, x0, 1.0)
    A = np.vstack(rows) * col
    prior_rows = []
    for j in range(len(UNKNOWNS)):
        # The prior counts PRIOR_WEIGHT^2 of the information the data hold on this
        # unknown, or decides it alone when no measured layer exercises it.
        norm = float(np.linalg.norm(A[:, j]))
        row = np.zeros(len(UNKNOWNS))
        row[j] = PRIOR_WEIGHT * norm if norm > 0 else 1.0
        prior_rows.append(row)
    A = np.vstack([A, *prior_rows])
    y = np.concatenate([np.array(targets), [r.max() for r in prior_rows]])
    z, _res = nnls(A, y)
    return z * col


def _efficiency_of(base: Efficiency, logs: np.ndarray) -> Efficiency:
    return dataclasses.replace(base, **{name: float(math.exp(v)) for name, v in zip(UNKNOWNS, logs)})


def fit_efficiency(device: DeviceSpec, measured: list[MeasuredLayer]) -> EfficiencyFit | None:
    """Fit the roofline efficiencies of ``device`` to its measured layers (None if none;
    the catalog defaults, with a warning, if the fit explains them no better).

    The linear model above gives the start; the answer minimises, over the logarithms
    of the efficiencies, the relative error of ``roofline_timing`` itself against every
    measured pass (and of its GEMM and attention parts against the per-operator
    profile), so effects the linear form ignores (a GEMM is the slower of its compute
    and its memory traffic) are fitted too."""
    from scipy.optimize import least_squares

    if not measured:
        return None
    base = default_efficiency(device.name)
    x_lin = _linear_start(device, base, measured)
    defaults = np.array([math.log(getattr(base, n)) for n in UNKNOWNS])
    start = []
    for j, name in enumerate(UNKNOWNS):
        v = x_lin[j]
        value = v if name == "launch_s" else (1.0 / v if v > 0 else 0.0)
        start.append(math.log(min(max(value, 1e-9 if name == "launch_s" else 1e-4), 1e3)) if value > 0
                     else defaults[j])
    big = {"matmul": _BIG, "attention_fwd": _BIG, "attention_bwd": _BIG, "memory": _BIG, "launch_s": 0.0}
    has_ops = any(m.ops_forward or m.ops_backward for m in measured)

    def residuals(logs: np.ndarray) -> np.ndarray:
        eff = _efficiency_of(base, logs)
        out = []
        only_mm = dataclasses.replace(eff, **{**big, "matmul": eff.matmul})
        only_att = dataclasses.replace(eff, **{**big, "attention_fwd": eff.attention_fwd,
                                               "attention_bwd": eff.attention_bwd})
        for m in measured:
            t = roofline_timing(device, eff, m.spec, m.micro_batch, m.tp, False, m.dtype)
            out += [t.forward / m.forward_s - 1, t.backward / m.backward_s - 1]
            if has_ops:
                mm = roofline_timing(device, only_mm, m.spec, m.micro_batch, m.tp, False, m.dtype)
                at = roofline_timing(device, only_att, m.spec, m.micro_batch, m.tp, False, m.dtype)
                for part, ops, total, key in ((mm.forward, m.ops_forward, m.forward_s, "gemm_ms"),
                                              (mm.backward, m.ops_backward, m.backward_s, "gemm_ms"),
                                              (at.forward, m.ops_forward, m.forward_s, "attention_ms"),
                                              (at.backward, m.ops_backward, m.backward_s, "attention_ms")):
                    if key in ops:
                        out.append((part - ops[key] / 1e3) / total)
        # A weak pull toward the defaults (0.02 per unit of log efficiency, against 1 per unit
        # of relative error of each measured layer): it holds an efficiency that no profile
        # constrains at its default and is outweighed wherever one does.
        out += list(PRIOR_WEIGHT * 0.2 * (logs - defaults))
        return np.array(out)

    # soft_l1: a few layers the roofline cannot describe (a CPU's tiny, overhead-bound
    # kernels next to large compute-bound ones) must not drag every efficiency with them.
    sol = least_squares(residuals, np.array(start), method="trf", loss="soft_l1", f_scale=0.1, max_nfev=200)
    fitted = _efficiency_of(base, sol.x)
    warnings = []
    for name in UNKNOWNS[:-1]:
        if getattr(fitted, name) > 1.0:
            warnings.append(f"{name} efficiency {getattr(fitted, name):.2f} exceeds 1: the catalog's peak "
                            f"for {device.name} is below what was measured")

    def err(eff: Efficiency) -> float:
        rel = []
        for m in measured:
            t = roofline_timing(device, eff, m.spec, m.micro_batch, m.tp, False, m.dtype)
            rel.append(abs((t.forward + t.backward) / (m.forward_s + m.backward_s) - 1))
        return float(np.median(rel))
    rows = len(residuals(sol.x))
    e_default, e_fitted = err(base), err(fitted)
    if e_fitted > e_default:
        # A fit that explains the measurements worse than the catalog is no calibration.
        warnings.append(f"the fit ({e_fitted:.0%} median error) does no better than the catalog defaults "
                        f"({e_default:.0%}); keeping the defaults")
        fitted, e_fitted = base, e_default
    return EfficiencyFit(device=device.name, efficiency=fitted, layers=len(measured), rows=rows,
                         error_default=e_default, error_fitted=e_fitted, warnings=tuple(warnings))


def calibrates(profiled: DeviceSpec, target: DeviceSpec) -> bool:
    """Whether a profile of ``profiled`` says anything about ``target``: same vendor (named)
    and same class (CPU or GPU)."""
    def cls(d: DeviceSpec) -> tuple[str, bool]:
        return d.vendor.lower(), not is_accelerator(d.name)
    return bool(profiled.vendor) and cls(profiled) == cls(target)


def transfer_efficiency(target: DeviceSpec, fits: list[tuple[DeviceSpec, EfficiencyFit]]) -> Efficiency | None:
    """Efficiencies for a device that was never profiled, from devices that were.

    What a profile adds over the catalog defaults is mostly the software stack's
    behaviour (library version, kernel choice, eager launch overhead), which devices
    of one vendor and one class (GPU or CPU) share. So the target's own defaults are
    scaled by the geometric mean, over profiled devices of the same vendor and class,
    of fitted / default. Across vendors or between CPU and GPU nothing transfers."""
    peers = [(d, f) for d, f in fits if calibrates(d, target)]
    if not peers:
        return None
    base = default_efficiency(target.name)
    values = {}
    for name in UNKNOWNS:
        logs = []
        for d, f in peers:
            ref = getattr(default_efficiency(d.name), name)
            got = getattr(f.efficiency, name)
            if ref > 0 and got > 0:
                logs.append(math.log(got / ref))
        ratio = math.exp(sum(logs) / len(logs)) if logs else 1.0
        v = getattr(base, name) * ratio
        values[name] = v if name == "launch_s" else min(v, 1.0)
    return dataclasses.replace(base, **values)


# ------------------------------------------------------------------ alpha-beta
@dataclass(frozen=True)
class AlphaBeta:
    """t(bytes) = latency + moved(bytes) / bandwidth, fitted over a size sweep."""

    latency_s: float
    """Per-step latency (alpha)."""
    bandwidth: float | None
    """Achieved bytes/s (beta), as the cost model's ring formulas count bytes; None when
    the sweep could not resolve it (the time did not grow with the message size, e.g.
    sizes too small for the link, or noise from other load larger than the transfer)."""
    rms_rel_error: float
    """Root-mean-square relative error of the fit over its samples."""
    samples: int
    """Measurements fitted."""

    @property
    def resolved(self) -> bool:
        return self.bandwidth is not None

    def to_dict(self) -> dict:
        out = {"latency_us": self.latency_s * 1e6,
               "bandwidth_GBps": self.bandwidth / 1e9 if self.bandwidth is not None else None,
               "rms_rel_error": self.rms_rel_error, "points": self.samples}
        if self.bandwidth is None:
            out["note"] = ("bandwidth not resolvable at these sizes: the time did not grow with the message "
                           "size; measure larger messages (--link-sizes) on a quieter machine")
        return out


MIN_BANDWIDTH_TIME_SHARE = 0.05
"""The bandwidth term must explain at least this share of the largest message's time to
count as measured; below it the fitted 1/beta is noise (and its inverse meaningless)."""


def fit_alpha_beta(steps: list[float], moved: list[float], times: list[float]) -> AlphaBeta:
    """Least squares of ``t = steps * alpha + moved / beta`` (alpha, 1/beta >= 0), each
    sample weighted by 1/t so small messages (latency) and large ones (bandwidth) count
    alike. ``steps`` and ``moved`` are what the cost model's formula multiplies alpha
    and 1/beta by for that sample (see :mod:`costmodel.comm`)."""
    A = np.column_stack([np.asarray(steps, float), np.asarray(moved, float)])
    t = np.asarray(times, float)
    w = 1.0 / t
    # Columns in natural units: alpha in microseconds, 1/beta in seconds per GB.
    scale = np.array([1e-6, 1e-9])
    sol, _ = nnls(A * scale * w[:, None], t * w)
    alpha, inv_beta = sol * scale
    pred = A @ np.array([alpha, inv_beta])
    rms = float(np.sqrt(np.mean((pred / t - 1) ** 2)))
    largest = int(np.argmax(A[:, 1]))
    resolved = inv_beta > 0 and A[largest, 1] * inv_beta >= MIN_BANDWIDTH_TIME_SHARE * t[largest]
    return AlphaBeta(latency_s=float(alpha), bandwidth=float(1 / inv_beta) if resolved else None,
                     rms_rel_error=rms, samples=len(t))
