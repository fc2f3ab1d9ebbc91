"""How many micro-batches' activations each pipeline rank holds at its peak, per schedule.

The cost model's simulation adds a stage's activation bytes at each forward and releases
them at the backward (weight-gradient part for zero-bubble), in each rank's program
order; so the live set of a rank depends only on the order of its actions, never on
their durations. That makes the peak computable here, once per (schedule, pp, m, v),
from the very schedule order the cost model simulates: for every rank, the count
vectors (micro-batches held, per chunk of the rank) at which memory can peak (read off
the lowered program for zero-bubble; worked out from the order's formulas for the
interleaved schedule, where programs run to tens of thousands of actions).

Under 1F1B the first stage holds ``pp`` micro-batches and the last one; GPipe holds all
``m`` everywhere. The counts stop growing once ``m`` exceeds a few times ``pp`` (the
warm-up depth bounds them), so long programs are summarized from a shorter one.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from autoplan.plan import DeviceGroup, Plan, Stage
from autoplan.schedule import build_program, interleaved_chunk, interleaved_warmup


@dataclass(frozen=True)
class Inflight:
    """Peak in-flight micro-batches of every pipeline rank under one schedule."""

    peaks: tuple[tuple[tuple[int, ...], ...], ...]
    """peaks[g]: count vectors (one entry per chunk of rank g, chunk c = stage g + c * pp)
    that are maximal among the states a forward leaves behind; the activation peak of
    rank g is the largest dot product of one of them with the chunks' bytes."""
    per_chunk: tuple[tuple[int, ...], ...]
    """per_chunk[g][c]: the most micro-batches chunk c of rank g ever holds (an upper
    bound that separates by chunk, for the layer-split DP)."""
    joint: tuple[tuple[int, ...], ...] = ()
    """joint[g]: the count vector of rank g's peak when its chunks are equally large (the
    peak vector with the most micro-batches in all); a tighter per-chunk target for the
    DP than ``per_chunk``, exact for balanced chunks."""

    def peak_bytes(self, g: int, chunk_bytes) -> float:
        """Exact peak activation bytes of rank ``g`` given each chunk's bytes per micro-batch."""
        vecs = self._peak_columns[g]
        if vecs is None:
            return max(sum(n * a for n, a in zip(vec, chunk_bytes)) for vec in self.peaks[g])
        # Interleaved ranks have a dozen or more peak vectors: all dot products at once,
        # summed chunk after chunk in the order the line above sums them (same bits).
        acc = vecs[0] * chunk_bytes[0]
        for c in range(1, len(vecs)):
            acc = acc + vecs[c] * chunk_bytes[c]
        return float(acc.max())

    @cached_property
    def _peak_columns(self) -> tuple:
        """Per rank: its peak vectors as one array per chunk (None where a rank has only
        a few, which the plain sum handles faster)."""
        return tuple(np.array(p, dtype=float).T.copy() if len(p) > 3 else None for p in self.peaks)


