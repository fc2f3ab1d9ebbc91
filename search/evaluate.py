"""Fast analytic evaluation of a candidate plan: the cost model's per-stage costs and
per-group memory (exact, from the tables), and a closed-form pipeline time that
stands in for the event simulation while thousands of candidates are compared.

The closed form follows the textbook pipeline analyses the simulated schedules come
from: 1F1B/GPipe take ``(m - 1)`` steady periods of the slowest rank plus one pass
through every stage (Narayanan et al. SC21 §2.2: bubble ``(p - 1)`` stage times),
interleaving divides the fill/drain by ``v`` (ibid.), and zero-bubble ZB-H1 shrinks it
to ``F + B_input - B_weight`` per stage (Qi et al. ICLR 2024, §3). The steady period is
never shorter than one micro-batch's round trip through the pipeline (every stage's
forward and backward, or input-gradient pass under zero-bubble, and every send both ways)
over the micro-batches the schedule lets the first stage hold: with slow links that round
trip, not the busiest rank, sets it (without it the closed form was 35-39% fast against the
simulation on such a pipeline, ``tests/test_search_internals.py``). Data-parallel
reduction exposure and the optimizer step are added per rank as the simulation does.
Only a shortlist ranked by this is handed to the full ``costmodel.estimate``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

from autoplan.models.spec import ModelSpec
from autoplan.plan import DeviceGroup, Plan, Stage
from autoplan.stacks import Stack
from costmodel.comm import zero3_gather_passes, zero3_rank_overhead
from costmodel.host import pipeline_host_time, with_host
from search.inflight import inflight
from search.tables import RECOMPUTES, Kind, Tables


@dataclass(frozen=True)
class Skeleton:
    """The pipeline's device groups before layers are assigned to them."""

    groups: tuple[DeviceGroup, ...]
    """One device group per pipeline rank, in pipeline order."""
    kinds: tuple[Kind, ...]
    """Node group and tensor-parallel degree of each device group."""

    # (Cached: the bounds read these for every candidate, and a group computes its dp.)
    @cached_property
    def pp(self) -> int:
        return len(self.groups)

    @cached_property
    def dp(self) -> int:
        return self.groups[0].dp

    @property
    def ep(self) -> int:
        return self.kinds[0].ep

    @property
    def cp(self) -> int:
        return self.groups[0].cp

    @classmethod
    def of_plan(cls, plan: Plan, cluster) -> "Skeleton":
        """The skeleton a plan's device groups make on ``cluster``."""
        return cls(groups=plan.groups, kinds=tuple(Kind(cluster.slots[g.ranks[0]].group, g.tp, g.cp, plan.cp_comm,
                                                        plan.ep) for g in plan.groups))

    @cached_property
    def shards(self) -> int:
        """Ranks over which gradients are reduced and ZeRO shards: data x context."""
        return self.dp * self.cp

    @property
    def num_gpus(self) -> int:
        return sum(len(g.ranks) for g in self.groups)


@dataclass(frozen=True)
class Setting:
    """Every choice of a plan other than device groups, layer split and recomputation."""

    micro_batch: int
    """Samples per micro-batch."""
    num_micro_batches: int
    """Micro-batches per iteration per data-parallel replica."""
    schedule: str
    """Pipeline schedule name (see autoplan.plan.SCHEDULES)."""
    virtual_stages: int
    """Chunks per pipeline rank (>1 only for interleaved-1f1b)."""
    zero: int
    """ZeRO stage 0-3."""
    sequence_parallel: bool
    """Megatron sequence parallelism (only meaningful where tp > 1)."""

    @classmethod
    def of_plan(cls, plan: Plan, stack: Stack) -> "Setting":
        """A plan's setting, at the ZeRO stage the plan runs at on ``stack``
        (``Stack.realized_zero``: the search's settings are always realized)."""
        return cls(plan.micro_batch, plan.num_micro_batches, plan.schedule, plan.virtual_stages,
                   stack.realized_zero(plan.zero, plan.pp), plan.sequence_parallel)


