"""A plan lowered to a space-time program: for every pipeline rank, the ordered list of
compute actions it runs in one iteration.

Actions are forward ``F``, full backward ``B``, or — for zero-bubble — backward split
into input-gradient ``I`` and weight-gradient ``W``, each on (stage, micro-batch).
Communication is never written per schedule: :meth:`ScheduleProgram.dependencies`
derives it from data dependencies (a stage's forward needs the previous stage's
forward output; its backward needs the next stage's input gradient), and a dependency
whose two actions sit on different pipeline ranks is a send/recv pair. The cost model
simulates exactly this program, and the runtime hands the same per-rank lists to
``torch.distributed.pipelining``'s schedule runtime, so what is estimated is what runs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Iterator, NamedTuple

from autoplan.errors import ConfigError
from autoplan.plan import Plan

KINDS = ("F", "B", "I", "W")


class Action(NamedTuple):
    """One compute action of one micro-batch on one stage (a tuple: programs hold many)."""

    stage: int
    kind: str
    """'F' forward, 'B' full backward, 'I' input-gradient backward, 'W' weight-gradient backward."""
    micro_batch: int

    def __str__(self) -> str:
        # torch.distributed.pipelining's compact action notation, e.g. '2F5'.
        return f"{self.stage}{self.kind}{self.micro_batch}"

    __repr__ = __str__


@dataclass(frozen=True)
class CompiledProgram:
    """A schedule program in the form the simulator walks (see ScheduleProgram.compiled)."""

    ranks: tuple[tuple[tuple, ...], ...]
    """ranks[g][i] = (action number, stage, kind, sends: 0 none / 1 forward / 2 backward,
    ((dependency's number, crosses ranks, dependency's stage), ...)) of rank g's i-th action."""
    size: int
    """Actions in the program (numbers run 0 .. size - 1, rank by rank in program order; a
    dependency on an action the program lacks is numbered ``size``, which never runs)."""


