"""Measured profiles: per-layer time and memory on a real device, and link bandwidth.

    result = autoplan.profile("gpt-tiny", device="cpu", out="profiles")
    store = autoplan.profiler.ProfileStore.load("profiles")
    est = autoplan.estimate(model, cluster, plan, profiles=store)

See docs/profiler.md. Names are imported on first use: the link benchmark's ranks
import this package and should not pay for the fitting and planning machinery.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "profile": "runner", "ProfileResult": "runner", "plan_tasks": "runner",
    "ProfileStore": "store", "ProfileFile": "store",
    "Environment": "environment",
    "ShapeKey": "shapes", "shape_key": "shapes", "shard_config": "shapes",
    "fit_efficiency": "fit", "EfficiencyFit": "fit", "fit_alpha_beta": "fit", "AlphaBeta": "fit",
    "LinkSettings": "links", "benchmark_links": "links",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan.profiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"autoplan.profiler.{module}"), name)
    globals()[name] = value
    return value