@dataclass
class Analysis:
    """What the fast model says about one candidate."""

    time_s: float
    """Predicted iteration time (closed form)."""
    memory: tuple[float, ...]
    """Per pipeline group: predicted peak bytes per GPU (the cost model's accounting)."""
    fits: bool
    """Every group within its devices' memory."""


@dataclass
class Candidate:
    """A complete plan in the search's own terms, with its fast-model analysis."""

    skeleton: Skeleton
    setting: Setting
    bounds: tuple[tuple[int, int], ...]
    """[start, end) units of every stage, in model order."""
    recompute: tuple[str, ...]
    """Recompute mode of every stage."""
    analysis: Analysis | None = None

    def to_plan(self, model: ModelSpec, dtype: str = "bf16") -> Plan:
        s, sk = self.setting, self.skeleton
        stages = tuple(Stage(start=a, end=b, group=j % sk.pp, recompute=r)
                       for j, ((a, b), r) in enumerate(zip(self.bounds, self.recompute)))
        return Plan(groups=sk.groups, stages=stages, micro_batch=s.micro_batch,
                    num_micro_batches=s.num_micro_batches, schedule=s.schedule,
                    virtual_stages=s.virtual_stages, sequence_parallel=s.sequence_parallel,
                    zero=s.zero, dtype=dtype, model=model.name, seq_len=model.seq_len,
                    cp_comm=sk.kinds[0].cp_comm, ep=sk.ep)

    def key(self) -> tuple:
        """Identity of the plan (for de-duplication and fixed tie-breaking)."""
        s = self.setting
        return (tuple(g.ranks for g in self.skeleton.groups), tuple(g.tp for g in self.skeleton.groups),
                tuple((k.cp, k.cp_comm) for k in self.skeleton.kinds),
                s.micro_batch, s.schedule, s.virtual_stages, s.zero, s.sequence_parallel,
                self.bounds, self.recompute, self.skeleton.ep)


@dataclass
class StageFigures:
    """Per-micro-batch costs of one stage (the cost model's StageCosts, recomputed)."""

    forward: float
    backward_input: float
    backward_weight: float
    send_forward: float
    send_backward: float
    grad_reduce: float
    params: float
    cast_params: float
    activation: float
    transient: float
    max_params: float
    units: int
    kernels: float = 0.0
    """Kernels the host issues per micro-batch (``costmodel.host``)."""
    zero_params: float = 0.0
    """Parameters ZeRO divides by dp (the held ones, with experts counted whole)."""

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight


def stage_figures(tables: Tables, sk: Skeleton, st: Setting, bounds: Sequence[tuple[int, int]],
                  recompute: Sequence[str], known: dict | None = None) -> list[StageFigures]:
    """Costs of every stage, as ``costmodel.estimate.stage_costs`` computes them.
    ``known``: figures already computed for this skeleton and setting, by (stage index,
    start, end, mode, stages) -- a stage's figures depend on nothing else -- read and
    filled (local search changes a stage or two per move)."""
    n = len(bounds)
    groups = _GroupFigures(tables, sk, st)
    if known is None:
        return [groups.stage(j, n, a, b, mode) for j, ((a, b), mode) in enumerate(zip(bounds, recompute))]
    out = []
    for j, ((a, b), mode) in enumerate(zip(bounds, recompute)):
        key = (j, a, b, mode, n)
        f = known.get(key)
        if f is None:
            f = known[key] = groups.stage(j, n, a, b, mode)
        out.append(f)
    return out


