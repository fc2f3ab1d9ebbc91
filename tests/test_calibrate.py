"""Calibration: fitting recovers parameters from runs, held-out runs are predicted, bad
input is one clear error, and (on this machine's CPU ranks) a calibration fitted on some
real runs predicts the others within 25%."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoplan
from autoplan.calibrate import MeasuredRun, calibrate, runs_from_csv, runs_from_records
from autoplan.cli import main as cli
from autoplan.errors import ConfigError
from costmodel.calibration import Calibration, DeviceCalibration
from costmodel.efficiency import default_efficiency

CPU = autoplan.Cluster.load("examples/clusters/cpu-4ranks.json")
MODEL = autoplan.models.get("gpt-tiny", dtype="fp32")

PLANS = {
    "dp2-mb2": dict(tp=1, pp=1, dp=2, micro_batch=2, global_batch=8),
    "dp2-mb8": dict(tp=1, pp=1, dp=2, micro_batch=8, global_batch=16),
    "dp2-mb4": dict(tp=1, pp=1, dp=2, micro_batch=4, global_batch=8),
    "pp2-mb4": dict(tp=1, pp=2, dp=1, micro_batch=4, global_batch=16),
    "pp2-mb8": dict(tp=1, pp=2, dp=1, micro_batch=8, global_batch=32),
    "pp2-mb2": dict(tp=1, pp=2, dp=1, micro_batch=2, global_batch=8),
    "tp2-mb4": dict(tp=2, pp=1, dp=1, micro_batch=4, global_batch=8),
}


def _plan(name: str) -> autoplan.Plan:
    return autoplan.Plan.uniform(MODEL, CPU, dtype="fp32", **PLANS[name])


def _synthetic_runs(cal: Calibration, names) -> list[MeasuredRun]:
    """Runs whose 'measured' times are what the model predicts under ``cal``."""
    out = []
    for name in names:
        plan = _plan(name)
        t = autoplan.estimate(MODEL, CPU, plan, calibration=cal).iteration_time_s
        out.append(MeasuredRun(name=name, model=MODEL, cluster=CPU, plan=plan, stack="autoplan", ran=True,
                               step_time_s=t, peak_memory_bytes=None))
    return out


TRUTH = Calibration(stack="autoplan", devices={"CPU": DeviceCalibration(compute_scale=3.0, launch_s=60e-6,
                                                                         step_overhead_s=0.02)})


def test_fit_recovers_the_parameters_that_made_the_runs():
    runs = _synthetic_runs(TRUTH, PLANS)
    cal, rows = calibrate(runs)
    assert cal.runs == len(PLANS) and cal.stack == "autoplan"
    # Any parameters that reproduce the runs will do; here they are identifiable.
    assert cal.loo_time_mape < 0.02
    for r in runs:
        assert autoplan.estimate(MODEL, CPU, r.plan, calibration=cal).iteration_time_s == pytest.approx(
            r.step_time_s, rel=0.02)
    assert all(row["loo_s"] == pytest.approx(row["measured_s"], rel=0.05) for row in rows)


def test_two_runs_fit_two_parameters():
    cal, _ = calibrate(_synthetic_runs(TRUTH, ["dp2-mb2", "dp2-mb8"]))
    (dev,) = cal.devices.values()
    assert dev.launch_s == default_efficiency("CPU").launch_s   # too few runs to fit it: the default stays
    assert dev.compute_scale > 0 and dev.step_overhead_s >= 0


def test_calibrated_estimate_says_so_and_carries_its_interval():
    cal, _ = calibrate(_synthetic_runs(TRUTH, PLANS))
    est = autoplan.estimate(MODEL, CPU, _plan("dp2-mb4"), calibration=cal)
    assert est.sources == {"CPU": "calibrated"}
    assert "calibrated" in est.inputs["CPU"] and est.inputs["interval"].startswith("calibration")


@pytest.mark.parametrize("change,field", [
    (dict(stack="megatron-core"), "calibration.stack"),
    (dict(devices={"H100-SXM5-80GB": DeviceCalibration()}), "calibration.devices"),
], ids=["other-stack", "other-device"])
def test_calibration_for_something_else_is_refused(change, field):
    cal = dataclasses.replace(TRUTH, **change)
    with pytest.raises(ConfigError, match=field):
        autoplan.estimate(MODEL, CPU, _plan("dp2-mb2"), calibration=cal)


@pytest.mark.parametrize("edit,field", [
    ({"kind": "autoplan-run"}, "kind"),
    ({"devices": {}}, "devices"),
    ({"devices": {"CPU": {"compute_scale": -1}}}, "compute_scale"),
    ({"devices": {"CPU": {"speed": 2}}}, "speed"),
    ({"time_error": [0.2, -0.2]}, "time_error"),
    ({"extra": 1}, "extra"),
], ids=["kind", "no-devices", "negative-scale", "unknown-device-field", "band-order", "unknown-field"])
def test_bad_calibration_file_names_the_field(tmp_path, edit, field):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(TRUTH.to_dict() | edit))
    with pytest.raises(ConfigError, match=field):
        Calibration.load(path)


def test_calibration_round_trips(tmp_path):
    cal, _ = calibrate(_synthetic_runs(TRUTH, PLANS))
    cal.save(tmp_path / "c.json")
    loaded = Calibration.load(tmp_path / "c.json").devices
    assert loaded.keys() == cal.devices.keys()
    for name, dev in cal.devices.items():   # (the file keeps microseconds and milliseconds)
        assert dataclasses.astuple(loaded[name]) == pytest.approx(dataclasses.astuple(dev), rel=1e-12)


# ------------------------------------------------------------------- inputs
CSV_HEADER = "model,seq_len,device,tp,pp,dp,micro_batch,global_batch,recompute,zero,status,step_time_s,dtype"


@pytest.mark.parametrize("text,field", [
    ("model,seq_len\ngpt-tiny,32\n", "column 'device'"),
    (CSV_HEADER + "\ngpt-tiny,32,CPU,1,1,2,2,8,none,0,maybe,0.1,fp32\n", "status"),
    (CSV_HEADER + "\ngpt-tiny,32,CPU,1,1,2,2,8,none,0,ok,fast,fp32\n", "step_time_s"),
    (CSV_HEADER + "\ngpt-tiny,32,CPU,1,1,2,2,8,none,0,ok,,fp32\n", "step_time_s"),
    (CSV_HEADER + "\ngpt-tiny,32,CPU,0,1,2,2,8,none,0,ok,0.1,fp32\n", "tp"),
    (CSV_HEADER + "\n", "no rows"),
    (CSV_HEADER + ",sequence_paralel\ngpt-tiny,32,CPU,1,1,2,2,8,none,0,ok,0.1,fp32,yes\n",
     "'sequence_paralel'.*did you mean 'sequence_parallel'"),
], ids=["missing-column", "bad-status", "not-a-number", "ran-without-figures", "zero-degree", "empty",
        "misspelt-column"])
def test_bad_csv_is_one_line_naming_the_field(tmp_path, text, field):
    path = tmp_path / "runs.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field) as e:
        runs_from_csv(path)
    assert "\n" not in str(e.value)


def test_csv_runs_calibrate(tmp_path):
    rows = [CSV_HEADER]
    for name, t in (("dp2-mb2", 0.05), ("dp2-mb8", 0.09), ("dp2-mb4", 0.06)):
        kw = PLANS[name]
        rows.append(f"gpt-tiny,32,CPU,{kw['tp']},{kw['pp']},{kw['dp']},{kw['micro_batch']},{kw['global_batch']},"
                    f"none,0,ok,{t},fp32")
    rows.append("gpt-tiny,32,CPU,1,1,2,64,128,none,0,oom,,fp32")
    path = tmp_path / "runs.csv"
    path.write_text("\n".join(rows) + "\n")
    runs = runs_from_csv(path)
    assert [r.ran for r in runs] == [True, True, True, False]
    cal, _ = calibrate(runs)
    assert cal.runs == 3


def test_run_record_without_steps_is_refused(tmp_path):
    record = json.loads(Path("benchmarks/results/bench/measured/searched-run.json").read_text())
    record["steps"] = []
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="steps"):
        runs_from_records([path])


def test_calibrate_cli_never_overwrites(tmp_path, capsys):
    out = tmp_path / "calib.json"
    out.write_text("keep me")
    code = cli(["calibrate", "--runs", "benchmarks/results/bench/measured/searched-run.json", "--out", str(out)])
    assert code == 2 and out.read_text() == "keep me"
    assert "--force" in capsys.readouterr().err


def test_calibrate_cli_from_csv(tmp_path, capsys):
    rows = [CSV_HEADER] + [f"gpt-tiny,32,CPU,1,1,2,{mb},{mb * 2},none,0,ok,{0.02 + 0.005 * mb},fp32"
                           for mb in (1, 2, 4, 8)]
    (tmp_path / "runs.csv").write_text("\n".join(rows) + "\n")
    code = cli(["calibrate", "--csv", str(tmp_path / "runs.csv"), "--out", str(tmp_path / "c.json")])
    assert code == 0
    text = capsys.readouterr().out
    assert "leave-one-out step-time error" in text and (tmp_path / "c.json").exists()


# ------------------------------------------------- real runs on a CPU rank
# One rank timed by its thread's CPU time, so the measurement is the model's own work
# whatever else shares the machine; the plans differ in micro-batch size, count and recomputation, which change the kernels
# run per step and the work per kernel.
REAL_PLANS = {
    "mb2x2": dict(micro_batch=2, global_batch=4),
    "mb8x2": dict(micro_batch=8, global_batch=16),
    "mb4x4-full": dict(micro_batch=4, global_batch=16, recompute="full"),
    "mb2x8": dict(micro_batch=2, global_batch=16),
    "mb4x2": dict(micro_batch=4, global_batch=8),
    "mb8x1-full": dict(micro_batch=8, global_batch=8, recompute="full"),
}
REAL_FIT = ("mb2x2", "mb8x2", "mb4x4-full", "mb2x8")
REAL_HELD_OUT = ("mb4x2", "mb8x1-full")
REAL_STEPS = 6
REAL_ROUNDS = 3
"""Every plan is trained this many times, the rounds apart: a neighbour's burst of memory
traffic slows a whole short run even in thread CPU time, and seldom every round."""
ONE_RANK = autoplan.Cluster.homogeneous("CPU", 1, 1)


def _real_plan(name: str) -> autoplan.Plan:
    return autoplan.Plan.uniform(MODEL, ONE_RANK, tp=1, pp=1, dp=1, dtype="fp32", **REAL_PLANS[name])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_all(rank: int, world: int, port: int, names: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from autoplan.runtime.trainer import train
        # One throwaway run first: the first training in a process pays for lazy set-up.
        train(_real_plan(names[0]), "gpt-tiny", steps=2, log=None, clock="thread")
        for round_ in range(REAL_ROUNDS):
            for name in names:
                train(_real_plan(name), "gpt-tiny", steps=REAL_STEPS, out=str(Path(out) / f"{name}.{round_}.json"),
                      log=None, clock="thread")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_calibration_from_real_cpu_runs_predicts_held_out_plans():
    names = REAL_FIT + REAL_HELD_OUT
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_train_all, args=(1, _free_port(), names, d), nprocs=1)
        records = runs_from_records([Path(d) / f"{n}.{k}.json" for n in names for k in range(REAL_ROUNDS)])
    # Each plan's least disturbed round, as runs_from_records keeps each run's fastest step.
    runs = {}
    for r in records:
        name = r.name.split(".")[0]
        if name not in runs or r.step_time_s < runs[name].step_time_s:
            runs[name] = r
    fit = [runs[n] for n in REAL_FIT]
    held = [runs[n] for n in REAL_HELD_OUT]
    cal, _ = calibrate(fit)
    for r in held:
        predicted = autoplan.estimate(r.model, r.cluster, r.plan, calibration=cal).iteration_time_s
        assert r.step_time_s == pytest.approx(predicted, rel=0.25), f"{r.name}: measured {r.step_time_s:.4f} s"


# -------------------------------------------------------------- accelerators
H100 = autoplan.Cluster.homogeneous("H100", 1, 1)
GPT2 = autoplan.models.get("gpt2-small", seq_len=1024)
GPU_PLANS = {f"mb{mb}-{rec}": dict(micro_batch=mb, global_batch=2 * mb, recompute=rec)
             for mb in (1, 4, 16, 64) for rec in ("none", "full")}
GPU_TRUTH = Calibration(stack="autoplan", devices={"H100-SXM5-80GB": DeviceCalibration(
    compute_scale=1.2, launch_s=30e-6, step_overhead_s=0.05)})


def _gpu_runs(cal: Calibration) -> list[MeasuredRun]:
    out = []
    for name, kw in GPU_PLANS.items():
        plan = autoplan.Plan.uniform(GPT2, H100, tp=1, pp=1, dp=1, **kw)
        t = autoplan.estimate(GPT2, H100, plan, calibration=cal).iteration_time_s
        out.append(MeasuredRun(name=name, model=GPT2, cluster=H100, plan=plan, stack="autoplan", ran=True,
                               step_time_s=t, peak_memory_bytes=None))
    return out


def test_accelerator_fit_recovers_a_host_beside_the_device():
    """Small steps wait on the host, large ones on the device: the fit separates the two."""
    runs = _gpu_runs(GPU_TRUTH)
    cal, rows = calibrate(runs)
    (dev,) = cal.devices.values()
    assert dev.compute_scale == pytest.approx(1.2, rel=0.02)
    assert dev.launch_s == pytest.approx(30e-6, rel=0.05) and dev.step_overhead_s == pytest.approx(0.05, rel=0.05)
    assert cal.loo_time_mape < 0.01
    waits = {r.name: autoplan.estimate(GPT2, H100, r.plan, calibration=cal).breakdown.get("host", 0.0) / r.step_time_s
             for r in runs}
    assert waits["mb1-none"] > 0.3 and waits["mb64-none"] < 0.01   # (both kinds of step are in the fit)


@pytest.mark.parametrize("device,refused", [("CPU", False), ("H100-SXM5-80GB", True)],
                         ids=["cpu-keeps-its-meaning", "accelerator-must-recalibrate"])
def test_version_1_files_on_accelerators_are_refused(tmp_path, device, refused):
    """Version 1 added an accelerator's per-kernel and per-step costs to its device time;
    read as a host beside the device they would be wrong without a word."""
    data = dataclasses.replace(TRUTH, devices={device: DeviceCalibration(1.0, 1e-5, 0.01)}).to_dict()
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data | {"schema_version": 1}))
    if refused:
        with pytest.raises(ConfigError, match="schema_version.*recalibrate"):
            Calibration.load(path)
    else:
        assert Calibration.load(path).devices[device].launch_s == pytest.approx(1e-5)
