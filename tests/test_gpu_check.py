"""benchmarks/gpu_check.py end to end on CPU: the same three measurements it makes on a GPU
(profile, whole step, training run) on a tiny model, so the GPU path is exercised here."""
from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    code = load_script().main(["--device", "cpu", "--model", "llama-tiny", "--dtype", "fp32", "--seq-len", "32",
                               "--micro-batches", "1,2", "--tp", "1,2", "--steps", "3", "--accumulation", "2",
                               "--out", str(out)])
    assert code == 0
    return out, (out / "gpu_check_cpu.md").read_text()


def numbers(row: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(r"[-+]?[\d,]*\.?\d+", row)]


def test_report_has_every_section_and_the_command(checked):
    _, text = checked
    for heading in ("## Whole training step", "## Layers", "## Training run (`autoplan run`)"):
        assert heading in text
    assert "python benchmarks/gpu_check.py --device cpu" in text


def test_whole_step_rows_are_measured_and_predicted(checked):
    _, text = checked
    rows = [line for line in text.splitlines() if re.match(r"\| [12] \| 32 \|", line)]
    assert len(rows) == 2, text
    for row in rows:
        mb, seq, measured, predicted, err, roofline, roof_err = numbers(row)[:7]
        assert measured > 0 and predicted > 0 and roofline > 0
        # The table rounds times to 0.01 ms; the error was computed before rounding.
        rounding = 100 * 0.005 * (1 / measured + predicted / measured ** 2) + 0.05
        assert math.isclose(err, (predicted / measured - 1) * 100, abs_tol=rounding)


def test_layers_cover_every_unit_kind_and_tp(checked):
    _, text = checked
    rows = [line for line in text.splitlines() if re.match(r"\| (embedding|block\.0|head) \|", line)]
    kinds_tp = {(r.split("|")[2].strip(), r.split("|")[3].strip()) for r in rows}
    assert kinds_tp == {(k, tp) for k in ("embedding", "block", "head") for tp in ("1", "2")}


def test_check_flag_fails_only_where_the_target_is_missed(checked, monkeypatch):
    """--check turns the report's target into an exit status: the same steps pass or fail
    as the target they are held to allows."""
    module = load_script()
    out, text = checked
    worst = max(abs(numbers(line)[4]) for line in text.splitlines() if re.match(r"\| [12] \| 32 \|", line)) / 100
    args = ["--device", "cpu", "--model", "llama-tiny", "--dtype", "fp32", "--seq-len", "32", "--micro-batches",
            "1,2", "--tp", "1", "--steps", "0", "--out", str(out), "--check"]
    for target, code in ((1e9, 0), (0.0, 1)):     # (no measured step is exactly on its prediction)
        monkeypatch.setattr(module, "STEP_TARGET", target)
        assert module.main(args) == code
    assert ("met" if worst <= 0.10 else "missed") in text.split("(target 10%: ")[1][:6]


def test_training_run_recorded(checked):
    out, text = checked
    record = json.loads((out / "gpu_check_run_cpu.json").read_text())
    assert len(record["steps"]) == 3
    assert all(math.isfinite(s["loss"]) for s in record["steps"])
    row = next(line for line in text.splitlines() if line.startswith("| step time (s)"))
    predicted, measured, ratio = numbers(row)
    assert predicted > 0 and measured > 0
    assert math.isclose(ratio, measured / predicted, rel_tol=0.01)  # 4 significant digits each
    profiles = list((out / "profiles").glob("CPU_fp32_*.json"))
    assert len(profiles) == 1