class _GroupFigures:
    """What every stage of one group shares (its table's prefix sums, its data-parallel
    collectives' affine costs), looked up once per group instead of once per stage."""

    def __init__(self, tables: Tables, sk: Skeleton, st: Setting):
        self.tables, self.sk, self.st = tables, sk, st
        self._of: dict = {}

    def _group(self, g: int) -> tuple:
        hit = self._of.get(g)
        if hit is None:
            tables, sk, st = self.tables, self.sk, self.st
            group = sk.groups[g]
            stack = tables.stack
            t = tables.table(sk.kinds[g], st.micro_batch, st.sequence_parallel, (sk, st, g)).scalars
            shards = group.dp * group.cp
            # (Under pipelining the search's stages are those the stack runs there:
            # st.zero is realized, see _Search.zero_options.)
            every = shards > 1 and st.zero >= stack.reduce_every_micro_batch_from_zero
            zero3 = None
            if st.zero >= 3 and shards > 1:
                colls = ((stack.gathered_weights_bytes_per_param, tables.dp_affines(group, "all_gather"), "all_gather"),
                         (stack.grad_reduce_bytes_per_param, tables.dp_affines(group, "reduce_scatter"),
                          "reduce_scatter"))
                # What each further gather or reduce-scatter adds: its latency (the slowest
                # group's) and the stack's own work per rank of the group.
                zero3 = (max(a_ for a_, _ in colls[0][1]), max(a_ for a_, _ in colls[1][1]),
                         shards * zero3_rank_overhead(stack, tables.cluster.groups[sk.kinds[g].pool].device))
            elif every:
                colls = ((stack.grad_reduce_bytes_per_param, tables.dp_affines(group, "reduce_scatter"),
                          "reduce_scatter"),)
            elif shards > 1:
                kind = stack.grad_reduce_kind(st.zero)
                colls = ((stack.grad_reduce_bytes_per_param, tables.dp_affines(group, kind), kind),)
            else:
                colls = ()
            hit = self._of[g] = (t, group, colls, zero3, every, tables.cast_field(sk, st, g))
        return hit

    def stage(self, j: int, n: int, a: int, b: int, mode: str) -> StageFigures:
        """Costs of stage ``j`` of ``n`` (units [a, b), recompute ``mode``)."""
        tables, sk = self.tables, self.sk
        P = sk.pp
        g = j % P
        t, group, colls, zero3, every, cast_field = self._group(g)
        q = RECOMPUTES.index(mode)
        fwd = t["cum_forward"][b] - t["cum_forward"][a]
        cbi = t["cum_backward_input"][q]
        bi = cbi[b] - cbi[a]
        bw = t["cum_backward_weight"][b] - t["cum_backward_weight"][a]
        mem = _stage_memory(t, a, b, q, cast_field)
        params = mem.params
        # Expert gradients go over the ranks holding the same experts (costmodel.experts).
        ep = sk.ep
        expert = t["cum_expert_params"][b] - t["cum_expert_params"][a] if ep > 1 else 0.0

        def collective(per_param: float, affines, kind: str) -> float:
            # (tables.dp_collective on a scalar: the slowest data-parallel group.)
            x = (params - expert) * per_param
            out = max((a_ + b_ * x if x > 0 else 0.0) for a_, b_ in affines) if affines else 0.0 * x
            return out + (tables.expert_dp_collective(group, ep, expert * per_param, kind) if expert else 0.0)
        reduce = 0.0
        if len(colls) == 2:
            # One collective per gather unit (as costmodel.estimate.stage_costs): each
            # further one pays the latency again, every one the stack's work per rank.
            z3 = t["cum_zero3_collectives"]
            gathers, scatters = z3[0][b] - z3[0][a], z3[1][b] - z3[1][a]
            gather_latency, scatter_latency, per_rank = zero3
            gather = collective(*colls[0]) + (gathers - 1) * gather_latency + gathers * per_rank
            scatter = collective(*colls[1]) + (scatters - 1) * scatter_latency + scatters * per_rank
            # (ZeRO-3's copies, as costmodel.estimate.stage_costs charges them; params: the
            # rank's own, experts / ep.)
            on_compute, beside = tables.zero3_copy_rates(sk.kinds[g].pool)
            bi += params * on_compute
            gathers_bwd = (zero3_gather_passes(tables.stack, mode) - 1) * gather
            if tables.stack.overlap_zero3:
                fwd = max(fwd, gather)
                bi += max(0.0, gathers_bwd + scatter + params * beside - (bi + bw))
            else:
                fwd += gather
                bi += gathers_bwd + scatter + params * beside
        elif every:
            # Reduce-scattered every micro-batch, beside its backward where the stack
            # overlaps (as the cost model).
            scatter = collective(*colls[0])
            bi += max(0.0, scatter - (bi + bw)) if tables.options.overlap_grad_reduce else scatter
        elif colls:
            reduce = collective(*colls[0])
        send_f = send_b = 0.0
        if j < n - 1:
            nxt = sk.groups[(j + 1) % P]
            if nxt is not group:
                send_f = tables.p2p(group, nxt, t["output_bytes"][b - 1], self.st.sequence_parallel)
        if j > 0:
            prv = sk.groups[(j - 1) % P]
            if prv is not group:
                send_b = tables.p2p(group, prv, t["output_bytes"][a - 1], self.st.sequence_parallel)
        return StageFigures(
            forward=fwd, backward_input=bi, backward_weight=bw, send_forward=send_f, send_backward=send_b,
            grad_reduce=reduce, params=params, cast_params=mem.cast_params, activation=mem.activation,
            transient=mem.transient, max_params=mem.max_params, units=b - a, zero_params=mem.zero_params,
            kernels=t["cum_kernels"][q][b] - t["cum_kernels"][q][a])