@dataclass(frozen=True)
class ScheduleProgram:
    """Per-rank ordered compute actions for one iteration."""

    ranks: tuple[tuple[Action, ...], ...]
    """ranks[g] = actions of pipeline rank (device group) g, in execution order."""
    num_stages: int
    num_micro_batches: int
    stage_to_rank: tuple[int, ...]
    """Which pipeline rank runs each stage."""

    @cached_property
    def split_backward(self) -> bool:
        # Cached: dependencies() asks on every action, and the scan is O(actions).
        return any(a.kind == "I" for r in self.ranks for a in r)

    def dependencies(self, action: Action) -> Iterator[Action]:
        """Actions whose results ``action`` consumes (data dependencies only)."""
        s, m = action.stage, action.micro_batch
        last = self.num_stages - 1
        if action.kind == "F":
            if s > 0:
                yield Action(s - 1, "F", m)
        elif action.kind in ("B", "I"):
            yield Action(s, "F", m)
            if s < last:
                yield Action(s + 1, "I" if self.split_backward else "B", m)
        elif action.kind == "W":
            yield Action(s, "I", m)

    @cached_property
    def compiled(self) -> "CompiledProgram":
        """The program with actions numbered, for the simulator's inner loop (lists indexed
        by integers instead of dictionaries keyed by actions). Built directly from the
        rules of dependencies() and sends(), without one Action object per dependency: a
        long program is often simulated only once."""
        index: dict[tuple, int] = {}
        for r in self.ranks:
            for a in r:
                index[a] = len(index)
        size = len(index)
        last = self.num_stages - 1
        back = "I" if self.split_backward else "B"
        s2r = self.stage_to_rank
        ranks = []
        for r in self.ranks:
            row = []
            for a in r:
                s, kind, m = a
                send = 0
                if kind == "F":
                    deps = ((index.get((s - 1, "F", m), size), s2r[s - 1] != s2r[s], s - 1),) if s > 0 else ()
                    if s < last and s2r[s + 1] != s2r[s]:
                        send = 1
                elif kind in ("B", "I"):
                    own = (index.get((s, "F", m), size), False, s)
                    deps = (own, (index.get((s + 1, back, m), size), s2r[s + 1] != s2r[s], s + 1)) \
                        if s < last else (own,)
                    if s > 0 and s2r[s - 1] != s2r[s]:
                        send = 2
                else:
                    deps = ((index.get((s, "I", m), size), False, s),)
                row.append((index[a], s, kind, send, deps))
            ranks.append(tuple(row))
        return CompiledProgram(ranks=tuple(ranks), size=size)

    def sends(self, action: Action) -> str:
        """'forward' or 'backward' when the action's result must go to another rank, else ''."""
        s = action.stage
        if action.kind == "F" and s < self.num_stages - 1 and self.stage_to_rank[s + 1] != self.stage_to_rank[s]:
            return "forward"
        if action.kind in ("B", "I") and s > 0 and self.stage_to_rank[s - 1] != self.stage_to_rank[s]:
            return "backward"
        return ""

    def to_compute_only(self) -> list[list[str]]:
        """Per-rank action strings, the 'compute_only' form torch.distributed.pipelining's
        ``_PipelineScheduleRuntime`` loads (communication is added by the runtime)."""
        return [[str(a) for a in r] for r in self.ranks]

    def to_csv(self) -> str:
        return "\n".join(",".join(row) for row in self.to_compute_only()) + "\n"

    def validate(self) -> None:
        """Every (stage, micro-batch) is computed exactly once per kind, on its own rank."""
        kinds = ("F", "I", "W") if self.split_backward else ("F", "B")
        seen = [a for r in self.ranks for a in r]
        expected = self.num_stages * len(kinds) * self.num_micro_batches
        unique = set(seen)
        if len(seen) != expected or len(unique) != expected or any(
                a.kind not in kinds or not 0 <= a.micro_batch < self.num_micro_batches
                or not 0 <= a.stage < self.num_stages for a in unique):
            raise AssertionError("schedule program does not compute every action exactly once")
        for g, r in enumerate(self.ranks):
            for a in r:
                if self.stage_to_rank[a.stage] != g:
                    raise AssertionError(f"{a} placed on rank {g}")


def build_program(plan: Plan) -> ScheduleProgram:
    """Lower a plan's pipeline schedule to per-rank action lists."""
    return _build(plan.schedule, plan.pp, plan.num_micro_batches, plan.virtual_stages,
                  tuple(s.group for s in plan.stages))


@lru_cache(maxsize=128)
def _build(schedule: str, p: int, m: int, v: int, stage_to_rank: tuple[int, ...]) -> ScheduleProgram:
    # Cached: a search estimates many plans that share one pipeline shape, and the
    # program (with its dependency table) depends on nothing else.
    if schedule == "gpipe":
        ranks = [_gpipe(g, p, m) for g in range(p)]
    elif schedule == "1f1b":
        ranks = [_one_f_one_b(g, p, m) for g in range(p)]
    elif schedule == "interleaved-1f1b":
        if v > 1 and m % p:
            raise ConfigError("num_micro_batches", f"{m} is not a multiple of pp={p}, which the "
                              "interleaved schedule needs", "change the global batch or micro-batch size")
        ranks = [_interleaved(g, p, m, v) for g in range(p)]
    elif schedule == "zero-bubble":
        ranks = _zero_bubble(p, m)
    else:
        raise ConfigError("schedule", f"unknown schedule {schedule!r}")
    prog = ScheduleProgram(ranks=tuple(tuple(r) for r in ranks), num_stages=len(stage_to_rank),
                           num_micro_batches=m, stage_to_rank=stage_to_rank)
    prog.validate()
    return prog


def _gpipe(g: int, p: int, m: int) -> list[Action]:
    return [Action(g, "F", i) for i in range(m)] + [Action(g, "B", i) for i in range(m)]


