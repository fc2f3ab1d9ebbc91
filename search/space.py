"""The search space and the constraints a caller may put on it.

``autoplan.search(model, cluster, global_batch, **constraints)`` takes every field of
:class:`Constraints` as a keyword; a single value or a list narrows a dimension
(``tp=8``, ``schedules=["1f1b"]``), ``None`` leaves it to the search.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from autoplan.errors import ConfigError, closest
from autoplan.limits import MAX_EXPERTS, MAX_GPUS, MAX_MICRO_BATCH, MAX_SEQ_LEN, MAX_UNITS, MAX_VIRTUAL_STAGES
from autoplan.plan import CP_COMMS, SCHEDULES
from search.tables import RECOMPUTES


@dataclass(frozen=True)
class Constraints:
    """Limits on the search space and on the search's own effort."""

    tp: tuple[int, ...] | None = None
    """Tensor-parallel degrees allowed (None: every degree that divides the attention heads
    and the GPUs of a node)."""
    pp: tuple[int, ...] | None = None
    """Pipeline depths allowed (None: 1 up to the model's units)."""
    dp: tuple[int, ...] | None = None
    """Data-parallel degrees allowed (None: every divisor of the global batch that fits)."""
    cp: tuple[int, ...] | None = None
    """Context-parallel degrees allowed (None: 1 and every degree that splits the sequence into
    parts of at least min_cp_tokens; single-device-type clusters only)."""
    cp_comm: tuple[str, ...] = CP_COMMS
    """Context-parallel exchanges tried where cp > 1 ('p2p', 'all_gather', 'a2a')."""
    min_cp_tokens: int = 4096
    """Fewest tokens of a sequence a context rank may hold when cp is None: shorter parts
    make attention blocks too small to hide the exchange behind, so they are not tried."""
    ep: tuple[int, ...] | None = None
    """Expert-parallel degrees allowed (None: every degree dividing dp x cp and the model's
    experts; a dense model always gets 1)."""
    micro_batch: tuple[int, ...] | None = None
    """Micro-batch sizes allowed (None: divisors of the per-replica batch up to max_micro_batch)."""
    max_micro_batch: int = 16
    """Largest micro-batch tried when micro_batch is None."""
    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules tried."""
    virtual_stages: tuple[int, ...] | None = None
    """Chunks per pipeline rank tried for interleaved-1f1b (None: 2 .. max_virtual_stages)."""
    max_virtual_stages: int = 4
    """Largest interleaving depth tried when virtual_stages is None."""
    recompute: tuple[str, ...] = RECOMPUTES
    """Recompute modes each stage may use (chosen per stage by the layer-split DP)."""
    zero: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages tried."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    """Sequence-parallel settings tried (only where tp > 1)."""
    use_all_gpus: bool = False
    """Require every GPU of the cluster to be used (by default fewer may win, and the
    result says so)."""
    max_estimates: int = 12
    """Most candidates handed to the full cost model (``costmodel.estimate``)."""
    estimate_actions: int = 300_000
    """Budget of schedule actions (stages x micro-batches x passes) the full estimates may
    simulate in total; bounds their time for very long pipelines. Deterministic."""
    refine_evaluations: int = 1000
    """Budget of exact simulations the split refinement may spend in one search (it runs
    only for short schedule programs, where the DP's objective is approximate)."""
    placement_alternatives: int = 3
    """Device-group sequences CP-SAT returns per (dp, micro-batch) on heterogeneous clusters
    (for the data-parallel degrees within ``placement_alternatives_within``; one elsewhere)."""
    placement_alternatives_within: float = 0.2
    """CP-SAT's next-best sequences are sought for a data-parallel degree only where its
    optimum's objective (the placement model's closed form) is within this fraction of the
    best degree's sized for the same ZeRO stage, and a degree whose objective's floor is
    beyond it is not solved at all (``float('inf')``: every degree, with alternatives)."""
    placement_orders: int = 2
    """On a CP-SAT solution of up to this many runs (node groups used), every order of its
    runs is proposed; beyond, the solution's order and its reverse. 3 covers every order
    on three node groups: CP-SAT orders runs only through a coarse memory model, and
    where memory binds another order can be much faster, at more search time."""
    placement_time_limit: float = 1.0
    """CP-SAT deterministic time limit per solve (roughly seconds)."""
    max_stages: int = 32
    """Longest pipeline CP-SAT considers on heterogeneous clusters (its model has one slot
    per possible stage; pass more to widen it, at a cost in placement time)."""
    seed: int = 0
    """CP-SAT random seed (with one worker, results are reproducible)."""
    time_limit: float | None = None
    """Seconds the search may take (None: until it has proven its best plan optimal under
    its fast model). When the limit strikes, the best plan so far is estimated and returned
    with ``stats.optimality_gap``, how far from the best in the space it may be."""
    max_exhaustive_pipelines: int = 5000
    """On several node groups, every device-group pipeline the space holds is enumerated
    (and bounded) when there are at most this many; beyond, CP-SAT proposes them."""
    progress: bool = True
    """Show a progress bar on stderr (only when it is a terminal)."""
    profiles: Any = None
    """Measured layer profiles passed to the cost model (None: catalog roofline)."""
    stack: Any = None
    """Training stack the plans will run on (name, path or ``autoplan.stacks.Stack``; None:
    the options' stack, else the target engine's stack, 'autoplan' for autoplan)."""
    calibration: Any = None
    """``costmodel.calibration.Calibration`` fitted on measured runs (None: defaults)."""
    options: Any = None
    """``costmodel.EstimateOptions`` for every estimate (None: the cost model's defaults);
    ``profiles``, when given, overrides its ``profiles`` field."""
    target: str = "autoplan"
    """Engine the plans must run on ('autoplan', 'megatron', 'deepspeed', 'torchtitan'): only
    plans it can express are searched (see autoplan.engines), in the dtype its devices allow."""
    engine_version: str | None = None
    """Release of the target engine (None: its current one; torchtitan: '0.3' or '0.2')."""

    def engine(self):
        """The target engine."""
        from autoplan.engines import get_engine
        return get_engine(self.target, self.engine_version)

    @classmethod
    def build(cls, **kwargs) -> "Constraints":
        """Validate keyword constraints; single values become one-element tuples."""
        known = {f.name for f in fields(cls)}
        for k in kwargs:
            if k not in known:
                hint = closest(k, known)
                raise ConfigError(k, "is not a search constraint", hint or f"known: {', '.join(sorted(known))}")
        out = {}
        for k, v in kwargs.items():
            if k in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "virtual_stages"):
                if v is None:
                    out[k] = None
                    continue
                vals = _tuple(v)
                top = _LIMITS[k]
                for x in vals:
                    if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= top:
                        raise ConfigError(k, f"must be integers in 1..{top:,}, got {str(x)[:40]!r}")
                out[k] = tuple(sorted(set(vals)))
            elif k == "schedules":
                vals = _tuple(v)
                for x in vals:
                    if x not in SCHEDULES:
                        raise ConfigError(k, f"{x!r} is not a schedule", closest(str(x), SCHEDULES)
                                          or f"choose from {list(SCHEDULES)}")
                out[k] = tuple(s for s in SCHEDULES if s in vals)
            elif k == "cp_comm":
                vals = _tuple(v)
                for x in vals:
                    if x not in CP_COMMS:
                        raise ConfigError(k, f"{x!r} is not a context-parallel exchange",
                                          f"choose from {list(CP_COMMS)}")
                out[k] = tuple(s for s in CP_COMMS if s in vals)
            elif k == "recompute":
                vals = _tuple(v)
                for x in vals:
                    if x not in RECOMPUTES:
                        raise ConfigError(k, f"{x!r} is not a recompute mode", f"choose from {list(RECOMPUTES)}")
                out[k] = tuple(s for s in RECOMPUTES if s in vals)
            elif k == "zero":
                vals = _tuple(v)
                for x in vals:
                    if x not in (0, 1, 2, 3) or isinstance(x, bool):
                        raise ConfigError(k, f"{x!r} is not a ZeRO stage", "choose from 0, 1, 2, 3")
                out[k] = tuple(sorted(set(vals)))
            elif k == "sequence_parallel":
                vals = _tuple(v)
                for x in vals:
                    if not isinstance(x, bool):
                        raise ConfigError(k, f"must be True or False, got {x!r}")
                out[k] = tuple(sorted(set(vals)))
            elif k in ("max_micro_batch", "max_virtual_stages", "max_estimates", "estimate_actions",
                       "placement_alternatives", "placement_orders", "max_stages", "refine_evaluations",
                       "max_exhaustive_pipelines",
                       "min_cp_tokens", "seed"):
                top = _LIMITS[k]
                low = 0 if k == "seed" else 1
                if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= top:
                    raise ConfigError(k, f"must be an integer in {low}..{top:,}, got {str(v)[:40]!r}")
                out[k] = v
            elif k == "time_limit":
                if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                    raise ConfigError(k, f"must be a positive number of seconds, got {v!r}")
                out[k] = None if v is None else float(v)
            elif k == "placement_alternatives_within":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                    raise ConfigError(k, f"must be a fraction >= 0 (inf: every degree), got {str(v)[:40]!r}")
                out[k] = float(v)
            elif k == "placement_time_limit":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 3600:
                    raise ConfigError(k, f"must be a number of seconds in (0, 3600], got {str(v)[:40]!r}")
                out[k] = float(v)
            elif k in ("target", "engine_version"):
                if v is not None and not isinstance(v, str):
                    raise ConfigError(k, f"must be a string, got {v!r}")
                out[k] = v if v is not None or k == "engine_version" else "autoplan"
            elif k in ("use_all_gpus", "progress"):
                if not isinstance(v, bool):
                    raise ConfigError(k, f"must be True or False, got {v!r}")
                out[k] = v
            elif k == "stack":
                from autoplan.stacks import get_stack
                out[k] = None if v is None else get_stack(v)
            elif k == "calibration":
                from costmodel.calibration import Calibration
                if v is not None and not isinstance(v, Calibration):
                    raise ConfigError(k, f"must be a Calibration, got {type(v).__name__}",
                                      "load one with costmodel.calibration.Calibration.load(path)")
                out[k] = v
            elif k == "options":
                from costmodel import EstimateOptions
                if v is not None and not isinstance(v, EstimateOptions):
                    raise ConfigError(k, f"must be a costmodel.EstimateOptions, got {type(v).__name__}")
                out[k] = v
            else:
                out[k] = v
        for k in ("schedules", "recompute", "zero", "sequence_parallel", "cp_comm"):
            if k in out and not out[k]:
                raise ConfigError(k, "must allow at least one value")
        c = cls(**out)
        engine = c.engine()   # validates target and engine_version
        # The engine's own limits narrow the space; what the caller allowed must meet them.
        narrowed = {}
        for k, allowed in engine.constraints().items():
            mine = getattr(c, k)
            kept = tuple(x for x in (mine if mine is not None else allowed) if x in allowed)
            if not kept:
                raise ConfigError(k, f"allows only {list(mine)}, none of which {engine.title} {engine.version} "
                                  f"runs", f"{engine.title} runs {list(allowed)}")
            narrowed[k] = kept
        return replace(c, **narrowed)

    def estimate_options(self):
        """The cost model's options for this search."""
        from dataclasses import replace

        from costmodel import EstimateOptions
        opts = self.options or EstimateOptions()
        changes = {k: getattr(self, k) for k in ("profiles", "stack", "calibration") if getattr(self, k) is not None}
        if self.stack is None and self.options is None and self.target != "autoplan":
            from autoplan.stacks import TARGET_STACKS, get_stack
            changes["stack"] = get_stack(TARGET_STACKS[self.target])   # the engine's own stack
        if "stack" in changes:
            # A new stack brings its own overlap and send behaviour.
            changes.update(overlap_grad_reduce=None, blocking_p2p=None)
        return replace(opts, **changes) if changes else opts


_LIMITS = {"tp": MAX_GPUS, "pp": MAX_UNITS, "dp": MAX_GPUS, "cp": MAX_GPUS, "ep": MAX_EXPERTS,
           "micro_batch": MAX_MICRO_BATCH,
           "virtual_stages": MAX_VIRTUAL_STAGES, "max_micro_batch": MAX_MICRO_BATCH,
           "max_virtual_stages": MAX_VIRTUAL_STAGES, "max_estimates": 10_000, "estimate_actions": 10**9,
           "placement_alternatives": 100,
           "placement_orders": 6, "max_stages": MAX_UNITS, "refine_evaluations": 1_000_000,
           "max_exhaustive_pipelines": 1_000_000, "seed": 2**31 - 1,
           "min_cp_tokens": MAX_SEQ_LEN}
"""Largest value of each numeric constraint (beyond them a search would run for hours)."""


def _tuple(v) -> tuple:
    if isinstance(v, (list, tuple, set, frozenset)):
        return tuple(v)
    return (v,)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]