class _StageMemory(NamedTuple):
    """The fields of :class:`StageFigures` that memory depends on (see :func:`fits_memory`)."""

    params: float
    zero_params: float
    max_params: float
    cast_params: float
    activation: float
    transient: float


def _stage_memory(t: dict, a: int, b: int, q: int, cast_field: str) -> _StageMemory:
    """The memory fields of units [a, b) in recompute mode ``q`` from a table's scalars
    (``cast_field``: see ``Tables.cast_field``)."""
    return _StageMemory(
        params=t["cum_params"][b] - t["cum_params"][a],
        zero_params=t["cum_zero_params"][b] - t["cum_zero_params"][a],
        max_params=t["max_params"][a][b], cast_params=t[cast_field][b] - t[cast_field][a],
        activation=t["cum_activation"][q][b] - t["cum_activation"][q][a],
        transient=t["max_transient"][q][a][b])


def fits_memory(tables: Tables, sk: Skeleton, st: Setting, bounds: Sequence[tuple[int, int]],
                recompute: Sequence[str]) -> bool:
    """Whether a split fits, exactly as :func:`analyze` decides it, without the stages' time
    figures (their collectives and sends are most of what a stage figure costs)."""
    of_group = _scalars_of_groups(tables, sk, st)
    fields = [tables.cast_field(sk, st, g) for g in range(sk.pp)]
    figs = [_stage_memory(of_group[j % sk.pp], a, b, RECOMPUTES.index(mode), fields[j % sk.pp])
            for j, ((a, b), mode) in enumerate(zip(bounds, recompute))]
    return _fits(tables, sk, group_memory(tables, sk, st, figs))


def _scalars_of_groups(tables: Tables, sk: Skeleton, st: Setting) -> list[dict]:
    """Each group's table scalars (looked up once per group, not once per stage)."""
    return [tables.table(k, st.micro_batch, st.sequence_parallel).scalars for k in sk.kinds]


def _fits(tables: Tables, sk: Skeleton, memory: Sequence[float]) -> bool:
    return all(x <= tables.capacity(k.pool) for x, k in zip(memory, sk.kinds))


def work_floor(tables: Tables, sk: Skeleton, st: Setting, bounds: Sequence[tuple[int, int]],
               recompute: Sequence[str]) -> float:
    """A lower bound on the iteration time of a split, from its stages' compute alone (no
    figures needed): every rank runs its micro-batches' forward and backward passes one
    after another, whatever the schedule (ZeRO-3 gathers, sends, the data-parallel
    reduction and the optimizer step only add to it; the closed form and the simulation
    both take at least this)."""
    P = sk.pp
    per_rank = [0.0] * P
    of_group = _scalars_of_groups(tables, sk, st)
    for j, ((a, b), mode) in enumerate(zip(bounds, recompute)):
        t = of_group[j % P]
        cbi = t["cum_backward_input"][RECOMPUTES.index(mode)]
        per_rank[j % P] += (t["cum_forward"][b] - t["cum_forward"][a]) + (cbi[b] - cbi[a]) \
            + (t["cum_backward_weight"][b] - t["cum_backward_weight"][a])
    return st.num_micro_batches * max(per_rank)


