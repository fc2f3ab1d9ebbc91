"""Where a real training step's time goes on one GPU, next to what the cost model says.

Each plan (one model, micro-batch, recompute; autoplan's own runtime on one GPU, an
NCCL process group of one rank) trains a few warm-up steps, then a few steps under
``torch.profiler``. From the trace: the step's wall time, the time the GPU was busy (the
union of its kernels' intervals), the kernel count, and the kernels' time by kind (GEMMs,
fused attention, optimizer, collectives, and the rest: bandwidth-bound kernels). Beside
them, for the same plan and stack ``autoplan``, the cost model's iteration time, its
optimizer part, and its compute split into the same kinds (the roofline's GEMM,
attention, bandwidth-bound and launch seconds).

Each kernel is also counted to the phase that launched it (the forwards of all
micro-batches, their backwards with any recomputation, or the optimizer step with the
gradient norm), with the host time each phase took.

A step whose wall time is well above its busy time waits on the host (Python, the
dispatcher, autocast and DTensor) rather than on the GPU; a kind whose measured seconds
are well above its predicted ones is where the model is optimistic.

    python benchmarks/gpu_step_profile.py --out benchmarks/results/gpu/h100
    python benchmarks/gpu_step_profile.py --check benchmarks/results/gpu/h100/step_profile.csv   # no GPU
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks" / "published"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autoplan  # noqa: E402
from autoplan import models  # noqa: E402
from autoplan.cluster import Cluster  # noqa: E402
from autoplan.models.presets import get_config  # noqa: E402
from autoplan.plan import Plan  # noqa: E402
from autoplan.stacks import get_stack  # noqa: E402

KINDS = ("gemm", "attention", "optimizer", "collective", "bandwidth")
"""Kinds of kernel, as :func:`kernel_kind` names them (``bandwidth``: everything else)."""

# (model, sequence length, micro-batch, recompute): small and mid-sized models, where the
# measured steps of benchmarks/results/gpu/*/memory_runs.csv are furthest from the model.
# Three micro-batch sizes per model separate what grows with the micro-batch (activations)
# from what does not (per-parameter work); the short sequences leave the GPU idle, so their
# steps time the host.
DEFAULT_PLANS = (
    ("gpt3-2.7b", 2048, 1, "none"),     # (the largest first, before the allocator holds others)
    ("gpt3-2.7b", 2048, 2, "none"),
    ("gpt3-2.7b", 2048, 4, "full"),
    ("gpt2-medium", 1024, 4, "none"),
    ("gpt2-medium", 1024, 8, "none"),
    ("gpt2-medium", 1024, 16, "none"),
    ("gpt2-medium", 1024, 4, "full"),
    ("gpt2-medium", 1024, 16, "full"),
    ("llama3.2-1b", 2048, 1, "none"),
    ("llama3.2-1b", 2048, 2, "none"),
    ("llama3.2-1b", 2048, 4, "none"),
    ("llama3.2-1b", 2048, 4, "full"),
    ("gpt2-medium", 128, 1, "none"),
    ("gpt2-medium", 128, 1, "full"),
    ("llama3.2-1b", 128, 1, "none"),
)
PHASES = ("forward", "forward_backward", "optimizer_step")
"""Ranges profiled in a step: the stage modules' forwards (recomputation, which runs inside
the backward, not included), the trainer's forward-and-backward phase (kernels launched in
it outside a forward are the backward's) and its optimizer step."""
REPORTED = {"forward": "forward", "forward_backward": "backward", "optimizer_step": "optimizer_step"}
"""The phase each range's own kernels are reported as."""


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name."""
    n = name.lower()
    if "nccl" in n:
        return "collective"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    if "multi_tensor_apply" in n or "foreach" in n:
        return "optimizer"
    if any(k in n for k in ("gemm", "cutlass", "cublas", "xmma", "nvjet", "matmul", "sm90_", "sm80_")):
        return "gemm"
    return "bandwidth"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def trace_kernels(trace_path: str) -> tuple[list[dict], dict[str, float]]:
    """The trace's GPU kernels, each with the phase whose range launched it (its launch's
    host time within the range), and each phase's host seconds in all."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
              if e.get("cat") == "user_annotation" and e.get("name") in PHASES]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            at = launches.get(e.get("args", {}).get("correlation"))
            inside = [(hi - lo, name) for lo, hi, name in ranges if at is not None and lo <= at <= hi]
            e["phase"] = REPORTED[min(inside)[1]] if inside else "other"   # (the innermost range)
            kernels.append(e)
    host = {REPORTED[name]: sum(hi - lo for lo, hi, n in ranges if n == name) * 1e-6 for name in PHASES}
    host["backward"] -= host["forward"]
    return kernels, host


FIT_MODEL = "llama3.2-1b"
"""The model whose sweep fits the autoplan stack's activation_traffic_scale; the others check it."""


