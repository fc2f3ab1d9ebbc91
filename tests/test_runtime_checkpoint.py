"""`autoplan run` end to end, killed and resumed: a run SIGKILLed mid-way (launcher and
workers at once) restarts with the same command from its last checkpoint and produces
exactly the losses of a run that was never stopped, and writes a valid run record.

The never-stopped twin is computed in test_runtime_parallel's 2-rank process group
(same plan, options and code path), which saves launching a third torchrun here.
Checkpoints moving between plans are tested there too."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autoplan.runtime.record import load_record

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_runtime_parallel import CLI_LR, CLI_MODEL, CLI_PLAN, CLI_STEPS, group  # noqa: E402

EVERY = 2
"""Checkpoint interval of the CLI runs."""


def _cli(plan_path: Path, out: Path, ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "autoplan", "run", str(plan_path), "--model", CLI_MODEL,
            "--steps", str(CLI_STEPS), "--lr", str(CLI_LR), "--out", str(out),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc; torchrun starts its workers in
    sessions of their own, so killing the launcher's process group would orphan them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and all its workers, as a scheduler ending a job would."""
    for p in _descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _latest_step(ckpt: Path) -> int:
    try:
        return json.loads((ckpt / "latest.json").read_text())["step"]
    except (FileNotFoundError, ValueError, KeyError):
        return 0


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    plan_path = tmp / "plan.json"
    CLI_PLAN.save(plan_path)
    ckpt = tmp / "ckpt"
    proc = subprocess.Popen(_cli(plan_path, tmp / "killed.json", ckpt), env=_env(), cwd=tmp,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while _latest_step(ckpt) < EVERY and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    _kill_tree(proc.pid)   # no chance to clean up or finish the step in flight
    proc.wait()
    time.sleep(0.5)        # killed workers are gone before the pointer is read
    killed_at = _latest_step(ckpt)
    resumed = subprocess.run(_cli(plan_path, tmp / "run.json", ckpt), env=_env(), cwd=tmp,
                             capture_output=True, text=True, timeout=300)
    return {"killed_at": killed_at, "resumed": resumed, "record": tmp / "run.json",
            "killed_record": tmp / "killed.json"}


@pytest.mark.slow
def test_killed_run_resumes_as_if_never_stopped(killed_and_resumed):
    killed_at = killed_and_resumed["killed_at"]
    assert EVERY <= killed_at < CLI_STEPS, f"the kill landed at step {killed_at}"
    assert not killed_and_resumed["killed_record"].exists(), "the killed run must not have finished"
    resumed = killed_and_resumed["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{killed_at:08d}" in resumed.stdout
    rec = load_record(killed_and_resumed["record"])
    assert rec.run["resumed_from_step"] == killed_at
    assert [s.step for s in rec.steps] == list(range(killed_at + 1, CLI_STEPS + 1))
    twin = group(2)["cli-twin"]
    assert "error" not in twin[0], twin[0].get("error")
    # Same plan, ranks and options, state restored exactly: the same floating-point work.
    assert rec.losses == twin[0]["losses"][killed_at:]


@pytest.mark.slow
def test_cli_writes_a_valid_record(killed_and_resumed):
    resumed = killed_and_resumed["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rec = load_record(killed_and_resumed["record"])
    assert rec.plan.to_dict() == CLI_PLAN.to_dict()
    env = rec.environment
    assert (env["world_size"], env["backend"], env["device_type"]) == (2, "gloo", "cpu")
    assert env["torch_version"] == torch.__version__ and len(env["device_names"]) == 2
    assert rec.run["schedule_program"] == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    assert rec.run["tokens_per_step"] == CLI_PLAN.global_batch * 32
    assert [m.rank for m in rec.memory] == [0, 1]
    assert all(len(s.peak_memory_bytes_by_rank) == 2 and min(s.peak_memory_bytes_by_rank) > 0 for s in rec.steps)
    assert list(rec.steps[-1].peak_memory_bytes_by_rank) == [m.peak_memory_bytes for m in rec.memory]
    assert all(0 < m.peak_memory_bytes < m.max_rss_bytes for m in rec.memory)
    assert all(s.step_time_s > 0 and s.tokens_per_s == pytest.approx(rec.run["tokens_per_step"] / s.step_time_s)
               for s in rec.steps)
    twin = group(2)["cli-twin"][0]["losses"]
    assert twin[-1] < twin[0] - 0.05, "AdamW on the learnable synthetic targets should lower the loss"
    lines = [l for l in resumed.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == len(rec.steps) and "tokens/s" in lines[-1] and "peak mem" in lines[-1]