def group_memory(tables: Tables, sk: Skeleton, st: Setting, figs: Sequence[StageFigures]) -> list[float]:
    """Peak bytes per GPU of every pipeline group (``figs``: any records with the memory
    fields of :class:`StageFigures`)."""
    P, v = sk.pp, st.virtual_stages
    fl = inflight(st.schedule, P, st.num_micro_batches, v)

    def per_chunk(name: str) -> np.ndarray:
        # (v, P): chunk c of group g is stage c * P + g.
        return np.array([getattr(f, name) for f in figs]).reshape(v, P)
    # Every group at once; sums over a group's chunks go chunk after chunk, as a plain
    # sum over them would (the same bits).
    params = np.add.reduce(per_chunk("params"), axis=0)
    sharded = np.add.reduce(per_chunk("zero_params"), axis=0)
    states = tables.state_bytes(params, np.maximum.reduce(per_chunk("max_params"), axis=0), sk.shards, st.zero,
                                sharded)
    casts = tables.cast_bytes(np.add.reduce(per_chunk("cast_params"), axis=0), sk.shards, st.zero)
    chunks = per_chunk("activation").T.tolist()
    act = np.array([fl.peak_bytes(g, chunks[g]) for g in range(P)])
    trans = np.maximum.reduce(per_chunk("transient"), axis=0)
    fixed = np.array([tables.fixed_bytes(sk.kinds[g].pool, sk.groups[g], P, sk.ep) for g in range(P)])
    return tables.memory_total(states, act, trans + casts, tables.step_bytes(params, sk.shards, st.zero, sharded),
                               fixed).tolist()


def pipeline_time(sk: Skeleton, st: Setting, figs: Sequence[StageFigures], tables: Tables,
                  blocking_p2p: bool = True, overlap_grad_reduce: bool = True) -> float:
    """Closed-form iteration time (see the module docstring). With ``blocking_p2p`` a rank
    is held by its own sends, so they count in its per-micro-batch time."""
    P, v, m = sk.pp, st.virtual_stages, st.num_micro_batches
    S = len(figs)
    if blocking_p2p:
        work = [f.forward + f.backward + f.send_forward + f.send_backward for f in figs]
    else:
        work = [f.forward + f.backward for f in figs]
    per_rank = [sum(work[g::P]) for g in range(P)]
    tau = max(per_rank)
    total = sum(work)
    # One micro-batch crosses every boundary forward and backward once per pass.
    comm = sum(figs[j].send_forward + figs[j + 1].send_backward for j in range(S - 1))
    period = tau
    if P > 1 and st.schedule != "gpipe":
        # The schedule lets the first stage hold only so many micro-batches, and each must
        # come back (through every stage's forward, the last one's backward and the input
        # gradients' way back; zero-bubble defers the weight gradients off that path) before
        # it takes another: where the sends are slow against the stages' work, that round
        # trip over the count, not the busiest rank, sets the period.
        back = [f.backward_input if st.schedule == "zero-bubble" else f.backward for f in figs]
        trip = sum(f.forward for f in figs) + sum(back) + comm
        period = max(tau, trip / inflight(st.schedule, P, m, v).per_chunk[0][0])
    if st.schedule == "zero-bubble" and P > 1:
        # ZB-H1 fills the bubble with deferred weight-gradient work: (p-1)(F + B_in - B_w).
        fill = [f.forward + f.backward_input - f.backward_weight for f in figs]
        bubble = max(0.0, sum(fill) - max(fill))
        pipe = m * period + bubble + comm
    elif st.schedule == "gpipe" and P > 1:
        fw = [f.forward + (f.send_forward if blocking_p2p else 0.0) for f in figs]
        bw = [f.backward + (f.send_backward if blocking_p2p else 0.0) for f in figs]
        pipe = sum(fw) + (m - 1) * max(fw) + sum(bw) + (m - 1) * max(bw) + comm
    else:
        # 1F1B; interleaving divides the fill/drain by v (Narayanan et al. 2021, §2.2).
        pipe = m * period + (total - tau) / v + comm
    # Rank g finishes its compute once the last backward has flowed back to it; then its
    # exposed gradient reduction and optimizer step follow.
    end = 0.0
    drain = 0.0
    opt, post = _tails(tables, sk, st, figs)
    for g in range(P):
        if g > 0:
            drain += figs[g - 1].backward + figs[g].send_backward
        last = figs[g]   # chunk 0 of rank g runs the rank's last backward
        tail_action = last.backward_weight if st.schedule == "zero-bubble" else last.backward
        reduce = sum(f.grad_reduce for f in figs[g::P])
        exposed = 0.0
        if reduce > 0:
            exposed = (max(reduce - tail_action, last.grad_reduce / max(last.units, 1))
                       if overlap_grad_reduce else reduce)
        end = max(end, pipe - drain + exposed + opt[g] + post[g])
    return end


