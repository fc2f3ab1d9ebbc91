"""The measured-run record: what a run of a plan actually did, in a JSON file with
explicit units, to check and calibrate the cost model against.

    record = load_record("run.json")
    print(compare_with_estimate(record, autoplan.estimate(model, cluster, record.plan)))
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from autoplan.errors import ConfigError
from autoplan.fields import FieldReader, load_json
from autoplan.limits import MAX_GPUS, MAX_STEPS
from autoplan.plan import Plan
from autoplan.units import GiB, MiB

RECORD_SCHEMA_VERSION = 1
RECORD_KIND = "autoplan-run"

MEMORY_SOURCE_CUDA = "cuda max_memory_allocated"
MEMORY_SOURCE_CPU = ("cpu: parameter + gradient + optimizer-state tensor bytes (activations not "
                     "tracked); process max RSS in max_rss_bytes")


@dataclass(frozen=True)
class StepRecord:
    """One training step as measured."""

    step: int
    """1-based step number (continues across resumes)."""
    loss: float
    """Mean loss over the global batch."""
    step_time_s: float
    """Wall time of the step on the slowest rank (data, forward, backward, optimizer)."""
    tokens_per_s: float
    """Global-batch tokens over step_time_s."""
    grad_norm: float
    """Global gradient 2-norm before clipping."""
    peak_memory_bytes_by_rank: tuple[int, ...] = ()
    """Each rank's peak memory so far, by rank (same measure as RankMemory.peak_memory_bytes)."""
    load_balancing_loss: float | None = None
    """Mixture of experts: the load-balancing loss N_E * sum_i f_i * p_i of the step, averaged
    over the MoE layers (f as the run's load_balancing option defines it); None otherwise."""


@dataclass(frozen=True)
class RankMemory:
    """Memory of one rank."""

    rank: int
    """Global rank."""
    peak_memory_bytes: int
    """GPU: CUDA max_memory_allocated. CPU: model-state tensor bytes (see memory_source)."""
    memory_source: str
    """What peak_memory_bytes measures."""
    model_state_bytes: int
    """Local parameter + gradient + optimizer-state tensor bytes after the last step."""
    max_rss_bytes: int
    """Process peak resident set size (resource.getrusage ru_maxrss)."""


@dataclass(frozen=True)
class RunRecord:
    """A measured run of a plan."""

    plan: Plan
    """The plan that ran."""
    model: dict
    """name, architecture config, number of units, number of parameters."""
    environment: dict
    """torch_version, python_version, backend, device_type, device_names (per rank), world_size."""
    run: dict
    """Settings: optimizer, learning rate, seed, global batch, tokens per step, what the plan's
    ZeRO stage and dtype became, the schedule program executed, resume information."""
    steps: tuple[StepRecord, ...]
    """Per-step figures, in order."""
    memory: tuple[RankMemory, ...]
    """Per-rank memory, by rank."""
    schema_version: int = RECORD_SCHEMA_VERSION
    """Version of this file format."""
    kind: str = RECORD_KIND
    """Always 'autoplan-run' (tells a run record from a plan or an estimate)."""

    # ---------------------------------------------------------------- summary
    @property
    def step_time_s(self) -> float:
        """Median step time, leaving out the first step of the run when there are more
        (it includes one-off set-up such as pipeline shape inference)."""
        times = [s.step_time_s for s in self.steps]
        if len(times) > 1:
            times = times[1:]
        return statistics.median(times) if times else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.run["tokens_per_step"] / self.step_time_s if self.steps else float("nan")

    @property
    def peak_memory_bytes(self) -> int:
        return max((m.peak_memory_bytes for m in self.memory), default=0)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def summary(self) -> dict:
        if not self.steps:   # a resumed run that found its target already reached
            return {"step_time_s": None, "tokens_per_s": None, "peak_memory_bytes": self.peak_memory_bytes,
                    "final_loss": None, "steps_measured": 0}
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "peak_memory_bytes": self.peak_memory_bytes,
                "final_loss": self.steps[-1].loss if self.steps else None,
                "steps_measured": len(self.steps)}

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version, "kind": self.kind,
            "plan": self.plan.to_dict(), "model": self.model, "environment": self.environment,
            "run": self.run, "steps": [asdict(s) for s in self.steps],
            "memory": [asdict(m) for m in self.memory], "summary": self.summary(),
        }

    def save(self, path: str | Path) -> None:
        from autoplan.files import write_text
        write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "record") -> "RunRecord":
        r = FieldReader(data, where)
        r.reject_unknown(("schema_version", "kind", "plan", "model", "environment", "run", "steps",
                          "memory", "summary"))
        version = r.int("schema_version", minimum=1)
        if version > RECORD_SCHEMA_VERSION:
            raise ConfigError(r.path("schema_version"), f"{version} is newer than this autoplan understands "
                              f"({RECORD_SCHEMA_VERSION})", "upgrade autoplan")
        kind = r.str("kind")
        if kind != RECORD_KIND:
            raise ConfigError(r.path("kind"), f"is {kind!r}, not a run record ({RECORD_KIND!r})")
        plan = Plan.from_dict(r.raw("plan"), where=r.path("plan"))
        steps = []
        r.list("steps", max_len=MAX_STEPS)
        for s in r.items("steps"):
            mem = s.ints("peak_memory_bytes_by_rank", [], minimum=0, max_len=MAX_GPUS)
            steps.append(StepRecord(step=s.int("step", minimum=1, maximum=MAX_STEPS), loss=s.float("loss"),
                                    step_time_s=s.float("step_time_s", positive=True),
                                    tokens_per_s=s.float("tokens_per_s", positive=True),
                                    grad_norm=s.float("grad_norm", minimum=0.0),
                                    peak_memory_bytes_by_rank=tuple(mem),
                                    load_balancing_loss=s.float("load_balancing_loss", None, minimum=0.0)))
        memory = []
        r.list("memory", max_len=MAX_GPUS)
        for m in r.items("memory"):
            memory.append(RankMemory(rank=m.int("rank", minimum=0, maximum=MAX_GPUS - 1),
                                     peak_memory_bytes=m.int("peak_memory_bytes", minimum=0),
                                     memory_source=m.str("memory_source"),
                                     model_state_bytes=m.int("model_state_bytes", minimum=0),
                                     max_rss_bytes=m.int("max_rss_bytes", minimum=0)))
        run = r.sub("run")
        run.int("tokens_per_step", minimum=1)
        env = r.sub("environment")
        env.str("torch_version")
        env.str("backend")
        world = env.int("world_size", minimum=1, maximum=MAX_GPUS)
        if world != plan.num_gpus:
            raise ConfigError(env.path("world_size"), f"is {world}, but the plan has {plan.num_gpus} ranks")
        env.strs("device_names", [], max_len=world)
        ranks = [m.rank for m in memory]
        if len(set(ranks)) != len(ranks) or any(x >= world for x in ranks):
            raise ConfigError(r.path("memory"), f"ranks {sorted(ranks)[:8]} are not distinct ranks of the "
                              f"{world} the run had")
        for i, st in enumerate(steps):
            if len(st.peak_memory_bytes_by_rank) > world:
                raise ConfigError(f"{r.path('steps')}[{i}].peak_memory_bytes_by_rank",
                                  f"has {len(st.peak_memory_bytes_by_rank)} ranks, the run had {world}")
        model = r.sub("model")
        model.str("name", "")
        return cls(plan=plan, model=dict(model.data), environment=dict(env.data), run=dict(run.data),
                   steps=tuple(steps), memory=tuple(sorted(memory, key=lambda m: m.rank)),
                   schema_version=version, kind=kind)


