"""Benchmark scenarios: the searched plan against the Megatron-LM and DeepSpeed rules.

For every scenario (a model on a cluster at a global batch, ``benchmarks/scenarios/*.json``)
this runs the search, builds the baseline plans a person would otherwise pick
(Megatron-LM's and DeepSpeed's hand rules, ``autoplan.baselines``), estimates all of them
with the same cost model, and writes ``report.md`` with figures: speed-up over each
baseline, memory per device against capacity, simulated timelines of the searched plan
and a baseline, and search time. A measured track then runs a baseline and a searched
plan of a tiny model with the runtime on this machine (gloo, two ranks) and sets the
measured step time beside the predicted one.

    python -m autoplan bench --quick --out report/
    python -m benchmarks.bench --quick --out report/      # the same, without the CLI

The core is importable (``run_scenario``, ``write_report``) so that tests can drive one
small scenario end to end.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError, ConfigError, NoPlanFitsError
from autoplan.fields import FieldReader, load_json
from autoplan.files import safe_name, write_text
from autoplan.limits import MAX_GLOBAL_BATCH, MAX_TOP_K
from autoplan.plan import Plan
from autoplan.units import GiB

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIO_DIR = REPO_ROOT / "benchmarks" / "scenarios"
BASELINES = ("megatron", "deepspeed-zero3", "deepspeed-3d")
"""Baseline plans every scenario is compared with, in report order."""
BASELINE_TITLES = {"megatron": "Megatron-LM", "deepspeed-zero3": "DeepSpeed ZeRO-3", "deepspeed-3d": "DeepSpeed 3D",
                   "searched": "autoplan (searched)"}
TOLERANCE = 1e-9
"""Relative slack when comparing iteration times (float noise, not a performance margin)."""

TARGETS = ("megatron", "deepspeed", "torchtitan")
"""Engines the searched plan is also found for (``search --for``), each against its own rule."""
TARGET_RULES = {
    "megatron": ("Megatron-LM rule", lambda m, c, gb, dtype, stack: _baselines().megatron(m, c, gb, dtype=dtype,
                                                                                         stack=stack)),
    # DeepSpeed's config expresses the ZeRO-3 recipe (its 3D recipe needs Megatron-DeepSpeed's
    # tensor-parallel model code).
    "deepspeed": ("DeepSpeed ZeRO-3 rule",
                  lambda m, c, gb, dtype, stack: _baselines().deepspeed(m, c, gb, variant="zero3", dtype=dtype,
                                                                        stack=stack)),
    # torchtitan's default layout: FSDP2 over every GPU (data_parallel_shard_degree = -1),
    # the ZeRO-3 recipe's plan.
    "torchtitan": ("torchtitan default (FSDP2 on all GPUs)",
                   lambda m, c, gb, dtype, stack: _baselines().deepspeed(m, c, gb, variant="zero3", dtype=dtype,
                                                                         stack=stack)),
}
"""Per target engine: (title, rule) of the hand rule a user of that engine would follow."""


def _baselines():
    from autoplan import baselines
    return baselines


# ----------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Scenario:
    """One benchmark: a model on a cluster at a global batch size."""

    name: str
    """Identifier, also the stem of the figure files."""
    model: str
    """Zoo preset name or a HuggingFace config.json path."""
    cluster: Cluster
    """The cluster, read from a cluster.json or built from a homogeneous spec."""
    cluster_source: str
    """Where the cluster came from (a file path relative to the repository, or 'homogeneous')."""
    global_batch: int
    """Samples per iteration."""
    overrides: dict = field(default_factory=dict)
    """Model config overrides, e.g. {"seq_len": 4096}."""
    top_k: int = 3
    """Plans the search returns (the report lists them)."""
    quick: bool = False
    """Part of the `--quick` subset."""
    description: str = ""
    """Why the scenario is in the suite; shown in the report."""
    search_options: dict = field(default_factory=dict)
    """Extra keyword arguments for search.search (constraints)."""

    @property
    def mixed(self) -> bool:
        return not self.cluster.is_homogeneous

    def build_model(self):
        from autoplan import models
        return models.get(self.model, **self.overrides)

    @classmethod
    def from_dict(cls, data: dict, where: str, base_dir: Path | None = None) -> "Scenario":
        r = FieldReader(data, where)
        r.reject_unknown(("name", "model", "overrides", "cluster", "global_batch", "top_k", "quick",
                          "description", "search"))
        raw = r.raw("cluster")
        if isinstance(raw, str):
            path = _resolve(raw, base_dir)
            if path is None:
                raise ConfigError(r.path("cluster"), f"file {raw!r} not found",
                                  "give a path relative to the repository root or to the scenario file")
            cluster, source = Cluster.load(path), raw
        else:
            c = r.sub("cluster")
            c.reject_unknown(("device", "nodes", "gpus_per_node", "intra_node_GBps", "inter_node_GBps",
                              "inter_node_latency_us", "name"))
            cluster = Cluster.homogeneous(
                c.str("device"), c.int("nodes", minimum=1), c.int("gpus_per_node", minimum=1),
                intra_node_GBps=c.float("intra_node_GBps", None, positive=True),
                inter_node_GBps=c.float("inter_node_GBps", None, positive=True),
                inter_node_latency_us=c.float("inter_node_latency_us", None, minimum=0.0),
                name=c.str("name", None))
            source = "homogeneous"
        overrides = dict(r.sub("overrides", {}).data) if r.has("overrides") else {}
        search = dict(r.sub("search", {}).data) if r.has("search") else {}
        for key in ("global_batch", "top_k", "progress", "profiles", "options"):
            if key in search:
                raise ConfigError(f"{r.path('search')}.{key}", "is set by the benchmark itself",
                                  "use the scenario's own field instead" if key in ("global_batch", "top_k")
                                  else "remove it")
        from search.space import Constraints
        try:
            Constraints.build(**search)
        except ConfigError as e:
            raise ConfigError(f"{r.path('search')}.{e.field}", e.problem, e.fix) from None
        # The name becomes the stem of figure files: one safe path component only.
        name = safe_name(r.str("name"), r.path("name"))
        return cls(name=name, model=r.str("model"), cluster=cluster, cluster_source=source,
                   global_batch=r.int("global_batch", minimum=1, maximum=MAX_GLOBAL_BATCH), overrides=overrides,
                   top_k=r.int("top_k", 3, minimum=1, maximum=MAX_TOP_K), quick=r.bool("quick", False),
                   description=r.str("description", "", multiline=True), search_options=search)

    @classmethod
    def load(cls, path: str | Path) -> "Scenario":
        path = Path(path)
        return cls.from_dict(load_json(path, "scenario"), where=path.name, base_dir=path.parent)


def _resolve(raw: str, base_dir: Path | None) -> Path | None:
    p = Path(raw)
    if p.is_absolute():
        return p if p.is_file() else None
    for root in ([base_dir] if base_dir else []) + [Path.cwd(), REPO_ROOT]:
        if (root / p).is_file():
            return root / p
    return None


def load_scenarios(directory: str | Path = SCENARIO_DIR, quick: bool = False,
                   only: Sequence[str] = ()) -> list[Scenario]:
    """Scenarios of ``directory`` in file-name order; ``quick`` keeps the quick subset,
    ``only`` keeps the named ones (unknown names are an error)."""
    directory = Path(directory)
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ConfigError("scenarios", f"no *.json scenario files in {directory}")
    scenarios = [Scenario.load(f) for f in files]
    names = [s.name for s in scenarios]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError("scenarios", f"scenario names must be unique, repeated: {sorted(dup)}")
    if only:
        from autoplan.errors import closest
        for n in only:
            if n not in names:
                raise ConfigError("only", f"no scenario named {n!r}", closest(n, names) or
                                  f"known: {', '.join(names)}")
        scenarios = [s for s in scenarios if s.name in only]
    elif quick:
        scenarios = [s for s in scenarios if s.quick]
    return scenarios


# ----------------------------------------------------------------------------- results
@dataclass
class PlanResult:
    """One plan of a scenario with its estimate, or why there is none."""

    name: str
    """'searched' or a baseline name (see BASELINES)."""
    plan: Plan | None = None
    """The plan; None when the rule or search produced none."""
    estimate: Any = None
    """costmodel.Estimate of the plan."""
    error: str | None = None
    """Why there is no plan or estimate (the rule's own message)."""
    seconds: float = 0.0
    """Wall time to produce the plan (the search time for 'searched')."""

    @property
    def title(self) -> str:
        return BASELINE_TITLES.get(self.name, self.name)

    @property
    def fits(self) -> bool:
        return self.estimate is not None and bool(self.estimate.fits)

    @property
    def time(self) -> float | None:
        return None if self.estimate is None else self.estimate.iteration_time_s


@dataclass
class MemoryShortfall:
    """The worst pipeline group of a plan that does not fit."""

    group: int
    """Pipeline rank (index into plan.groups)."""
    devices: str
    """Node-group name(s) of the group's devices."""
    needed: float
    """Peak bytes per GPU the group needs."""
    available: float
    """Bytes of its smallest device."""
    smallest: str = ""
    """Node-group name of that smallest device."""


@dataclass
class Headroom:
    """Memory margin of one device type of a cluster under a plan."""

    devices: str
    """Node-group name."""
    used: int
    """GPUs of this group the plan uses."""
    total: int
    """GPUs of this group in the cluster."""
    peak: float
    """Largest per-GPU peak on this group's GPUs, bytes."""
    capacity: float
    """Device memory, bytes."""

    @property
    def margin(self) -> float:
        return self.capacity - self.peak


@dataclass
class ScenarioResult:
    """Everything the report shows about one scenario."""

    scenario: Scenario
    model: Any
    """The ModelSpec."""
    searched: PlanResult
    baselines: list[PlanResult]
    ranked: list[tuple[Plan, Any]] = field(default_factory=list)
    """The search's top-k (plan, estimate), best first."""
    stats: dict = field(default_factory=dict)
    """Search statistics as the search reports them."""
    stats_text: str = ""
    """The search's own summary of its statistics (shown in the report when present)."""
    targets: list = field(default_factory=list)
    """Per target engine: (engine, searched PlanResult, rule PlanResult, rule title)."""

    @property
    def cluster(self) -> Cluster:
        return self.scenario.cluster

    def speedup(self, baseline: PlanResult) -> float | None:
        """Baseline time over searched time, for a baseline that fits (None otherwise)."""
        if not baseline.fits or not self.searched.fits:
            return None
        return baseline.time / self.searched.time

    def at_least_as_fast(self) -> bool | None:
        """Whether the searched plan is at least as fast as every baseline that fits
        (None when the search found no plan that fits)."""
        if not self.searched.fits:
            return None
        return all(b.time >= self.searched.time * (1 - TOLERANCE) for b in self.baselines if b.fits)

    def best_fitting_baseline(self) -> PlanResult | None:
        fitting = [b for b in self.baselines if b.fits]
        return min(fitting, key=lambda b: b.time) if fitting else None

    def shortfall(self, result: PlanResult) -> MemoryShortfall | None:
        if result.estimate is None or result.estimate.fits:
            return None
        from autoplan.plots import memory_bars
        bars = memory_bars(result.estimate, self.cluster)
        g = max(range(len(bars)), key=lambda i: bars[i].total / bars[i].capacity)
        devices = bars[g].label.split("\n")[-1]
        ranks = result.plan.groups[g].ranks
        low = min(ranks, key=lambda r: self.cluster.slots[r].device.memory_bytes)
        smallest = self.cluster.groups[self.cluster.slots[low].group].name
        return MemoryShortfall(group=g, devices=devices, needed=bars[g].total, available=bars[g].capacity,
                               smallest=smallest)

    def headroom(self, result: PlanResult) -> list[Headroom]:
        if result.estimate is None:
            return []
        out = []
        for gi, group in enumerate(self.cluster.groups):
            ranks = [r for r in self.cluster.group_ranks(gi) if r in result.estimate.memory_by_rank]
            peak = max((result.estimate.memory_by_rank[r] for r in ranks), default=0.0)
            out.append(Headroom(devices=group.name, used=len(ranks), total=group.num_gpus, peak=peak,
                                capacity=group.device.memory_bytes))
        return out


def estimate_plan(name: str, model, cluster: Cluster, make: Callable[[], Plan], **options) -> PlanResult:
    """Build a plan with ``make`` and estimate it (``options``: estimate options such as
    ``profiles``); an autoplan error from either becomes the result's ``error`` (a rule
    that finds no plan is a result, not a crash)."""
    import autoplan
    t0 = time.perf_counter()
    try:
        plan = make()
    except AutoplanError as e:
        return PlanResult(name, error=str(e), seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    try:
        est = autoplan.estimate(model, cluster, plan, **options)
    except AutoplanError as e:
        return PlanResult(name, plan=plan, error=f"estimate failed: {e}", seconds=seconds)
    return PlanResult(name, plan=plan, estimate=est, seconds=seconds)


def run_baselines(model, cluster: Cluster, global_batch: int) -> list[PlanResult]:
    """The Megatron-LM rule and both DeepSpeed rules (autoplan.baselines)."""
    from autoplan import baselines
    makers = {
        "megatron": lambda: baselines.megatron(model, cluster, global_batch),
        "deepspeed-zero3": lambda: baselines.deepspeed(model, cluster, global_batch, variant="zero3"),
        "deepspeed-3d": lambda: baselines.deepspeed(model, cluster, global_batch, variant="3d"),
    }
    return [estimate_plan(name, model, cluster, makers[name]) for name in BASELINES]


def run_search(model, cluster: Cluster, global_batch: int, top_k: int = 3,
               options: dict | None = None) -> tuple[PlanResult, list, dict, str]:
    """(best, ranked top-k, stats, stats summary) of search.search. A search that finds no
    plan that fits is a result; a bad option is the scenario's error and propagates."""
    from search import search as _search
    t0 = time.perf_counter()
    try:
        result = _search(model, cluster, global_batch, progress=False, **(options or {}))
    except NoPlanFitsError as e:
        return PlanResult("searched", error=str(e), seconds=time.perf_counter() - t0), [], {}, ""
    seconds = time.perf_counter() - t0
    best = result.best
    ranked = [(r.plan, r.estimate) for r in list(result.ranked or [])[:top_k]]
    stats = getattr(result, "stats", None)
    text = stats.summary() if hasattr(stats, "summary") else ""
    return (PlanResult("searched", plan=best.plan, estimate=best.estimate, seconds=seconds), ranked,
            _as_dict(stats), text)


def _as_dict(stats) -> dict:
    if stats is None:
        return {}
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    if isinstance(stats, dict):
        return dict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


def run_targets(model, cluster: Cluster, global_batch: int, targets: Sequence[str], options: dict | None = None,
                log: Callable[[str], None] = lambda s: None, name: str = "") -> list:
    """Per engine: the plan ``search --for`` finds and the engine's own hand rule, both in the
    dtype the engine uses on this cluster and estimated by the same cost model."""
    import autoplan
    from autoplan.engines import get_engine
    out = []
    for t in targets:
        engine = get_engine(t)
        dtype = engine.dtype_for(cluster, model.dtype)
        # The model as the engine's stack runs it, in the engine's dtype; the search and the
        # rule are both estimated on that stack.
        m = autoplan.models.for_stack(model.config if model.config is not None else model, engine.stack, dtype)
        title, rule = TARGET_RULES[t]
        try:
            searched, *_ = run_search(m, cluster, global_batch, 1, {**(options or {}), "target": t,
                                                                    "stack": engine.stack})
        except ConfigError as e:   # the engine does not build this model at all
            log(f"[{name}] --for {t}: {e}")
            out.append((engine, PlanResult(t, error=str(e)), PlanResult(t, error="–"), title))
            continue
        base = estimate_plan(t, m, cluster, lambda: rule(m, cluster, global_batch, dtype, engine.stack),
                             stack=engine.stack)
        log(f"[{name}] --for {t}: " + (f"{searched.time:.4g} s/iteration" if searched.time else "no plan")
            + f"; {title}: " + (f"{base.time:.4g} s/iteration, fits={base.fits}" if base.time else "no plan"))
        out.append((engine, searched, base, title))
    return out


def run_scenario(scenario: Scenario, log: Callable[[str], None] = lambda s: None,
                 targets: Sequence[str] = ()) -> ScenarioResult:
    """Search, baselines and estimates of one scenario (and, per engine in ``targets``, the
    plan searched for it against its hand rule)."""
    model = scenario.build_model()
    log(f"[{scenario.name}] {model.describe()} on {scenario.cluster.num_gpus} GPUs, "
        f"global batch {scenario.global_batch}")
    try:
        searched, ranked, stats, stats_text = run_search(model, scenario.cluster, scenario.global_batch,
                                                         scenario.top_k, scenario.search_options)
    except ConfigError as e:
        raise ConfigError(f"{scenario.name}: {e.field}", e.problem, e.fix) from None
    log(f"[{scenario.name}] search: {searched.seconds:.1f} s, "
        + (f"{searched.time:.4g} s/iteration" if searched.time else f"no plan ({searched.error})"))
    baselines = run_baselines(model, scenario.cluster, scenario.global_batch)
    for b in baselines:
        log(f"[{scenario.name}] {b.name}: " + (f"{b.time:.4g} s/iteration, fits={b.fits}" if b.time
                                               else f"no plan ({b.error})"))
    per_target = run_targets(model, scenario.cluster, scenario.global_batch, targets, scenario.search_options,
                             log, scenario.name)
    return ScenarioResult(scenario=scenario, model=model, searched=searched, baselines=baselines,
                          ranked=ranked, stats=stats, stats_text=stats_text, targets=per_target)


# ----------------------------------------------------------------------------- measured track
@dataclass
class MeasuredRun:
    """One plan run by the runtime on this machine."""

    name: str
    """'searched' or 'megatron'."""
    plan: Plan | None
    predicted_s: float | None
    """Cost-model iteration time on the CPU cluster."""
    measured_s: float | None
    """Median measured step time (first step excluded), from the runtime's run record."""
    record: str | None = None
    """Path of the run record (relative to the report)."""
    error: str | None = None
    sources: str = ""
    """Where the prediction's layer times came from, per device ('measured' profile or 'roofline')."""


@dataclass
class MeasuredTrack:
    """The measured part of the report."""

    model: str
    ranks: int
    steps: int
    runs: list[MeasuredRun] = field(default_factory=list)
    skipped: str | None = None
    """Why the track did not run (only when the runtime module is absent)."""


def runtime_available() -> bool:
    """The runtime package and its `run` command both exist."""
    import importlib.util
    return (importlib.util.find_spec("autoplan.runtime") is not None
            and importlib.util.find_spec("autoplan.commands.run") is not None)


def cpu_cluster(ranks: int) -> Cluster:
    """The CPU cluster of ``examples/clusters/cpu-4ranks.json`` cut to ``ranks`` ranks."""
    data = json.loads((REPO_ROOT / "examples" / "clusters" / "cpu-4ranks.json").read_text())
    data["name"] = f"cpu-{ranks}ranks"
    data["node_groups"][0]["gpus_per_node"] = ranks
    return Cluster.from_dict(data, where=data["name"])


def run_measured(out_dir: Path, model_name: str = "gpt-tiny", ranks: int = 2, steps: int = 6,
                 global_batch: int = 8, timeout_s: float = 600.0,
                 log: Callable[[str], None] = lambda s: None) -> MeasuredTrack:
    """Run the Megatron baseline and the searched plan of a tiny model with the runtime
    (``autoplan run``, gloo on CPU) and compare measured with predicted step time."""
    import autoplan
    track = MeasuredTrack(model=model_name, ranks=ranks, steps=steps)
    if not runtime_available():
        track.skipped = "runtime not available (autoplan.runtime / `autoplan run` are absent)"
        return track
    cluster = cpu_cluster(ranks)
    # The runtime computes in fp32 on CPUs (its record says so), and the shipped CPU
    # profiles are fp32: plan and predict in fp32 so the prediction is of what runs.
    model = autoplan.models.get(model_name, dtype="fp32")
    profiles = _shipped_profiles()
    options = {"profiles": profiles} if profiles is not None else {}
    searched = run_search(model, cluster, global_batch, top_k=1, options=options)[0]
    from autoplan import baselines
    base = estimate_plan("megatron", model, cluster,
                         lambda: dataclasses.replace(baselines.megatron(model, cluster, global_batch), dtype="fp32"),
                         **options)
    run_dir = out_dir / "measured"
    run_dir.mkdir(parents=True, exist_ok=True)
    for res in (base, searched):
        run = MeasuredRun(res.name, res.plan, res.time, None,
                          sources=", ".join(f"{d}: {src}" for d, src in res.estimate.sources.items())
                          if res.estimate is not None else "")
        track.runs.append(run)
        if res.plan is None:
            run.error = res.error
            continue
        plan_path = run_dir / f"{res.name}-plan.json"
        rec_path = run_dir / f"{res.name}-run.json"
        res.plan.save(plan_path)
        cmd = [sys.executable, "-m", "autoplan", "run", str(plan_path), "--model", model_name,
               "--steps", str(steps), "--out", str(rec_path)]
        log(f"[measured] {res.name}: {res.plan.describe()}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                        os.environ.get("PYTHONPATH")])))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT, env=env)
        except subprocess.TimeoutExpired:
            run.error = f"timed out after {timeout_s:.0f} s"
            continue
        if proc.returncode != 0 or not rec_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            run.error = f"`autoplan run` exited {proc.returncode}: " + " | ".join(tail)
            continue
        from autoplan.runtime import load_record
        record = load_record(rec_path)
        run.record = str(rec_path.relative_to(out_dir))
        # The record's median leaves out the first step (one-off set-up).
        run.measured_s = record.step_time_s
    return track


def _shipped_profiles():
    """The CPU layer profiles shipped in autoplan/data/profiles, or None without a profiler."""
    try:
        from autoplan.profiler import ProfileStore
        return ProfileStore.shipped()
    except (ImportError, AttributeError, AutoplanError):
        return None


# ----------------------------------------------------------------------------- report
def _fmt_time(t: float | None) -> str:
    if t is None:
        return "–"
    return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.1f} ms"


def _fmt_secs(t: float) -> str:
    return f"{t:.2f} s" if t < 10 else f"{t:.0f} s"


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def baseline_cell(res: ScenarioResult, b: PlanResult) -> str:
    """One summary-table cell: the speed-up, or why there is none."""
    if b.estimate is None:
        return "no plan"
    if not b.fits:
        s = res.shortfall(b)
        return f"does not fit ({_gib(s.needed)} > {_gib(s.available)} GiB)"
    sp = res.speedup(b)
    return f"{sp:.2f}x" if sp is not None else "–"


def verdict(res: ScenarioResult) -> str:
    ok = res.at_least_as_fast()
    fitting = [b for b in res.baselines if b.fits]
    if ok is None:
        return "no searched plan fits"
    if not fitting:
        return "yes (no baseline fits)"
    return "yes" if ok else "**NO**"


def plot_speedups(results: Sequence[ScenarioResult], path: Path) -> None:
    from autoplan.plots import _plt
    plt = _plt()
    n = len(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.25 * n + 2), 4.4))
    width = 0.26
    colors = {"megatron": "#4C72B0", "deepspeed-zero3": "#DD8452", "deepspeed-3d": "#55A868"}
    top = 1.0
    for j, name in enumerate(BASELINES):
        for i, res in enumerate(results):
            b = next(x for x in res.baselines if x.name == name)
            x = i + (j - 1) * width
            sp = res.speedup(b)
            if sp is not None:
                ax.bar(x, sp, width, color=colors[name], label=BASELINE_TITLES[name] if i == 0 else None)
                ax.text(x, sp, f"{sp:.2f}", ha="center", va="bottom", fontsize=6)
                top = max(top, sp)
            else:
                ax.bar(x, 0, width, color=colors[name], label=BASELINE_TITLES[name] if i == 0 else None)
                tag = "OOM" if b.estimate is not None and not b.fits else "n/a"
                ax.text(x, 0.02, tag, ha="center", va="bottom", fontsize=6, rotation=90, color="#C44E52")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(n))
    ax.set_xticklabels([r.scenario.name for r in results], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("speed-up: baseline time / searched time")
    ax.set_ylim(0, top * 1.15)
    ax.set_title("Searched plan vs baselines (estimated iteration time); OOM = baseline does not fit", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_search_times(results: Sequence[ScenarioResult], path: Path) -> None:
    from autoplan.plots import _plt
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(results) + 2), 4.0))
    xs = range(len(results))
    secs = [max(r.searched.seconds, 1e-3) for r in results]
    ax.bar(xs, secs, color=["#C44E52" if r.scenario.mixed else "#4C72B0" for r in results])
    for x, r, s in zip(xs, results, secs):
        ax.text(x, s, f"{_fmt_secs(s)}\n{r.cluster.num_gpus} GPUs", ha="center", va="bottom", fontsize=6)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.scenario.name for r in results], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("search wall time (s, log scale)")
    ax.set_title("Search time per scenario (red: mixed cluster)", fontsize=9)
    ax.set_ylim(top=max(secs) * 4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_measured(track: MeasuredTrack, path: Path) -> bool:
    runs = [r for r in track.runs if r.measured_s is not None and r.predicted_s is not None]
    if not runs:
        return False
    from autoplan.plots import _plt
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    xs = range(len(runs))
    ax.bar([x - 0.18 for x in xs], [r.predicted_s * 1e3 for r in runs], 0.36, label="predicted", color="#4C72B0")
    ax.bar([x + 0.18 for x in xs], [r.measured_s * 1e3 for r in runs], 0.36, label="measured", color="#DD8452")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([BASELINE_TITLES.get(r.name, r.name) for r in runs], fontsize=7)
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{track.model} on {track.ranks} CPU ranks (gloo)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _scenario_section(res: ScenarioResult, out_dir: Path) -> list[str]:
    from autoplan.plots import plot_memory_grid, plot_timelines
    sc, model, cluster = res.scenario, res.model, res.cluster
    lines = [f"## {sc.name}", ""]
    if sc.description:
        lines += [sc.description, ""]
    kinds = ", ".join(f"{g.nodes}x{g.gpus_per_node} {g.device.name}" for g in cluster.groups)
    lines += [f"- model: **{model.name}** ({model.num_params / 1e9:.2f}B parameters, {model.num_layers} units, "
              f"sequence {model.seq_len})" + (f", overrides {sc.overrides}" if sc.overrides else ""),
              f"- cluster: **{cluster.name}** ({cluster.num_gpus} GPUs: {kinds}; source: {sc.cluster_source})",
              f"- global batch: {sc.global_batch}",
              f"- search: {_fmt_secs(res.searched.seconds)} wall time"
              + (f", options {sc.search_options}" if sc.search_options else ""), ""]
    if res.stats_text:
        lines += ["```", res.stats_text, "```", ""]
    elif res.stats:
        lines += ["Search statistics: " + ", ".join(f"{k}={_short(v)}" for k, v in res.stats.items()), ""]
    rows = []
    for r in [res.searched] + res.baselines:
        if r.estimate is None:
            rows.append([r.title, f"no plan: {r.error}", "–", "–", "–", "–", "–", "–", "–"])
            continue
        e = r.estimate
        sp = "–" if r is res.searched else (f"{res.speedup(r):.2f}x" if res.speedup(r) else "–")
        fit = "yes" if e.fits else "**no**"
        rows.append([r.title, f"`{r.plan.describe()}`", f"{r.plan.num_gpus}/{cluster.num_gpus}",
                     _fmt_time(e.iteration_time_s), f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                     _gib(e.peak_memory_bytes), fit, sp])
    lines += [_md_table(["plan", "configuration", "GPUs used", "iteration", "tokens/s", "MFU", "peak GiB/GPU",
                         "fits", "searched speed-up"], rows), ""]
    ok = res.at_least_as_fast()
    fitting = [b for b in res.baselines if b.fits]
    if ok is None:
        lines.append(f"**Result:** the search found no plan that fits ({res.searched.error or 'estimate does not fit'}).")
    elif not fitting:
        lines.append("**Result:** the searched plan fits and no baseline does.")
    else:
        parts = ", ".join(f"{res.speedup(b):.2f}x vs {b.title}" for b in fitting)
        claim = ("is at least as fast as every baseline that fits" if ok
                 else "is SLOWER than a baseline that fits")
        lines.append(f"**Result:** the searched plan {claim} ({parts}).")
    for b in res.baselines:
        if b.estimate is None:
            lines.append(f"- {b.title}: the rule produced no plan: {b.error}")
        elif not b.fits:
            s = res.shortfall(b)
            where = "" if s.smallest == s.devices else f" on its smallest device ({s.smallest})"
            lines.append(f"- {b.title} does not fit: pipeline group {s.group} ({s.devices}) needs "
                         f"{_gib(s.needed)} GiB per GPU, {_gib(s.available)} GiB available{where}.")
    if sc.mixed and res.searched.fits:
        best = res.best_fitting_baseline()
        if best is not None:
            margin = best.time / res.searched.time - 1
            lines.append(f"- Mixed-cluster margin: {margin:+.1%} over the best fitting baseline ({best.title}, "
                         f"{_fmt_time(best.time)} vs {_fmt_time(res.searched.time)}).")
        else:
            lines.append("- Mixed-cluster margin: no baseline fits, so the searched plan is the only one that runs.")
        rows = [[h.devices, f"{h.used}/{h.total}", _gib(h.peak), _gib(h.capacity), _gib(h.margin)]
                for h in res.headroom(res.searched)]
        lines += ["", "Memory margin of the searched plan per device type:", "",
                  _md_table(["devices", "GPUs used", "peak GiB/GPU", "capacity GiB", "margin GiB"], rows)]
    lines.append("")
    # Figures: timeline of the searched plan against the most relevant baseline (the
    # Megatron rule if it produced a plan, otherwise the first that did).
    if res.searched.estimate is not None:
        other = next((b for b in res.baselines if b.estimate is not None and b.fits), None) or \
            next((b for b in res.baselines if b.estimate is not None), None)
        items = [(res.searched.estimate, BASELINE_TITLES["searched"])]
        if other is not None:
            items.append((other.estimate, other.title + ("" if other.fits else " (does not fit)")))
        tl = f"{sc.name}-timeline.png"
        plot_timelines(items, out_dir / tl)
        mem_items = [(r.estimate, r.title) for r in [res.searched] + res.baselines if r.estimate is not None]
        mem = f"{sc.name}-memory.png"
        plot_memory_grid(mem_items, cluster, out_dir / mem)
        lines += [f"![timeline of {sc.name}]({tl})", "", f"![memory of {sc.name}]({mem})", ""]
    if len(res.ranked) > 1:
        rows = [[str(i + 1), f"`{p.describe()}`", _fmt_time(e.iteration_time_s), _gib(e.peak_memory_bytes)]
                for i, (p, e) in enumerate(res.ranked)]
        lines += [f"Top {len(res.ranked)} searched plans:", "",
                  _md_table(["#", "plan", "iteration", "peak GiB/GPU"], rows), ""]
    return lines


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (dict, list)) and len(str(v)) > 60:
        return f"<{type(v).__name__} of {len(v)}>"
    return str(v)


