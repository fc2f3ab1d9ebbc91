"""Measured profiles: per-layer time and memory on a real device, and link bandwidth.

    result = autoplan.profile("gpt-tiny", device="cpu", out="profiles")
    store = autoplan.profiler.ProfileStore.load("profiles")
    est = autoplan.estimate(model, cluster, plan, profiles=store)

See docs/profiler.md.
"""
from autoplan.profiler.environment import Environment
from autoplan.profiler.fit import AlphaBeta, EfficiencyFit, fit_alpha_beta, fit_efficiency
from autoplan.profiler.links import LinkSettings, benchmark_links
from autoplan.profiler.runner import ProfileResult, plan_tasks, profile
from autoplan.profiler.shapes import ShapeKey, shape_key, shard_config
from autoplan.profiler.store import ProfileFile, ProfileStore

__all__ = ["profile", "ProfileResult", "ProfileStore", "ProfileFile", "Environment", "ShapeKey", "shape_key",
           "shard_config", "plan_tasks", "fit_efficiency", "EfficiencyFit", "fit_alpha_beta", "AlphaBeta",
           "LinkSettings", "benchmark_links"]
