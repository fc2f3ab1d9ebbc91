"""autoplan: find the best way to split a model over a (heterogeneous) GPU cluster,
predict its step time and memory, and run it on PyTorch's distributed stack.

    import autoplan
    cluster = autoplan.Cluster.load("examples/clusters/dgx-a100-1node.json")
    model = autoplan.models.get("llama3-8b")
    plan = autoplan.Plan.uniform(model, cluster, tp=8, pp=1, dp=1, micro_batch=1, global_batch=64)
    est = autoplan.estimate(model, cluster, plan)
    result = autoplan.search(model, cluster, global_batch=512)
"""
from __future__ import annotations

import os

from autoplan import models
from autoplan.catalog import DeviceSpec, Link, get_device
from autoplan.cluster import Cluster, NodeGroup
from autoplan.errors import AutoplanError, ConfigError, NoPlanFitsError
from autoplan.plan import DeviceGroup, Plan, Stage
from autoplan.schedule import ScheduleProgram, build_program

__version__ = "0.1.0"

__all__ = ["Cluster", "NodeGroup", "DeviceSpec", "Link", "get_device", "Plan", "Stage", "DeviceGroup",
           "ScheduleProgram", "build_program", "models", "estimate", "search", "baselines", "profile",
           "AutoplanError", "ConfigError", "NoPlanFitsError"]


def _calibration(calibration):
    if calibration is None or not isinstance(calibration, (str, os.PathLike)):
        return calibration
    from costmodel.calibration import Calibration
    return Calibration.load(calibration)


def estimate(model, cluster, plan, stack=None, calibration=None, **options):
    """Predict iteration time and per-rank memory of ``plan`` on the training ``stack``
    (a name such as 'megatron-core', a stack .json path, or None for autoplan's runtime),
    optionally with a ``calibration`` (a Calibration or its .json path); other keywords
    are ``costmodel.EstimateOptions`` fields (see costmodel.estimate).

    A plan with operator layouts is estimated on the layouts' view of the model's operator
    graph (for an ``nn.Module`` pass ``example_inputs=``, and ``loss=``/``loss_target=`` if
    the layouts were searched with them)."""
    # Imported here: costmodel sits above this package's core modules in the layering.
    from costmodel import estimate as _estimate
    from autoplan.stacks import get_stack
    stack = get_stack(stack)
    if plan.layouts is not None:
        from autoplan.models.graph import ModelGraph, capture_model
        from autoplan.models.opview import plan_view
        capture = {k: options.pop(k) for k in ("example_inputs", "loss_target", "loss") if k in options}
        if "loss_target" in capture:
            capture["target"] = capture.pop("loss_target")
        if isinstance(model, models.ModelSpec) and model.config is not None:
            model = model.config
        graph = model if isinstance(model, ModelGraph) else capture_model(model, dtype=plan.dtype, **capture)
        return _estimate(plan_view(graph, plan), cluster, plan, stack=stack,
                         calibration=_calibration(calibration), **options)
    return _estimate(models.for_stack(model, stack, dtype=plan.dtype), cluster, plan, stack=stack,
                     calibration=_calibration(calibration), **options)


def search(model, cluster, global_batch: int, stack=None, calibration=None, *, layouts: bool = False,
           **constraints):
    """Find the best plans for ``model`` on ``cluster`` for the training ``stack`` (see
    search.search; ``calibration`` as for :func:`estimate`). With ``layouts=True`` every
    operator's layout on the tensor-parallel axis is searched too (any ``nn.Module``: pass
    ``example_inputs=``; see search.operators)."""
    if layouts:
        from search.operators import search_operator_plans
        return search_operator_plans(model, cluster, global_batch, stack=stack,
                                     calibration=_calibration(calibration), **constraints)
    from search import search as _search
    from autoplan.stacks import TARGET_STACKS, get_stack
    if stack is None:
        # A search for an engine assumes that engine's stack.
        stack = TARGET_STACKS.get(constraints.get("target") or "autoplan")
    stack = get_stack(stack)
    return _search(models.for_stack(model, stack), cluster, global_batch, stack=stack,
                   calibration=_calibration(calibration), **constraints)


def __getattr__(name):
    if name == "baselines":
        import importlib
        return importlib.import_module("autoplan.baselines")
    if name == "profile":
        from autoplan.profiler import profile
        return profile
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