def zoo_bandwidth_s(name: str, seq: int, micro_batch: int, micro_batches: int, device) -> float:
    """Seconds of the bandwidth-bound kernels of a step's forwards and backwards as the zoo's
    bf16 layers move them (no stack traffic), on the roofline."""
    from costmodel.compute import roofline_parts
    from costmodel.efficiency import default_efficiency
    spec = models.from_config(get_config(name, seq_len=seq), "bf16")
    eff = default_efficiency(device.name)
    return micro_batches * sum(roofline_parts(device, eff, layer, micro_batch, 1, False, "bf16")["bandwidth"]
                               for layer in spec.layers)


def traffic_fit(rows: list[dict], device) -> dict[str, dict[str, float]]:
    """Per model (full-length sequences, no recompute, several micro-batch sizes): the slope of
    the measured forward-backward bandwidth-bound seconds over the micro-batch size against
    the zoo's (the activation traffic scale), and the intercept as bytes per parameter per
    micro-batch at the device's achieved bandwidth (the weight traffic)."""
    import numpy as np
    from costmodel.efficiency import achieved_memory_bandwidth
    out = {}
    by_model: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["recompute"] == "none" and int(r["seq_len"]) >= 1024:
            by_model[r["model"]].append(r)
    for name, rs in by_model.items():
        if len({int(r["micro_batch"]) for r in rs}) < 2:
            continue
        m = [int(r["accumulation"]) for r in rs]
        mb = np.array([int(r["micro_batch"]) for r in rs], dtype=float)
        measured = np.array([float(r["forward_bandwidth_s"]) + float(r["backward_bandwidth_s"]) for r in rs])
        zoo = np.array([zoo_bandwidth_s(name, int(r["seq_len"]), int(r["micro_batch"]), k, device)
                        for r, k in zip(rs, m)])
        slope, intercept = np.polyfit(mb, measured, 1)
        zoo_slope = np.polyfit(mb, zoo, 1)[0]
        params = models.from_config(get_config(name, seq_len=int(rs[0]["seq_len"])), "bf16").num_params
        out[name] = {"activation_traffic_scale": float(slope / zoo_slope),
                     "weight_bytes_per_param_per_micro_batch":
                         float(intercept * achieved_memory_bandwidth(device) / params / m[0])}
    return out


def predicted(model, cluster, plan) -> dict:
    from decompose import compute_split
    est = autoplan.estimate(model, cluster, plan, stack="autoplan")
    stack = get_stack("autoplan")
    device = cluster.slots[0].device
    split = compute_split(device, model.layers, plan.micro_batch, plan.tp, plan.sequence_parallel, stack,
                          plan.dtype)
    m = plan.global_batch // plan.micro_batch
    out = {"predicted_step_s": est.iteration_time_s, "predicted_optimizer_s": est.breakdown["optimizer"],
           "predicted_compute_s": est.breakdown["compute"]}
    out.update({f"predicted_{k}_s": m * v for k, v in split.items()})
    return out


def _annotated(method, name: str):
    """``method`` run inside a profiler range called ``name``."""
    def run(*args, **kwargs):
        with torch.profiler.record_function(name):
            return method(*args, **kwargs)
    return run