def write_report(results: Sequence[ScenarioResult], out_dir: str | Path, measured: MeasuredTrack | None = None,
                 command: str = "autoplan bench", wall_s: float | None = None) -> Path:
    """Write report.md and its figures into ``out_dir``; returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch
    lines = ["# autoplan benchmark: searched plans vs Megatron-LM and DeepSpeed rules", "",
             f"Generated by `{command}` with torch {torch.__version__}, Python {platform.python_version()}"
             + (f", in {wall_s:.0f} s" if wall_s is not None else "") + ".",
             "All iteration times and memory figures are cost-model estimates (autoplan.estimate) of each plan "
             "on the scenario's cluster; every plan is estimated by the same model, so the comparison is of the "
             "plans, not of the frameworks' implementations. A baseline that does not fit in device memory is "
             "not a contender; the table says how much memory it would need.", "", "## Summary", ""]
    rows = []
    for res in results:
        sc = res.scenario
        cells = [baseline_cell(res, b) for b in res.baselines]
        plan = f"`{res.searched.plan.describe()}`" if res.searched.plan else f"no plan ({res.searched.error})"
        rows.append([sc.name, res.model.name, f"{res.cluster.num_gpus}" + (" (mixed)" if sc.mixed else ""),
                     str(sc.global_batch), plan, _fmt_time(res.searched.time), *cells, verdict(res),
                     _fmt_secs(res.searched.seconds)])
    lines += [_md_table(["scenario", "model", "GPUs", "batch", "searched plan", "iteration",
                         *(f"vs {BASELINE_TITLES[b]}" for b in BASELINES), "searched ≥ baselines that fit",
                         "search time"], rows), ""]
    if results:
        plot_speedups(results, out_dir / "speedup.png")
        plot_search_times(results, out_dir / "search_time.png")
        lines += ["![speed-up over baselines](speedup.png)", "", "![search time](search_time.png)", ""]
    mixed = [r for r in results if r.scenario.mixed]
    if mixed:
        lines += ["### Mixed clusters", ""]
        for res in mixed:
            best = res.best_fitting_baseline()
            if res.searched.fits and best is not None:
                lines.append(f"- {res.scenario.name}: margin {best.time / res.searched.time - 1:+.1%} over the best "
                             f"fitting baseline ({best.title}).")
            elif res.searched.fits:
                lines.append(f"- {res.scenario.name}: no baseline fits; the searched plan does.")
            else:
                lines.append(f"- {res.scenario.name}: no searched plan fits.")
        lines.append("")
    lines += _targets_section(results)
    for res in results:
        lines += _scenario_section(res, out_dir)
    lines += _measured_section(measured, out_dir)
    path = out_dir / "report.md"
    write_text(path, "\n".join(lines).rstrip() + "\n")
    return path


def _clip(text: str, limit: int) -> str:
    """``text`` cut at the last word boundary within ``limit`` characters, marked with an ellipsis."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " …"