SIM_ACTIONS = 1024
"""Schedule programs of at most this many actions, with fewer than two micro-batches per
pipeline rank, are simulated exactly (the cost model's own event simulation, a few
milliseconds) instead of timed by the closed form: there the fill and drain dominate and
the closed form is too coarse (with more micro-batches it is within a few percent)."""


SIM_ALWAYS = 256
"""Programs this short are always simulated: it costs well under a millisecond."""


def program_actions(st: Setting, pp: int) -> int:
    """Compute actions of the schedule program of ``pp`` groups under ``st``."""
    return pp * st.virtual_stages * st.num_micro_batches * (3 if st.schedule == "zero-bubble" else 2)


def simulated(st: Setting, pp: int) -> bool:
    """Whether candidates of this shape are timed by simulation (see SIM_ACTIONS)."""
    if pp == 1:
        return False        # no pipeline: the closed form is exact
    actions = program_actions(st, pp)
    return actions <= SIM_ALWAYS or (st.num_micro_batches < 2 * pp * st.virtual_stages and actions <= SIM_ACTIONS)


def _tails(tables: Tables, sk: Skeleton, st: Setting, figs: Sequence[StageFigures]) -> tuple[list, list]:
    """Per group: (optimizer step, with the tied embedding's gradient sum on the first and last
    group; exposed ZeRO-1/2 parameter all-gather), as the cost model."""
    opt, post = [], []
    for g in range(sk.pp):
        params = sum(f.params for f in figs[g::sk.pp])
        group = sk.groups[g]
        local = sum(f.zero_params for f in figs[g::sk.pp]) / (group.dp * group.cp) if st.zero >= 1 else params
        opt.append(local * tables.optimizer_rate(sk.kinds[g].pool) + tables.step_overhead(sk.kinds[g].pool)
                   + (tables.tied_grad(sk, st.zero) if g in (0, sk.pp - 1) else 0.0))
        post.append(tables.dp_collective(group, params * tables.weight_bytes, "all_gather")
                    if st.zero in (1, 2) and group.dp * group.cp > 1 and not tables.stack.overlap_param_gather
                    else 0.0)
    return opt, post


def simulated_time(tables: Tables, sk: Skeleton, st: Setting, figs: Sequence[StageFigures]) -> float:
    """Iteration time from the cost model's event simulation of the schedule program, with
    the stage costs computed here (identical to ``costmodel.estimate``'s)."""
    from autoplan.schedule import build_program
    from costmodel.simulate import StageCosts, simulate

    stages = tuple(Stage(start=0, end=1, group=j % sk.pp) for j in range(len(figs)))
    plan = Plan(groups=sk.groups, stages=stages, micro_batch=st.micro_batch,
                num_micro_batches=st.num_micro_batches, schedule=st.schedule, virtual_stages=st.virtual_stages)
    costs = [StageCosts(forward=f.forward, backward=f.backward, backward_input=f.backward_input,
                        backward_weight=f.backward_weight, send_forward=f.send_forward,
                        send_backward=f.send_backward, activation_bytes=f.activation,
                        grad_reduce=f.grad_reduce, layers=f.units) for f in figs]
    opt, post = _tails(tables, sk, st, figs)
    opts = tables.options
    return simulate(build_program(plan), costs, opt, opts.overlap_grad_reduce, post,
                    blocking_p2p=opts.blocking_p2p, timeline=False).iteration_time