def _one_f_one_b(g: int, p: int, m: int) -> list[Action]:
    """PipeDream-Flush / Megatron 1F1B: p-g-1 warm-up forwards, then alternate."""
    warmup = min(p - g - 1, m)
    out = [Action(g, "F", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            out.append(Action(g, "F", f))
            f += 1
        out.append(Action(g, "B", b))
        b += 1
    return out


def interleaved_warmup(g: int, p: int, m: int, v: int) -> int:
    """Forwards rank ``g`` runs before its first backward under the interleaved schedule
    (after them it alternates one forward, one backward until the forwards run out)."""
    return min((p - g - 1) * 2 + (v - 1) * p, m * v)


def interleaved_chunk(k: int, p: int, v: int, backward: bool = False):
    """The chunk (0..v-1) of a rank's k-th forward (or backward) under the interleaved
    schedule: micro-batches advance through the chunks in groups of p, backwards from the
    last chunk. ``k`` may be an integer array."""
    chunk = (k // p) % v
    return v - 1 - chunk if backward else chunk


def _interleaved(g: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, §2.2): rank g owns stages
    g, g+p, ..., and micro-batches advance through its chunks in groups of p."""
    total = m * v

    def fwd(k: int) -> Action:
        mb = (k // (p * v)) * p + k % p
        return Action(interleaved_chunk(k, p, v) * p + g, "F", mb)

    def bwd(k: int) -> Action:
        mb = (k // (p * v)) * p + k % p
        return Action(interleaved_chunk(k, p, v, backward=True) * p + g, "B", mb)

    if v == 1:
        return _one_f_one_b(g, p, m)
    warmup = interleaved_warmup(g, p, m, v)
    out = [fwd(k) for k in range(warmup)]
    f, b = warmup, 0
    while b < total:
        if f < total:
            out.append(fwd(f))
            f += 1
        out.append(bwd(b))
        b += 1
    return out


def _zero_bubble(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with the backward split into I and W, where a
    rank runs a deferred W whenever its next F or I is not ready yet, so weight-gradient
    work fills the pipeline bubbles.

    The order is fixed by a list-scheduling pass with unit action times (F = I = W,
    free communication), which makes it a static program the runtime can execute. A
    rank never holds more micro-batches than under 1F1B (p - g), so activation memory
    stays that of 1F1B, as in the paper."""
    # Finish steps per (rank, micro-batch), indexed by integers: the search lowers programs
    # of tens of thousands of actions (p = 16, m = 768), where hashing one Action per
    # dependency check cost more than the estimate that used the program.
    never = 1 << 62
    f_done = [[never] * m for _ in range(p)]
    i_done = [[never] * m for _ in range(p)] + [[0] * m]   # (a row past the last stage: no I to wait for)
    orders = [[(a.kind == "F", a.micro_batch) for a in _one_f_one_b(g, p, m)] for g in range(p)]
    pos = [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    in_flight = [0] * p      # forwards whose W has not run: their activations are live
    out: list[list[Action]] = [[] for _ in range(p)]
    left = sum(len(o) for o in orders) + p * m   # (every F and I, then every W)
    t = 0
    while left:
        for g in range(p):
            order = orders[g]
            ready = False
            if pos[g] < len(order):
                forward, mb = order[pos[g]]
                if forward:
                    # 1F1B's memory bound: at most p - g micro-batches alive on rank g.
                    ready = (g == 0 or f_done[g - 1][mb] <= t) and in_flight[g] < p - g
                else:
                    ready = f_done[g][mb] <= t and i_done[g + 1][mb] <= t
            if ready:
                pos[g] += 1
                if forward:
                    in_flight[g] += 1
                    f_done[g][mb] = t + 1
                    out[g].append(Action(g, "F", mb))
                else:
                    pending[g].append(mb)
                    i_done[g][mb] = t + 1
                    out[g].append(Action(g, "I", mb))
            elif pending[g]:
                in_flight[g] -= 1
                out[g].append(Action(g, "W", pending[g].popleft()))
            else:
                continue
            left -= 1
        t += 1
    return out