def _targets_section(results: Sequence[ScenarioResult]) -> list[str]:
    """Per scenario and engine: the plan ``search --for ENGINE`` finds against that engine's hand rule."""
    if not any(res.targets for res in results):
        return []
    lines = ["## Per engine: `search --for ENGINE` against the engine's own rule", "",
             "The searched plan is restricted to what the engine can run (autoplan.engines; `autoplan export --to "
             "ENGINE` writes it), in the dtype the engine uses on the cluster (fp16 on V100/T4 for Megatron-LM and "
             "DeepSpeed, fp32 for torchtitan, which has no fp16); the rule is what a user of that engine would "
             "write by hand, in the same dtype. Both are estimated by the same cost model.", ""]
    rows = []
    for res in results:
        for engine, searched, base, title in res.targets:
            plan = f"`{searched.plan.describe()}` ({searched.plan.dtype})" if searched.plan \
                else f"no plan ({_clip(searched.error or '', 120)})"
            speed = (f"{base.time / searched.time:.2f}x" if searched.fits and base.fits else
                     "rule does not fit" if searched.fits else "–")
            if base.estimate is None:
                rule_cell = "–"
            elif base.fits:
                rule_cell = _fmt_time(base.time)
            else:
                short = res.shortfall(base)
                rule_cell = f"does not fit ({_gib(short.needed)} > {_gib(short.available)} GiB)"
            rows.append([res.scenario.name, f"{engine.title} {engine.version}", plan, _fmt_time(searched.time),
                         title, rule_cell, speed, _fmt_secs(searched.seconds)])
    lines += [_md_table(["scenario", "engine", "searched for the engine", "iteration", "rule", "rule iteration",
                         "speed-up over the rule", "search time"], rows), ""]
    return lines


