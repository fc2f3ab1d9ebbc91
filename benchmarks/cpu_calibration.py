"""Predict -> measure -> calibrate on the only hardware CI has: CPU ranks on gloo.

Runs a set of plans of a tiny model with ``autoplan run`` on one CPU rank (real
training, timed by the training thread's CPU time so other jobs on the machine do not
distort it), then:

1. compares the uncalibrated cost model with what was measured;
2. fits a calibration (``autoplan calibrate``) on the *fitting* plans and predicts the
   *held-out* plans with it (the two sets are listed in the report);
3. reports the leave-one-out error over all plans.

Writes ``<out>/cpu_calibration.md``, the run records and the calibration.

    python benchmarks/cpu_calibration.py            # 8 plans of gpt-tiny on one CPU rank
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoplan import models  # noqa: E402
from autoplan.cluster import Cluster  # noqa: E402
from autoplan.plan import Plan  # noqa: E402

ONE_RANK = Cluster.homogeneous("CPU", 1, 1)

PLANS = [
    # name, plan keywords; the first FIT fit the calibration, the rest are held out
    ("mb2x2", dict(micro_batch=2, global_batch=4)),
    ("mb8x2", dict(micro_batch=8, global_batch=16)),
    ("mb4x4-full", dict(micro_batch=4, global_batch=16, recompute="full")),
    ("mb2x8", dict(micro_batch=2, global_batch=16)),
    ("mb4x2", dict(micro_batch=4, global_batch=8)),
    ("mb8x1-full", dict(micro_batch=8, global_batch=8, recompute="full")),
    ("mb16x2", dict(micro_batch=16, global_batch=32)),
    ("mb4x4-selective", dict(micro_batch=4, global_batch=16, recompute="selective")),
]
FIT = 4


def run_plans(model: str, seq_len: int, steps: int, out: Path) -> list[Path]:
    """Each plan trained by `autoplan run` on one CPU rank, timed by the training thread's
    CPU time (so other jobs on the machine do not distort the figures)."""
    spec = models.get(model, dtype="fp32", seq_len=seq_len)
    records = []
    for name, kw in PLANS:
        plan = Plan.uniform(spec, ONE_RANK, tp=1, pp=1, dp=1, dtype="fp32", **kw)
        plan_path, record = out / f"plan-{name}.json", out / f"run-{name}.json"
        plan.save(plan_path)
        cmd = [sys.executable, "-m", "autoplan", "run", str(plan_path), "--model", model, "--seq-len", str(seq_len),
               "--steps", str(steps), "--out", str(record), "--no-resume", "--log-every", "0", "--clock", "thread"]
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not record.exists():
            raise SystemExit(f"{name}: autoplan run failed ({done.returncode}):\n{done.stderr[-2000:]}")
        print(f"  ran {name:16s} {plan.describe()}  ({time.monotonic() - t0:.0f} s)", flush=True)
        records.append(record)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_calibration"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    records = run_plans(args.model, args.seq_len, args.steps, out)
    report = evaluate(records, out)
    report += f"\n({len(records)} plans measured and calibrated in {time.monotonic() - t0:.0f} s; command: " \
              f"`python benchmarks/cpu_calibration.py {' '.join(sys.argv[1:] if argv is None else argv)}`)\n"
    path = out / "cpu_calibration.md"
    path.write_text(report)
    print(report)
    print(f"wrote {path}")
    return 0


def evaluate(records: list[Path], out: Path) -> str:
    """Held-out and leave-one-out errors of calibrations fitted on these run records."""
    from autoplan.calibrate import calibrate, runs_from_records
    from costmodel import estimate

    runs = runs_from_records(records)
    fitting, held_out = runs[:FIT], runs[FIT:]
    cal, _ = calibrate(fitting)
    cal.save(out / "calibration-fitting-half.json")
    full, loo_rows = calibrate(runs)
    full.save(out / "calibration.json")
    lines = ["# Cost model on CPU ranks: predicted, measured and calibrated", "",
             "Plans of a tiny model trained with `autoplan run --clock thread` (one CPU rank, fp32) on this machine. "
             "The calibration is fitted on the *fitting* plans only and predicts the *held-out* ones.", "",
             "| plan | set | measured s | uncalibrated s | ratio | calibrated s | error |", "|---|---|---:|---:|---:|---:|---:|"]
    errors = []
    for r in runs:
        base = estimate(r.model, r.cluster, r.plan, stack=r.stack).iteration_time_s
        pred = estimate(r.model, r.cluster, r.plan, stack=r.stack, calibration=cal).iteration_time_s
        err = r.step_time_s / pred - 1
        held = r in held_out
        if held:
            errors.append(err)
        lines.append(f"| {r.plan.describe()} | {'held-out' if held else 'fitting'} | {r.step_time_s:.4f} | "
                     f"{base:.4f} | {r.step_time_s / base:.1f}x | {pred:.4f} | {err:+.1%} |")
    (d, c), = cal.devices.items()
    lines += ["", f"Fitted on {len(fitting)} plans: {d}: compute x{c.compute_scale:.3g}, {c.launch_s * 1e6:.3g} us "
              f"per kernel, {(c.step_overhead_s or 0.0) * 1e3:.3g} ms per step.",
              f"Held-out plans: mean |error| **{sum(abs(e) for e in errors) / len(errors):.1%}**, worst "
              f"**{max(abs(e) for e in errors):.1%}** over {len(errors)} plans.",
              f"Leave-one-out over all {len(runs)} plans (`autoplan calibrate --runs ...`): mean |error| "
              f"{full.loo_time_mape:.1%}, 80% within [{full.time_error[0]:+.1%}, {full.time_error[1]:+.1%}]."]
    (out / "summary.json").write_text(json.dumps({"held_out_errors": errors, "loo_mape": full.loo_time_mape,
                                                  "rows": loo_rows}, indent=1, default=str) + "\n")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
