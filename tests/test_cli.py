"""The CLI: commands work end to end and user errors are one clear line, exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import autoplan
from autoplan.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("estimate", "models", "devices", "cluster"):
        assert cmd in out


def test_models_table(capsys):
    code, out, _ = run_cli(capsys, "models", "--filter", "gpt3-175")
    assert code == 0 and "gpt3-175b" in out and "174.6" in out


def test_devices_table(capsys):
    code, out, _ = run_cli(capsys, "devices")
    assert code == 0 and "H100-SXM5-80GB" in out and "T4-16GB" in out


def test_cluster_show(capsys):
    code, out, _ = run_cli(capsys, "cluster", "show", "examples/clusters/mixed-v100-t4.json")
    assert code == 0 and "V100" in out and "T4" in out


@pytest.fixture
def plan_file(tmp_path):
    model = autoplan.models.get("gpt2-medium")
    cluster = autoplan.Cluster.load("examples/clusters/small-mixed-v100-t4.json")
    plan = autoplan.Plan.uniform(model, cluster, tp=4, pp=2, dp=1, micro_batch=1, global_batch=8)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_estimate_heterogeneous_plan(capsys, plan_file):
    code, out, _ = run_cli(capsys, "estimate", "--cluster", "examples/clusters/small-mixed-v100-t4.json",
                           "--model", "gpt2-medium", "--plan", str(plan_file))
    assert code == 0
    assert "iteration" in out and "V100-SXM2-16GB" in out and "T4-16GB" in out and "capacity" in out


def test_estimate_json(capsys, plan_file):
    code, out, _ = run_cli(capsys, "estimate", "--cluster", "examples/clusters/small-mixed-v100-t4.json",
                           "--model", "gpt2-medium", "--plan", str(plan_file), "--json")
    data = json.loads(out)
    assert code == 0 and data["iteration_time_s"] > 0 and data["fits"] is True


@pytest.mark.parametrize("args,needle", [
    (["cluster", "show", "missing.json"], "missing.json: file not found"),
    (["estimate", "--cluster", "examples/clusters/dgx-a100-1node.json", "--model", "gpt-9000",
      "--plan", "{plan}"], "unknown model"),
    (["estimate", "--cluster", "examples/clusters/dgx-a100-1node.json", "--model", "gpt2-medium",
      "--plan", "missing-plan.json"], "missing-plan.json: file not found"),
], ids=["missing-cluster", "unknown-model", "missing-plan"])
def test_user_errors_are_one_line(capsys, plan_file, args, needle):
    args = [a.replace("{plan}", str(plan_file)) for a in args]
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "autoplan", "devices"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "A100" in proc.stdout