def _measured_section(track: MeasuredTrack | None, out_dir: Path) -> list[str]:
    lines = ["## Measured track (this machine)", ""]
    if track is None:
        return lines + ["Not run (`--no-measured`).", ""]
    if track.skipped:
        return lines + [f"skipped: {track.skipped}", ""]
    lines += [f"{track.model} on {track.ranks} CPU ranks with the gloo backend, {track.steps} steps each, run by "
              "`autoplan run` (torchrun). Measured = the run record's median step time (first step left out); "
              "predicted = the cost model on the CPU cluster in fp32 (what the runtime computes in on CPUs), "
              "from the CPU layer profiles shipped in autoplan/data/profiles where they apply ('measured') and the "
              "catalog roofline otherwise.", ""]
    rows = []
    for r in track.runs:
        ratio = f"{r.measured_s / r.predicted_s:.2f}" if r.measured_s and r.predicted_s else "–"
        plan = f"`{r.plan.describe()}`" if r.plan else "–"
        rows.append([BASELINE_TITLES.get(r.name, r.name), plan, _fmt_time(r.predicted_s), _fmt_time(r.measured_s),
                     ratio, r.sources or "–", r.error or (f"[record]({r.record})" if r.record else "")])
    lines += [_md_table(["plan", "configuration", "predicted", "measured", "measured / predicted",
                         "prediction source", "notes"], rows), ""]
    done = {r.name: r for r in track.runs if r.measured_s and r.predicted_s}
    if "searched" in done and "megatron" in done:
        s, b = done["searched"], done["megatron"]
        lines += [f"Searched plan over the Megatron baseline: measured {b.measured_s / s.measured_s:.2f}x, "
                  f"predicted {b.predicted_s / s.predicted_s:.2f}x.", ""]
    if plot_measured(track, out_dir / "measured.png"):
        lines += ["![predicted vs measured](measured.png)", ""]
    return lines


