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


def test_search_json_and_table_carry_the_notes(capsys):
    """The search's notes (here: pipelined ZeRO-3 runs as ZeRO-1 on autoplan's runtime) reach
    both faces of the CLI."""
    argv = ["search", "--cluster", "examples/clusters/cpu-4ranks.json", "--model", "gpt-tiny",
            "--global-batch", "8", "--zero", "0,3", "--no-progress"]
    code, out, _ = run_cli(capsys, *argv, "--json")
    assert code == 0
    notes = json.loads(out)["notes"]
    assert len(notes) == 1 and "as ZeRO-1" in notes[0]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and f"note: {notes[0]}" in out


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


# ------------------------------------------------------------ argument traps
def _many_groups(tmp_path) -> str:
    groups = [{"name": f"g{i}", "device": "A100", "nodes": 1, "gpus_per_node": 8} for i in range(1000)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"node_groups": groups}))
    return str(path)


def _deep_model(tmp_path) -> str:
    cfg = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
           "num_hidden_layers": 10_000, "vocab_size": 32000, "max_position_embeddings": 2048}
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(cfg))
    return str(path)


SEARCH = ["search", "--cluster", "examples/clusters/dgx-a100-1node.json", "--model", "gpt2-medium",
          "--global-batch", "64"]
ARG_TRAPS = {
    # name: (argv, words in the one-line error). Each is refused before any work starts.
    "top-k-zero": (SEARCH + ["--top-k", "0"], "--top-k"),
    "top-k-negative": (SEARCH + ["--top-k", "-1"], "--top-k"),
    "seq-len-zero": (SEARCH + ["--seq-len", "0"], "--seq-len"),
    "global-batch-2-63": (SEARCH[:-1] + [str(2**63)], "--global-batch"),
    "out-in-missing-dir": (SEARCH + ["--out", "no/such/dir/plan.json"], "does not exist"),
    "out-is-a-dir": (SEARCH + ["--out", "examples"], "is a directory"),
    "tp-not-dividing-heads": (SEARCH + ["--tp", "3"], "3 does not divide the model's 16 attention heads"),
    "tp-zero": (SEARCH + ["--tp", "0"], "tp: must be integers in 1.."),
    "thousand-node-groups": (["search", "--cluster", "{many}", "--model", "gpt2-medium", "--global-batch", "8"],
                             "at most 64"),
    "ten-thousand-layers": (["search", "--cluster", "examples/clusters/dgx-a100-1node.json", "--model", "{deep}",
                             "--global-batch", "8"], "num_hidden_layers"),
    "timeline-in-missing-dir": (["estimate", "--cluster", "examples/clusters/dgx-a100-1node.json", "--model",
                                 "gpt2-medium", "--plan", "{plan}", "--timeline", "no/dir/t.png"], "--timeline"),
    "memory-plot-is-a-dir": (["estimate", "--cluster", "examples/clusters/dgx-a100-1node.json", "--model",
                              "gpt2-medium", "--plan", "{plan}", "--memory-plot", "examples"], "--memory-plot"),
    "run-nnodes-zero": (["run", "{tiny}", "--model", "gpt-tiny", "--nnodes", "0", "--dry-run"], "--nnodes"),
    "run-dry-steps-zero": (["run", "{tiny}", "--model", "gpt-tiny", "--steps", "0", "--dry-run"], "steps"),
    "run-dry-negative-lr": (["run", "{tiny}", "--model", "gpt-tiny", "--lr", "-1", "--dry-run"], "lr"),
    "run-out-in-missing-dir": (["run", "{tiny}", "--model", "gpt-tiny", "--out", "no/dir/r.json", "--dry-run"],
                               "--out"),
    "run-build-only-bad-rank": (["run", "{tiny}", "--model", "gpt-tiny", "--build-only", "--rank", "9"], "--rank"),
    "export-out-in-missing-dir": (["export", "{plan}", "--to", "deepspeed", "--out", "no/dir/ds.json"], "--out"),
}


@pytest.fixture
def tiny_plan_file(tmp_path):
    """A plan the CPU runtime can run: gpt-tiny on two data-parallel ranks."""
    model = autoplan.models.get("gpt-tiny", dtype="fp32")
    cluster = autoplan.Cluster.load("examples/clusters/cpu-4ranks.json")
    path = tmp_path / "tiny-plan.json"
    autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=2, micro_batch=1, global_batch=2, dtype="fp32").save(path)
    return path


@pytest.mark.parametrize("name", list(ARG_TRAPS), ids=list(ARG_TRAPS))
def test_argument_traps_are_refused_up_front(name, capsys, plan_file, tiny_plan_file, tmp_path):
    argv, words = ARG_TRAPS[name]
    argv = [a.replace("{plan}", str(plan_file)).replace("{tiny}", str(tiny_plan_file)).replace("{many}", _many_groups(tmp_path) if a == "{many}" else a)
            .replace("{deep}", _deep_model(tmp_path) if a == "{deep}" else a) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:   # argparse's own usage errors
        code = e.code
    _, err = capsys.readouterr()
    assert code == 2, err
    assert words in err and "Traceback" not in err, err
    assert len([line for line in err.strip().splitlines() if "error" in line]) == 1, err


def test_gpu_backend_without_gpus_is_one_line(capsys, tiny_plan_file):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = run_cli(capsys, "run", str(tiny_plan_file), "--model", "gpt-tiny", "--backend", "nccl",
                           "--dry-run")
    assert code == 2 and "nccl needs CUDA GPUs" in err and len(err.strip().splitlines()) == 1


def test_an_assumed_network_is_said(capsys):
    """A multi-node cluster without an inter-node link gets the default NIC, and says so."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = autoplan.Cluster.homogeneous("A100", nodes=2, gpus_per_node=8)
    assert any("assuming 12.5 GB/s" in str(w.message) for w in caught)
    assert "assuming" in cluster.summary()
    assert not autoplan.Cluster.homogeneous("A100", 2, 8, inter_node_GBps=25).assumptions()