def profile_one(name: str, seq: int, mb: int, recompute: str, accumulation: int, warmup: int, steps: int,
                cluster: Cluster, top: list[dict]) -> dict:
    from autoplan.runtime.trainer import Trainer, TrainOptions
    from torch.profiler import ProfilerActivity, profile
    cfg = get_config(name, seq_len=seq)
    spec = models.from_config(cfg, "bf16")
    plan = Plan.uniform(spec, cluster, tp=1, pp=1, dp=1, micro_batch=mb, global_batch=mb * accumulation,
                        recompute=recompute)
    row = {"model": name, "seq_len": seq, "micro_batch": mb, "accumulation": accumulation,
           "recompute": recompute, **predicted(spec, cluster, plan)}
    trainer = Trainer(plan, cfg, TrainOptions(steps=warmup + steps, log_every=0), log=None)
    for phase in ("forward_backward", "optimizer_step"):
        setattr(trainer, phase, _annotated(getattr(trainer, phase), phase))
    for module in trainer.stage_modules.values():
        module.forward = _annotated(module.forward, "forward")
    try:
        # Unprofiled steps (the first left out) time the step; the profiler's own host
        # overhead slows the profiled ones.
        plain = [trainer.train_step().step_time_s for _ in range(warmup)][1:]
        times = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                times.append(trainer.train_step().step_time_s)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            kernels, host = trace_kernels(path)
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
    by_kind: dict[str, float] = defaultdict(float)
    by_phase: dict[tuple[str, str], float] = defaultdict(float)
    count_phase: dict[str, int] = defaultdict(int)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        kind = kernel_kind(k["name"]) if k["cat"] == "kernel" else "bandwidth"
        by_kind[kind] += k["dur"] * 1e-6
        by_phase[k["phase"], kind] += k["dur"] * 1e-6
        count_phase[k["phase"]] += 1
        by_name[k["name"]][0] += k["dur"] * 1e-6
        by_name[k["name"]][1] += 1
    row.update({"measured_step_s": statistics.median(plain or times), "profiled_step_s": statistics.median(times),
                "measured_busy_s": busy_seconds([(k["ts"] * 1e-6, (k["ts"] + k["dur"]) * 1e-6)
                                                 for k in kernels]) / steps,
                "kernels_per_step": len(kernels) / steps})
    row.update({f"measured_{k}_s": by_kind[k] / steps for k in KINDS})
    for phase in REPORTED.values():
        row[f"{phase}_host_s"] = host[phase] / steps
        row[f"{phase}_kernels"] = count_phase[phase] / steps
        row.update({f"{phase}_{k}_s": by_phase[phase, k] / steps for k in KINDS})
    for kname, (secs, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
        top.append({"model": name, "micro_batch": mb, "recompute": recompute, "kind": kernel_kind(kname),
                    "seconds_per_step": secs / steps, "calls_per_step": count / steps, "kernel": kname[:160]})
    return row


def check(rows: list[dict]) -> list[dict]:
    """The cost model's step for each profiled plan (stack ``autoplan``, as it stands now)
    against the plan's measured wall time, and the GPU's part of it (the step less its wait
    on the host) against the measured GPU busy time: no GPU needed, so a committed profile
    checks every later change of the model."""
    from one_gpu import one_gpu_cluster
    out = []
    for r in rows:
        cluster = one_gpu_cluster(r["device"])
        name, seq, mb = r["model"], int(r["seq_len"]), int(r["micro_batch"])
        spec = models.from_config(get_config(name, seq_len=seq), "bf16")
        plan = Plan.uniform(spec, cluster, tp=1, pp=1, dp=1, micro_batch=mb,
                            global_batch=mb * int(r["accumulation"]), recompute=r["recompute"])
        est = autoplan.estimate(spec, cluster, plan, stack="autoplan")
        predicted_s = est.iteration_time_s
        device_s = predicted_s - est.breakdown.get("host", 0.0)   # (the GPU's own work)
        out.append({"plan": f"{name} seq {seq} mb {mb} {r['recompute']}", "predicted_s": predicted_s,
                    "predicted_device_s": device_s,
                    "busy_error": float(r["measured_busy_s"]) / device_s - 1,
                    "step_error": float(r["measured_step_s"]) / predicted_s - 1})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="directory for step_profile.csv and step_profile_kernels.csv")
    p.add_argument("--check", metavar="CSV",
                   help="no profiling: compare the cost model with a profile written before (no GPU needed)")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps (the first not timed)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps per plan")
    args = p.parse_args(argv)
    if args.check:
        with open(args.check) as f:
            results = check(list(csv.DictReader(f)))
        for c in results:
            print(f"{c['plan']:34s} predicted {c['predicted_s']:.4f} s (GPU {c['predicted_device_s']:.4f} s); "
                  f"measured / predicted - 1: GPU busy {c['busy_error']:+.0%}, wall step {c['step_error']:+.0%}")
        busy = [c["busy_error"] for c in results]
        step = [c["step_error"] for c in results]
        print(f"GPU busy time / predicted GPU time - 1: {min(busy):+.0%} to {max(busy):+.0%}; wall step / "
              f"predicted step - 1: {min(step):+.0%} to {max(step):+.0%} over {len(busy)} plans")
        return 0
    if not args.out:
        p.error("--out is required (or --check CSV)")
    from one_gpu import init_one_gpu
    started = init_one_gpu("gpu_step_profile", 29562, args.out)
    if started is None:
        return 2
    device, cluster, out = started
    rows, top = [], []
    for name, seq, mb, recompute in DEFAULT_PLANS:
        try:
            row = profile_one(name, seq, mb, recompute, args.accumulation, args.warmup, args.steps, cluster, top)
        except torch.OutOfMemoryError:
            print(f"{name} seq {seq} mb {mb} {recompute}: out of memory", flush=True)
            continue
        rows.append({"device": device, **row})
        print(f"{name} seq {seq} mb {mb} {recompute}: step {row['measured_step_s']:.4f} s measured "
              f"(GPU busy {row['measured_busy_s']:.4f} s, {row['kernels_per_step']:.0f} kernels), "
              f"{row['predicted_step_s']:.4f} s predicted; "
              + ", ".join(f"{k} {row[f'measured_{k}_s']:.4f}" for k in KINDS), flush=True)
    for name, fit in traffic_fit(rows, cluster.slots[0].device).items():
        print(f"{name} ({'fitting' if name == FIT_MODEL else 'checking'}): activation traffic "
              f"{fit['activation_traffic_scale']:.2f}x the zoo's, weight traffic "
              f"{fit['weight_bytes_per_param_per_micro_batch']:.0f} B per parameter per micro-batch")
    for fname, table in (("step_profile.csv", rows), ("step_profile_kernels.csv", top)):
        with (out / fname).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            for r in table:
                w.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
