"""The time-decomposition diagnostic: its compute split adds up to the roofline the cost
model uses, and the factor it reports for a part does remove a source's mean error."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

import autoplan
from autoplan.catalog import get_device
from autoplan.stacks import get_stack
from benchmarks.published.decompose import (closing_factor, compute_split, kernel_batch_gaps,
                                            per_micro_batch_cost)
from costmodel.compute import roofline_timing
from costmodel.efficiency import default_efficiency


@pytest.mark.parametrize("attention,fp8,tp,micro_batch", [
    ("math", False, 1, 1),
    ("flash1", False, 1, 2),
    ("flash2", False, 2, 2),
    ("flash3", False, 4, 1),
    ("flash2", True, 2, 2),
], ids=["explicit-attention", "flash1-mb2", "flash2-tp2-mb2", "flash3-tp4", "fp8-linears-tp2-mb2"])
def test_compute_split_adds_up_to_the_roofline(attention, fp8, tp, micro_batch):
    model = autoplan.models.transformer(layers=1, hidden=128, heads=2, seq_len=64, vocab=256,
                                        attention="math" if attention == "math" else "flash")
    device = get_device("H100")
    stack = dataclasses.replace(get_stack("torchtitan-float8" if fp8 else "torchtitan"), attention=attention)
    split = compute_split(device, model.layers, micro_batch, tp, False, stack)
    roofline = sum(t.forward + t.backward for t in (
        roofline_timing(device, default_efficiency(device.name), l, micro_batch, tp, False, "bf16", attention,
                        fp8_cast=stack.fp8_cast)
        for l in model.layers))
    assert all(v >= 0 for v in split.values())
    assert sum(split.values()) == pytest.approx(roofline, rel=1e-9)


MEASURED = np.array([12.0, 22.0, 33.0])
PREDICTED = np.array([10.0, 20.0, 30.0])


@pytest.mark.parametrize("part,expected", [
    (np.array([2.0, 2.0, 3.0]), 2.0),          # measured = predicted + part: the part doubled
    (np.array([0.0, 0.0, 0.0]), math.nan),     # a part the source does not have cannot explain it
    (np.array([1e-6, 1e-6, 1e-6]), math.nan),  # nor one too small for any factor in range
], ids=["part-doubled", "absent-part", "negligible-part"])
def test_closing_factor(part, expected):
    f = closing_factor(MEASURED, PREDICTED, part)
    if math.isnan(expected):
        assert math.isnan(f)
    else:
        assert f == pytest.approx(expected, rel=1e-6)
        assert np.mean(MEASURED / (PREDICTED + (f - 1) * part) - 1) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("a,c", [(1.0, 0.0), (1.13, 0.031), (0.9, 0.2)], ids=["none", "hagemann-like", "large"])
def test_per_micro_batch_cost_recovers_a_known_cost(a, c):
    """Runs built as measured = a * predicted + c * m on the pipelined ones: the fit gives a, c."""
    rng = np.random.default_rng(0)
    predicted = rng.uniform(20, 60, 40)
    m = rng.integers(8, 256, 40).astype(float)
    pipelined = (rng.random(40) < 0.5).astype(float)
    measured = a * predicted + c * m * pipelined
    fit_a, fit_c = per_micro_batch_cost(measured, predicted, m, pipelined)
    assert fit_a == pytest.approx(a, rel=1e-9) and fit_c == pytest.approx(c, rel=1e-9, abs=1e-12)


def _runs(kernel: str, fa2: bool, piped_ratio: float, flat_ratio: float, n: int = 3, table: str = "t") -> list[dict]:
    """n pipelined and n other runs of one table and kernel at the given measured/predicted."""
    return [dict(source="Hagemann 13B (fitting)", ref=table, kernel=kernel, fa2=fa2, trial=100 + i,
                 pp_degree=pp, predicted=10.0, measured=10.0 * (piped_ratio if pp > 1 else flat_ratio))
            for i in range(n) for pp in (1, 2)]


@pytest.mark.parametrize("runs,expected", [
    # One batch's pipelined runs slow, the other's not: the gap is the batch's.
    (_runs("fa2", True, 1.3, 1.0) + _runs("fa1", False, 1.1, 1.1), {"fa2": 0.3, "fa1": 0.0}),
    # Both batches' non-pipelined runs slow: the gap belongs to the configurations.
    (_runs("fa2", True, 1.2, 1.4) + _runs("fa1", False, 1.2, 1.4), {"fa2": -0.2, "fa1": -0.2}),
    # A table with one kernel cannot be compared: left out.
    (_runs("fa2", True, 1.3, 1.0), {}),
    # A kernel with too few runs of one kind is left out, and then so is its table.
    (_runs("fa2", True, 1.3, 1.0) + _runs("fa1", False, 1.1, 1.1, n=2), {}),
], ids=["batch-effect", "configuration-effect", "one-kernel", "too-few-runs"])
def test_kernel_batch_gaps(runs, expected):
    gaps = kernel_batch_gaps(pd.DataFrame(runs))
    assert {r.kernel: round(r.gap, 9) for r in gaps.itertuples()} == pytest.approx(expected)


def _rows(dropout: float, slope: float) -> pd.DataFrame:
    """Six Megatron-Core rows whose error is ``slope`` x their attention share."""
    share = np.linspace(0.05, 0.30, 6)
    predicted = np.full(6, 10.0)
    return pd.DataFrame(dict(stack="megatron-core-fp8", dropout=dropout, attention=share * predicted,
                             bandwidth=share[::-1] * predicted, predicted=predicted,
                             measured=predicted * (1 + slope * share)))


def test_dropout_view_separates_the_rows_that_train_with_dropout():
    from benchmarks.published.decompose import dropout_lines
    others = pd.DataFrame(dict(stack=["torchtitan"] * 6, dropout=0.1, attention=1.0, bandwidth=1.0, predicted=10.0,
                               measured=20.0))
    lines = dropout_lines(pd.concat([_rows(0.1, 0.5), _rows(0.0, 0.0), others], ignore_index=True))
    cells = [[c.strip() for c in line.strip()[1:-1].split("|")] for line in lines[2:]]
    rows = {c[0]: c for c in cells}
    assert set(rows) == {"dropout 0.1", "no dropout"}
    assert rows["dropout 0.1"][1] == "6" and rows["dropout 0.1"][4] == "+0.50"      # only its own stack's rows
    assert rows["dropout 0.1"][5] == "+1.00" and rows["dropout 0.1"][6] == "-1.00"  # attention, bandwidth
    assert rows["no dropout"][4] == "+0.00" and rows["no dropout"][2] == "+0.0%"
    assert rows["no dropout"][5] == ""                                               # no error to rank
