"""Per-operator profiles: measured time and memory of each operator under each layout.

For every operator node of a model's captured graph and every strategy the layout search
may pick (or only the ones a plan uses), the operator is run on the device at hand at the
shard shapes one tensor-parallel rank holds: real tensors, forward and backward timed after
warm-up with the layer profiler's clocks and repeat policy (CUDA events on GPU, the wall
or thread clock on CPU), and the bytes autograd keeps for the backward counted from the
saved tensors. Entries are keyed by the operator and its shard shapes
(:func:`search.layouts.op_key`), so one entry serves every unit, model and degree that runs
the same shard. ``OperatorProfile`` answers ``op_timing`` for :mod:`costmodel.operators`,
the way the layer profiles answer ``layer_timing``: measured where covered, roofline elsewhere.

    prof = profile_operators(capture_model(module, example_inputs=x), degree=4, device="cpu")
    prof.save("profiles/ops-cpu.json")
    search_operator_plans(module, cluster, 64, example_inputs=x, operator_profiles=prof)
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from autoplan.catalog import DeviceSpec
from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, check_text, load_json
from autoplan.files import write_text
from autoplan.limits import MAX_MICRO_BATCH
from autoplan.models.graph import ModelGraph, UnitGraph
from autoplan.models.opmeasure import local_shape, op_key
from autoplan.models.strategies import Strategy, _fx_node, node_strategies
from autoplan.profiler.timing import STATISTICS, Clock, RepeatPolicy, repeat_timed
from costmodel.operators import OpTiming

FORMAT_VERSION = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class OperatorProfile:
    """Measured operators on one device type, in one dtype."""

    device: str
    """Catalog name of the device measured (e.g. 'CPU', 'A100-SXM4-80GB')."""
    dtype: str
    entries: dict[str, dict] = field(default_factory=dict)
    """op_key -> {'micro_batch', 'forward_ms', 'backward_ms', 'saved_bytes', ...}."""
    statistic: str = "median"

    def op_timing(self, device: DeviceSpec, key: str, micro_batch: int) -> OpTiming | None:
        if device.name != self.device:
            return None
        e = self.entries.get(f"{key}|mb={micro_batch}")
        if e is None:
            return None
        return OpTiming(forward=e["forward_ms"] / 1e3, backward_input=e["backward_ms"] / 1e3,
                        backward_weight=0.0, source="measured")

    # ---------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "device": self.device, "dtype": self.dtype,
                "statistic": self.statistic, "torch": torch.__version__, "entries": self.entries}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "OperatorProfile":
        data = load_json(path, "operator profile")
        r = FieldReader(data, str(path))
        r.reject_unknown(("format_version", "device", "dtype", "statistic", "torch", "entries"))
        if r.int("format_version", minimum=1) > FORMAT_VERSION:
            raise ConfigError(r.path("format_version"), "is newer than this autoplan understands", "upgrade autoplan")
        found = r.sub("entries", {})
        if len(found.data) > MAX_PROFILE_ENTRIES:
            raise ConfigError(found.path("entries"), f"has {len(found.data):,} entries, "
                              f"at most {MAX_PROFILE_ENTRIES:,} allowed")
        entries = {}
        for key in found.data:
            check_text(key, found.where + ".<key>")
            entries[key] = _read_entry(found.sub(key))
        if r.has("torch"):
            r.str("torch")
        return cls(device=r.str("device"), dtype=r.str("dtype", choices=tuple(DTYPES)),
                   entries=entries, statistic=r.str("statistic", "median", choices=tuple(STATISTICS)))


MAX_PROFILE_ENTRIES = 1_000_000
"""Operator entries in one profile file (a model's distinct operators x strategies x shapes)."""


def _read_entry(e: FieldReader) -> dict:
    """One measured operator; every figure finite and non-negative, so the cost model never
    meets a negative or missing time."""
    e.reject_unknown(("micro_batch", "forward_ms", "backward_ms", "saved_bytes", "repeats", "wall_s"))
    out = {"micro_batch": e.int("micro_batch", minimum=1, maximum=MAX_MICRO_BATCH),
           "forward_ms": e.float("forward_ms", minimum=0.0, maximum=1e9),
           "backward_ms": e.float("backward_ms", minimum=0.0, maximum=1e9),
           "saved_bytes": e.float("saved_bytes", 0.0, minimum=0.0, maximum=1e18)}
    if e.has("repeats"):
        out["repeats"] = e.int("repeats", minimum=0)
    if e.has("wall_s"):
        out["wall_s"] = e.float("wall_s", minimum=0.0)
    return out


def _materialize(graph: UnitGraph, node, strategy: Strategy, degree: int, micro_batch: int, device: str,
                 dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for (src, idx), p in zip(node.args, strategy.inputs):
        info = graph.node(src).outputs[idx]
        shape = local_shape(info, p, degree, micro_batch)
        if info.dtype.is_floating_point:
            t = (torch.randn(shape, generator=gen) * 0.1).to(device=device, dtype=dtype).requires_grad_(True)
        else:
            # Indices: in range of whatever they index (the smallest dimension seen is safe).
            t = torch.zeros(shape, dtype=info.dtype, device=device)
        out.append(t)
    return out


def _call(fx: torch.fx.Node, tensors: list[torch.Tensor], device: str):
    it = iter(tensors)

    def fill(a):
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            return next(it)
        return a
    args = pytree.tree_map(fill, list(fx.args))
    kwargs = {k: v for k, v in fx.kwargs.items() if not isinstance(v, torch.fx.Node)}
    if "device" in kwargs:
        kwargs["device"] = torch.device(device)
    return fx.target(*args, **kwargs)


def measure_operator(graph: UnitGraph, node, strategy: Strategy, degree: int, micro_batch: int, device: str,
                     dtype: str, policy: RepeatPolicy) -> dict | None:
    """Time one operator at its shard shapes on ``device``; None where it cannot run there
    (operators whose arguments carry global sizes, kernels the device lacks)."""
    fx = _fx_node(graph, node.name)
    gen = torch.Generator().manual_seed(0)
    tensors = _materialize(graph, node, strategy, degree, micro_batch, device, DTYPES[dtype], gen)
    clock = Clock(device, policy.clock)
    saved: list[torch.Tensor] = []

    def forward():
        return _call(fx, tensors, device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            probe = forward()
    except Exception:
        return None
    outs = [o for o in pytree.tree_leaves(probe) if isinstance(o, torch.Tensor) and o.requires_grad]
    needs = [t for t in tensors if t.requires_grad]
    grads = [torch.ones_like(o) for o in outs]
    saved_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
    del probe, saved

    def step() -> dict[str, float]:
        t_f, out = clock.time(forward)
        t_b = 0.0
        if outs and needs:
            o = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad]
            t_b, _ = clock.time(lambda: torch.autograd.grad(o, needs, grads, allow_unused=True))
        return {"forward": t_f, "backward": t_b}
    t0 = time.perf_counter()
    samples = repeat_timed(policy, step)
    n = len(samples["forward"])
    stat = STATISTICS[policy.statistic]
    return {"micro_batch": micro_batch, "forward_ms": stat(samples["forward"]) * 1e3,
            "backward_ms": stat(samples["backward"]) * 1e3, "saved_bytes": float(saved_bytes),
            "repeats": n, "wall_s": time.perf_counter() - t0}


def profile_operators(model: ModelGraph, degree: int, device: str = "cpu", dtype: str = "fp32",
                      micro_batch: int = 1, policy: RepeatPolicy | None = None, device_name: str | None = None,
                      strategies: str = "all", progress=None) -> OperatorProfile:
    """Measure every operator of ``model``'s distinct units under every strategy it admits at
    ``degree`` (``strategies='all'``) or only the replicated one (``'replicated'``).
    ``device_name`` is the catalog name the cost model looks the entries up by (default:
    'CPU' on a CPU, the CUDA device's name otherwise)."""
    policy = (policy or RepeatPolicy(warmup=2, repeats=5, min_time_s=0.01)).validate()
    if device_name is None:
        device_name = "CPU" if torch.device(device).type == "cpu" else torch.cuda.get_device_name(device)
    prof = OperatorProfile(device=device_name, dtype=dtype, statistic=policy.statistic)
    done = 0
    for g in model.graphs:
        for n in g.nodes:
            if n.kind != "op":
                continue
            options = node_strategies(g, n, degree)
            if strategies == "replicated":
                options = options[:1]
            for st in options:
                key = f"{op_key(g, n, st, degree)}|mb={micro_batch}"
                if key in prof.entries:
                    continue
                e = measure_operator(g, n, st, degree, micro_batch, device, dtype, policy)
                if e is not None:
                    prof.entries[key] = e
                done += 1
                if progress is not None:
                    progress(done, key)
    return prof
