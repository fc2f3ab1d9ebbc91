"""Event simulation of a schedule program.

Each pipeline rank executes its actions in program order; an action starts when its
rank is free and every action it depends on has finished (plus the point-to-point
transfer when the dependency crosses ranks). Gradient reduction runs on a separate
communication stream per rank and overlaps the remaining backward work; the optimizer
step follows. The simulation also tracks, per rank, the activation bytes of the
micro-batches in flight, which is where a schedule's memory cost comes from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from autoplan.schedule import ScheduleProgram


@dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch costs of one stage, in seconds and bytes."""

    forward: float
    backward: float
    backward_input: float
    backward_weight: float
    send_forward: float
    """Transfer of this stage's output to the next stage (0 for the last stage)."""
    send_backward: float
    """Transfer of this stage's input gradient to the previous stage (0 for the first)."""
    activation_bytes: float
    """Bytes kept from a forward until its backward (weight-gradient part) finishes."""
    grad_reduce: float
    """Data-parallel gradient reduction of the stage's parameters, once per iteration."""
    layers: int
    """Units in the stage (gradient buckets for overlap)."""
    tp_comm_forward: float = 0.0
    """Part of ``forward`` that is tensor-parallel communication."""
    tp_comm_backward: float = 0.0
    ep_comm_forward: float = 0.0
    """Part of ``forward`` that is expert-parallel dispatch and combine (all-to-all)."""
    ep_comm_backward: float = 0.0
    """Part of ``backward`` (and ``backward_input``) that is expert-parallel all-to-all."""
    cp_comm_forward: float = 0.0
    """Part of ``forward`` that is exposed context-parallel exchange."""
    cp_comm_backward: float = 0.0
    """Part of ``backward`` (and ``backward_input``) that is exposed context-parallel exchange."""


class Event(NamedTuple):
    """One interval of a rank's timeline (a tuple: a timeline holds one per action, and a
    frozen dataclass cost five times as much to build as the simulation itself)."""

    rank: int
    """Pipeline rank (device group)."""
    kind: str
    """'F', 'B', 'I', 'W', 'reduce', 'optimizer'."""
    stage: int
    micro_batch: int
    start: float
    end: float


@dataclass
class SimResult:
    iteration_time: float
    events: list[Event]
    compute_end: list[float]
    """Per rank: when its last compute action finished."""
    busy: list[float]
    """Per rank: seconds of compute actions (TP communication inside them included)."""
    tp_comm: list[float]
    ep_comm: list[float]
    """Per rank: seconds of expert-parallel all-to-all inside its compute actions."""
    comm_end: list[float]
    """Per rank: when its gradient reduction finished."""
    rank_end: list[float]
    peak_activation_bytes: list[float]
    critical_rank: int = 0
    optimizer: list[float] = field(default_factory=list)