def host_time(tables: Tables, sk: Skeleton, st: Setting, figs: Sequence[StageFigures]) -> float:
    """Host seconds of a step along the pipeline, as ``costmodel.estimate.host_time``
    counts them: each group's stages' kernels for every micro-batch, at its pool's costs."""
    return _host_time(tables, sk, st, [f.kernels for f in figs])


def split_host_time(tables: Tables, sk: Skeleton, st: Setting, bounds: Sequence[tuple[int, int]],
                    recompute: Sequence[str]) -> float:
    """:func:`host_time` of a split, from the tables alone (no stage figures needed)."""
    kernels = []
    for j, ((a, b), mode) in enumerate(zip(bounds, recompute)):
        cum = tables.table(sk.kinds[j % sk.pp], st.micro_batch, st.sequence_parallel,
                           (sk, st, j % sk.pp)).scalars["cum_kernels"]
        q = RECOMPUTES.index(mode)
        kernels.append(cum[q][b] - cum[q][a])
    return _host_time(tables, sk, st, kernels)


def _host_time(tables: Tables, sk: Skeleton, st: Setting, kernels: Sequence[float]) -> float:
    P = sk.pp
    costs = [tables.host_costs(sk.kinds[g].pool) for g in range(P)]
    return pipeline_host_time([c.per_kernel_s * sum(kernels[g::P]) for g, c in enumerate(costs)],
                              [c.per_step_s for c in costs], st.num_micro_batches)


def busy_bound(tables: Tables, sk: Skeleton, st: Setting, figs: Sequence[StageFigures]) -> float:
    """A lower bound on the simulated iteration time: every rank runs its micro-batches'
    forward and backward passes (and, with blocking sends, its sends) one after another,
    then its optimizer step."""
    P, m = sk.pp, st.num_micro_batches
    opt, post = _tails(tables, sk, st, figs)
    blocking = tables.options.blocking_p2p
    out = 0.0
    for g in range(P):
        work = sum(f.forward + f.backward + ((f.send_forward + f.send_backward) if blocking else 0.0)
                   for f in figs[g::P])
        out = max(out, m * work + opt[g] + post[g])
    return out


def analyze(tables: Tables, sk: Skeleton, st: Setting, bounds, recompute, figs=None,
            fitting_only: bool = False) -> tuple[Analysis, list]:
    """Fast-model time and memory of a candidate: exact simulation for short programs,
    the closed form otherwise (``figs``: its stage figures, when already computed).
    ``fitting_only``: a candidate that does not fit is not timed (its time is inf; the
    search discards it anyway, and timing is most of the cost)."""
    if figs is None:
        figs = stage_figures(tables, sk, st, bounds, recompute)
    mem = group_memory(tables, sk, st, figs)
    fits = _fits(tables, sk, mem)
    opts = tables.options
    if fitting_only and not fits:
        time_s = float("inf")
    elif simulated(st, sk.pp):
        time_s = with_host(simulated_time(tables, sk, st, figs), host_time(tables, sk, st, figs))
    else:
        time_s = with_host(pipeline_time(sk, st, figs, tables, opts.blocking_p2p, opts.overlap_grad_reduce),
                           host_time(tables, sk, st, figs))
    return Analysis(time_s=time_s, memory=tuple(mem), fits=fits), figs


__all__ = ["Skeleton", "Setting", "Candidate", "Analysis", "StageFigures", "stage_figures",
           "group_memory", "fits_memory", "work_floor", "pipeline_time", "busy_bound", "host_time", "split_host_time", "analyze",
           "replace"]