# ----------------------------------------------------------------------------- driver
def run(scenarios_dir: str | Path = SCENARIO_DIR, out_dir: str | Path = "report", quick: bool = False,
        only: Sequence[str] = (), measured: bool = True, steps: int = 6,
        log: Callable[[str], None] = print, command: str = "autoplan bench",
        targets: Sequence[str] = TARGETS) -> Path:
    """Run the scenarios and write the report; returns the report's path."""
    t0 = time.perf_counter()
    scenarios = load_scenarios(scenarios_dir, quick=quick, only=only)
    out_dir = Path(out_dir)
    results = [run_scenario(s, log=log, targets=targets) for s in scenarios]
    track = run_measured(out_dir, steps=steps, log=log) if measured else None
    if track is not None and track.skipped:
        log(f"[measured] skipped: {track.skipped}")
    path = write_report(results, out_dir, track, command=command, wall_s=time.perf_counter() - t0)
    log(f"wrote {path}")
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", default=str(SCENARIO_DIR), help="directory of scenario *.json files")
    p.add_argument("--out", default="report", help="directory for report.md and its figures")
    p.add_argument("--quick", action="store_true", help="only the scenarios marked quick (a few minutes)")
    p.add_argument("--only", nargs="+", default=(), metavar="NAME", help="only these scenarios")
    p.add_argument("--no-measured", action="store_true", help="skip the measured track (runtime on this machine)")
    p.add_argument("--steps", type=int, default=6, help="steps per measured run (default 6)")
    p.add_argument("--targets", default=",".join(TARGETS), type=_target_list,
                   help="engines to also search for, each against its own rule (comma-separated; 'none' for none; "
                        f"default {','.join(TARGETS)})")


def _target_list(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none")
    for t in names:
        if t not in TARGETS:
            raise argparse.ArgumentTypeError(f"{t!r} is not an engine ({', '.join(TARGETS)})")
    return names


def main(argv: list[str] | None = None, command: str = "python -m benchmarks.bench") -> int:
    p = argparse.ArgumentParser(prog=command, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run(args.scenarios, args.out, quick=args.quick, only=args.only, measured=not args.no_measured,
            steps=args.steps, command=command + (" --quick" if args.quick else ""), targets=args.targets)
    except AutoplanError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