def load_record(path: str | Path) -> RunRecord:
    """Read and validate a run record written by ``autoplan run`` / ``autoplan.runtime.train``."""
    path = Path(path)
    return RunRecord.from_dict(load_json(path, "run record"), where=path.name)


# ----------------------------------------------------------------- comparison
def _get(obj: Any, *names: str) -> Any:
    for name in names:
        if isinstance(obj, dict) and name in obj:
            return obj[name]
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


def _ratio(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return "-"
    return f"{measured / predicted:.2f}x"


def compare_with_estimate(record: RunRecord, estimate: Any) -> str:
    """A side-by-side table of predicted vs measured step time, tokens/s and per-rank
    peak memory. ``estimate`` is an ``autoplan.estimate(...)`` result or its dict form
    (``iteration_time_s``, ``tokens_per_s``, and ``memory_by_rank`` in bytes or
    ``peak_memory_GiB``)."""
    from autoplan.commands._common import table

    pred_time = _get(estimate, "iteration_time_s")
    pred_tps = _get(estimate, "tokens_per_s")
    by_rank = _get(estimate, "memory_by_rank") or {}
    by_rank = {int(k): float(v) for k, v in dict(by_rank).items()}
    peak_gib = _get(estimate, "peak_memory_GiB")
    peak_bytes = _get(estimate, "peak_memory_bytes")
    if peak_bytes is None and peak_gib is not None:
        peak_bytes = float(peak_gib) * GiB

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    rows = [["step time (s)", fmt(pred_time, ".4g"), fmt(record.step_time_s, ".4g"),
             _ratio(record.step_time_s, pred_time)],
            ["tokens/s", fmt(pred_tps, ",.0f"), fmt(record.tokens_per_s, ",.0f"),
             _ratio(record.tokens_per_s, pred_tps)]]
    for m in record.memory:
        pred = by_rank.get(m.rank, peak_bytes)
        rows.append([f"peak memory rank {m.rank} (MiB)", fmt(None if pred is None else pred / MiB, ",.1f"),
                     f"{m.peak_memory_bytes / MiB:,.1f}", _ratio(m.peak_memory_bytes, pred)])
    lines = [table(rows, ["", "predicted", "measured", "measured/predicted"])]
    env = record.environment
    devices = ", ".join(sorted(set(env.get("device_names", [])))) or "?"
    median = "median of steps 2.., the first is left out" if len(record.steps) > 1 else "one step"
    lines.append(f"measured: {env.get('world_size')} ranks on {devices} ({env.get('backend')}), "
                 f"{len(record.steps)} steps ({median})")
    if record.memory and record.memory[0].memory_source != MEMORY_SOURCE_CUDA:
        lines.append(f"note: measured memory is {record.memory[0].memory_source}")
    est_plan = _get(estimate, "plan")
    if isinstance(est_plan, Plan) and est_plan.to_dict() != record.plan.to_dict():
        lines.append("warning: the estimate was made for a different plan than the one measured "
                     f"(estimate: {est_plan.describe()}; measured: {record.plan.describe()})")
    return "\n".join(lines)