def _pareto(vectors: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    out = []
    for v in sorted(vectors, reverse=True):
        if not any(all(a >= b for a, b in zip(w, v)) for w in out):
            out.append(v)
    return tuple(out)


def _maximal_rows(states: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """What ``_pareto`` gives for the rows of an integer array: the rows no other row
    dominates, in descending order (vectorised: a deep pipeline has hundreds of states)."""
    rows = np.unique(states, axis=0)
    # covers[i, j]: row j is at least row i everywhere (rows are distinct: j dominates i).
    covers = (rows[None, :, :] >= rows[:, None, :]).all(axis=2)
    kept = rows[covers.sum(axis=1) == 1]
    return tuple(sorted(map(tuple, kept.tolist()), reverse=True))


@lru_cache(maxsize=4096)
def inflight(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> Inflight:
    """In-flight counts of ``schedule`` with ``pp`` ranks, ``num_micro_batches`` micro-batches
    and ``virtual_stages`` chunks per rank."""
    m, v = num_micro_batches, virtual_stages
    if schedule == "gpipe":
        return Inflight(peaks=tuple(((m,),) for _ in range(pp)), per_chunk=tuple((m,) for _ in range(pp)),
                        joint=tuple((m,) for _ in range(pp)))
    if schedule == "1f1b" or pp == 1 or (schedule == "interleaved-1f1b" and virtual_stages == 1):
        n = [min(pp - g, m) for g in range(pp)]
        return Inflight(peaks=tuple(((k,),) for k in n), per_chunk=tuple((k,) for k in n),
                        joint=tuple((k,) for k in n))
    # Interleaved and zero-bubble: read the peaks off the program itself, on a shorter
    # program with the same warm-up and cool-down (the counts are flat beyond it; the
    # tests check this against long programs): zero-bubble's warm-up is pp deep, and
    # interleaving needs m to stay a multiple of pp. Every longer m shares that program.
    if schedule == "interleaved-1f1b":
        return _interleaved(pp, min(m, 2 * pp), v)
    return _from_program(schedule, pp, min(m, pp + 2), v)


def _summary(peaks: list[tuple[tuple[int, ...], ...]], per_chunk: list[tuple[int, ...]]) -> Inflight:
    joint = tuple(max(p, key=lambda vec: (sum(vec), vec)) for p in peaks)
    return Inflight(peaks=tuple(peaks), per_chunk=tuple(per_chunk), joint=joint)


@lru_cache(maxsize=4096)
def _interleaved(pp: int, m_short: int, v: int) -> Inflight:
    """The interleaved schedule's counts, by arithmetic on its order (the one
    ``autoplan.schedule`` lowers to actions): rank g runs its warm-up forwards, then one
    forward and one backward in turn, so its candidate peaks are the states right after
    each of those forwards. Lowering a program per shape instead took 0.18 s of a
    1,024-GPU search (deep pipelines lower tens of thousands of actions)."""
    total = m_short * v
    k = np.arange(total)
    forwards = np.zeros((total, v), dtype=np.int64)
    forwards[k, interleaved_chunk(k, pp, v)] = 1
    backwards = np.zeros((total + 1, v), dtype=np.int64)
    backwards[k + 1, interleaved_chunk(k, pp, v, backward=True)] = 1
    done_f, done_b = forwards.cumsum(axis=0), backwards.cumsum(axis=0)   # (through k; before k)
    peaks, per_chunk = [], []
    for g in range(pp):
        warmup = interleaved_warmup(g, pp, m_short, v)
        f = np.arange(min(warmup, total - 1), total)
        states = done_f[f] - done_b[np.maximum(f - warmup, 0)]
        peaks.append(_maximal_rows(states))
        per_chunk.append(tuple(int(x) for x in states.max(axis=0)))
    return _summary(peaks, per_chunk)


@lru_cache(maxsize=4096)
def _from_program(schedule: str, pp: int, m_short: int, v: int) -> Inflight:
    groups = tuple(DeviceGroup(ranks=(g,), tp=1) for g in range(pp))
    stages = tuple(Stage(start=j, end=j + 1, group=j % pp) for j in range(pp * v))
    plan = Plan(groups=groups, stages=stages, micro_batch=1, num_micro_batches=m_short,
                schedule=schedule, virtual_stages=v)
    program = build_program(plan)
    peaks, per_chunk = [], []
    for g, actions in enumerate(program.ranks):
        count = [0] * v
        states: set[tuple[int, ...]] = set()
        top = [0] * v
        release = "W" if program.split_backward else "B"
        rising = False
        for a in actions:
            c = a.stage // pp
            if a.kind == "F":
                count[c] += 1
                top[c] = max(top[c], count[c])
                rising = True
            elif a.kind == release:
                if rising:          # only a forward followed by a release can be a peak
                    states.add(tuple(count))
                    rising = False
                count[c] -= 1
        if rising:
            states.add(tuple(count))
        peaks.append(_pareto(states))
        per_chunk.append(tuple(top))
    return _summary(peaks, per_chunk)