def simulate(program: ScheduleProgram, costs: list[StageCosts], optimizer: list[float],
             overlap_grad_reduce: bool = True, post_optimizer: list[float] | None = None,
             blocking_p2p: bool = True, timeline: bool = True) -> SimResult:
    """Run the program. ``optimizer[g]``: optimizer step of rank g; ``post_optimizer[g]``:
    exposed work after it (ZeRO-1/2 parameter all-gather). With ``blocking_p2p`` a rank
    waits for its own sends to complete before its next action (Megatron-LM's batched
    send/recv), otherwise sends are asynchronous and only delay the receiver. Without
    ``timeline`` the result's ``events`` stay empty (callers that need only the times,
    like the search, skip building one object per action)."""
    P = len(program.ranks)
    compiled = program.compiled
    finish: list[float | None] = [None] * (compiled.size + 1)   # (the last: an action the program lacks)
    started: list[float] = [0.0] * (compiled.size + 1)
    ptr = [0] * P
    free = [0.0] * P
    busy = [0.0] * P
    tp_comm = [0.0] * P
    ep_comm = [0.0] * P
    live = [0.0] * P
    peak = [0.0] * P
    events: list[Event] = []
    total = compiled.size
    done = 0
    # Per (kind, stage): (duration, TP communication in it, EP communication in it, change of
    # the live activation bytes), one lookup per action in the hot loop below.
    zeros = [0.0] * len(costs)
    cost_of = {
        "F": list(zip([c.forward for c in costs], [c.tp_comm_forward for c in costs],
                      [c.ep_comm_forward for c in costs], [c.activation_bytes for c in costs])),
        "B": list(zip([c.backward for c in costs], [c.tp_comm_backward for c in costs],
                      [c.ep_comm_backward for c in costs], [-c.activation_bytes for c in costs])),
        "I": list(zip([c.backward_input for c in costs], [c.tp_comm_backward for c in costs],
                      [c.ep_comm_backward for c in costs], zeros)),
        "W": list(zip([c.backward_weight for c in costs], zeros, zeros, [-c.activation_bytes for c in costs])),
    }
    send_f = [c.send_forward for c in costs]
    send_b = [c.send_backward for c in costs]
    actions_of = program.ranks

    while done < total:
        progressed = False
        for g in range(P):
            actions = compiled.ranks[g]
            n_actions = len(actions)
            i = ptr[g]
            if i >= n_actions:
                continue
            # (The rank's running figures in locals while it advances, written back after.)
            free_g, busy_g, tp_g, ep_g, live_g, peak_g = free[g], busy[g], tp_comm[g], ep_comm[g], live[g], peak[g]
            start_i = i
            while i < n_actions:
                idx, s, kind, direction, deps = actions[i]
                ready = free_g
                blocked = False
                for d, crosses, d_stage in deps:
                    t = finish[d]
                    if t is None:
                        blocked = True
                        break
                    if crosses:
                        t += send_f[d_stage] if kind == "F" else send_b[d_stage]
                    if t > ready:
                        ready = t
                if blocked:
                    break
                d_, tp_, ep_, live_ = cost_of[kind][s]
                end = ready + d_
                started[idx] = ready
                finish[idx] = end
                free_g = end
                if blocking_p2p and direction:
                    free_g += send_f[s] if direction == 1 else send_b[s]
                busy_g += d_
                tp_g += tp_
                ep_g += ep_
                if live_:
                    live_g += live_
                    if live_g > peak_g:
                        peak_g = live_g
                if timeline:
                    events.append(Event(g, kind, s, actions_of[g][i].micro_batch, ready, end))
                i += 1
            if i > start_i:
                free[g], busy[g], tp_comm[g], ep_comm[g], live[g], peak[g] = free_g, busy_g, tp_g, ep_g, live_g, peak_g
                done += i - start_i
                ptr[g] = i
                progressed = True
        if not progressed:
            raise RuntimeError("schedule program deadlocks: an action waits on one that never runs")

    compute_end = [free[g] for g in range(P)]
    comm_end = [0.0] * P
    rank_end = [0.0] * P
    post_optimizer = post_optimizer or [0.0] * P
    for g in range(P):
        # The last backward-type action of each stage releases its gradients.
        last: dict[int, int] = {}
        for idx, stage, kind, _, _ in compiled.ranks[g]:
            if kind in ("B", "W"):
                last[stage] = idx
        comm_free = 0.0
        for stage, a in sorted(last.items(), key=lambda kv: finish[kv[1]]):
            r = costs[stage].grad_reduce
            if r <= 0:
                continue
            if overlap_grad_reduce:
                # Buckets (one per unit) become ready during the stage's last backward.
                start = max(comm_free, started[a])
                end = max(start + r, finish[a] + r / max(costs[stage].layers, 1))
            else:
                # Without overlap the engines reduce after the whole schedule has run
                # (Megatron-LM's finalize_model_grads, DeepSpeed's reduce after the
                # pipeline flush, AA-Scaling's optimizer step): an interleaved rank's
                # early-finished chunks wait for its last backward too.
                start = max(comm_free, compute_end[g])
                end = start + r
            if timeline:
                events.append(Event(g, "reduce", stage, -1, end - r, end))
            comm_free = end
        comm_end[g] = comm_free
        opt_start = max(compute_end[g], comm_free)
        rank_end[g] = opt_start + optimizer[g] + post_optimizer[g]
        if optimizer[g] > 0 and timeline:
            events.append(Event(g, "optimizer", -1, -1, opt_start, opt_start + optimizer[g]))
    iteration = max(rank_end)
    critical = max(range(P), key=lambda g: (rank_end[g], busy[g]))
    return SimResult(iteration_time=iteration, events=events, compute_end=compute_end, busy=busy,
                     tp_comm=tp_comm, ep_comm=ep_comm, comm_end=comm_end, rank_end=rank_end,
                     peak_activation_bytes=peak, critical_rank=critical, optimizer=list(optimizer))
