"""How sure an estimate is: intervals for step time and peak memory from the residuals of
the measurements the cost model was checked on (or of a calibration's leave-one-out fit).

``autoplan/data/uncertainty.json`` is written by ``python benchmarks/published/validate.py``
from its checking data: per training stack, the 10th and 90th percentile of
measured/predicted - 1 for step time and for peak memory, and how many rows they come
from. A stack without checking rows of its own gets the pooled figures of all rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

UNCERTAINTY_FILE = Path(__file__).resolve().parents[1] / "autoplan" / "data" / "uncertainty.json"


@dataclass(frozen=True)
class ErrorBand:
    """Relative error band of a prediction: the truth lies in [p * (1 + low), p * (1 + high)]
    for about 80% of the checking rows."""

    low: float
    high: float
    rows: int
    """Checking rows the band comes from (0: no data, the band is empty)."""
    source: str
    """Where the residuals come from."""

    def interval(self, value: float) -> tuple[float, float]:
        return value * (1 + self.low), value * (1 + self.high)


@lru_cache(maxsize=1)
def _table() -> dict:
    try:
        return json.loads(UNCERTAINTY_FILE.read_text())
    except (OSError, ValueError):
        return {}


def error_bands(stack: str) -> tuple[ErrorBand, ErrorBand]:
    """(time band, memory band) for a stack, from the committed validation residuals."""
    table = _table()
    entry = table.get("stacks", {}).get(stack) or table.get("pooled") or {}

    def band(kind: str) -> ErrorBand:
        e = entry.get(kind) or (table.get("pooled") or {}).get(kind)
        if not e:
            return ErrorBand(0.0, 0.0, 0, "no checking data")
        return ErrorBand(float(e["p10"]), float(e["p90"]), int(e["rows"]), str(e.get("source", "")))
    return band("time"), band("memory")
