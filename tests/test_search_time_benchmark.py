"""The search-time benchmark's check that no row's best plan got slower than in the
previous run (the timing itself is the benchmark's business, not the tests')."""
from __future__ import annotations

import json

import pytest

from benchmarks import search_time


def _row(series, gpus, iteration_s=None):
    now = {"fits": iteration_s is not None, "cpu_s": 1.0, "wall_s": 1.0}
    if iteration_s is not None:
        now["iteration_s"] = iteration_s
    return {"series": series, "gpus": gpus, "now": now}


@pytest.mark.parametrize("rows,expected", [
    ([], {}),
    ([_row("homogeneous", 64, 2.5), _row("mixed", 64, 3.0)], {("homogeneous", 64): 2.5, ("mixed", 64): 3.0}),
    ([_row("mixed", 8)], {}),                                   # no plan fits: nothing to compare with
], ids=["empty", "both-series", "no-plan"])
def test_previous_iterations_are_read_per_series_and_size(tmp_path, rows, expected):
    raw = tmp_path / "search_time.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert search_time._previous_iterations(raw) == expected


def test_no_previous_run_means_nothing_to_compare(tmp_path):
    assert search_time._previous_iterations(tmp_path / "missing.jsonl") == {}


@pytest.mark.parametrize("phases,wall_s,expected", [
    ({"placement": 0.5, "bounds": 1.0, "split": 2.0, "estimate": 0.25}, 4.0, "| 0.50 | 1.00 | 2.00 | 0.25 | 0.25 |"),
    ({"bounds": 1.0, "split": 1.0, "estimate": 1.0}, 3.0, "| - | 1.00 | 1.00 | 1.00 | 0.00 |"),   # (no placement)
], ids=["all-phases", "missing-phase"])
def test_phase_table_splits_each_search_into_its_phases(phases, wall_s, expected):
    row = _row("mixed", 64, 2.0)
    row["now"].update(phases=phases, wall_s=wall_s)
    lines = search_time.phase_table([row, _row("mixed", 8)])
    assert lines[-1] == "| mixed | 64 | " + expected[2:]   # (the row without a plan has no phases: left out)
    assert len([l for l in lines if l.startswith("| mixed")]) == 1


def test_no_phases_no_phase_table():
    assert search_time.phase_table([_row("homogeneous", 8)]) == []
