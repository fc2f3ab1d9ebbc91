"""Per-unit cost tables: the cost model's per-layer figures laid out as arrays with prefix
sums, so that the cost of any contiguous run of units on any device kind is O(1), and
the cost of *every* run at once is one numpy expression (what the layer-split DP needs).

Every figure comes from the cost model's own functions, on one layer at a time:
``costmodel.compute.layer_timing`` for time, ``costmodel.memory.activation_bytes``,
``model_state_bytes`` and ``transient_bytes`` for memory, ``costmodel.comm`` for
collectives. Sums and maxima over a run reproduce what ``costmodel.estimate`` computes
for a stage (it sums timings and activations over the stage's layers and takes the
maximum transient), which the tests check plan by plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from autoplan.catalog import is_accelerator
from autoplan.cluster import Cluster
from autoplan.models.spec import ModelSpec
from autoplan.plan import DeviceGroup
from autoplan.units import DTYPE_BYTES, GiB
from costmodel import experts
from costmodel.comm import collective_time, p2p_time, zero3_collectives
from costmodel.compute import hidden_tp_forward, layer_timing
from costmodel.context import context_shard, stage_exchange
from costmodel.efficiency import achieved_memory_bandwidth
from costmodel.estimate import EstimateOptions, device_timing_inputs, group_degrees, tied_grad_time
from costmodel.host import HostCosts, host_costs, layer_host_kernels
from costmodel.memory import (activation_bytes, after_backward_bytes, communicators, transient_bytes,
                              zero3_gathered_params, zero3_working_set)
from costmodel.redistribute import layout_comm

RECOMPUTES = ("none", "selective", "full")
"""Recompute modes in order of increasing time and decreasing memory."""

PROBE = 1e8
"""Bytes at which the affine (alpha-beta) communication costs are read off the cost model."""



@dataclass(frozen=True)
class Kind:
    """A device-group template: which node group the GPUs come from, the tensor-parallel
    degree inside each replica and how each replica splits its sequences."""

    pool: int
    """Index into ``Cluster.groups`` (every GPU of a device group is of this node group)."""
    tp: int
    """Tensor-parallel degree (the replica's GPUs sit in one node)."""
    cp: int = 1
    """Context-parallel degree (ranks splitting each sequence)."""
    cp_comm: str = "p2p"
    """The context-parallel exchange (autoplan.plan.CP_COMMS); only meaningful when cp > 1."""
    ep: int = 1
    """Expert-parallel degree of the plan (mixture-of-experts models; the same in every group):
    it changes expert units' GEMMs, their all-to-all and the expert states a GPU holds."""


@dataclass
class LayerTable:
    """Costs of every unit of a model on one device kind, at one micro-batch size and
    sequence-parallel setting. Arrays are indexed by unit; ``cum_*`` arrays are prefix sums
    of length ``units + 1`` so a run [s, e) costs ``cum[e] - cum[s]``."""

    kind: Kind
    """Device kind the table is for."""
    micro_batch: int
    """Samples per micro-batch."""
    sequence_parallel: bool
    """Whether tensor-parallel regions are sequence-sharded."""
    forward: np.ndarray
    """Forward seconds per micro-batch, tensor-parallel all-reduces included."""
    tp_forward: np.ndarray
    """The tensor-parallel communication part of ``forward``."""
    backward_input: np.ndarray
    """Input-gradient seconds per micro-batch, by recompute mode: shape (3, units);
    includes the recomputation and the backward tensor-parallel communication."""
    backward_weight: np.ndarray
    """Weight-gradient seconds per micro-batch."""
    params: np.ndarray
    """Parameters per GPU (tensor-parallel shard; 1/ep of the routed experts)."""
    zero_params: np.ndarray
    """Parameters ZeRO divides by the data-parallel degree (dense ones over dp ranks, experts
    over the dp / ep ranks holding them: together the unit's whole tensor-parallel shard)."""
    expert_params: np.ndarray
    """Routed-expert parameters per GPU (reduced over the expert data-parallel groups)."""
    cast_params: np.ndarray
    """Parameters a matmul reads (all but embedding tables): what a stack that casts fp32
    weights to half precision copies."""
    activation: np.ndarray
    """Bytes one micro-batch keeps for backward, by recompute mode: shape (3, units)."""
    transient: np.ndarray
    """Peak temporary bytes during the unit's backward, by recompute mode: shape (3, units)."""
    output_bytes: np.ndarray
    """Bytes of each unit's output for one micro-batch (what a pipeline send carries)."""
    cum_forward: np.ndarray
    cum_tp_forward: np.ndarray
    cum_backward_input: np.ndarray
    cum_backward_weight: np.ndarray
    cum_params: np.ndarray
    cum_zero_params: np.ndarray
    cum_expert_params: np.ndarray
    cum_cast_params: np.ndarray
    cum_activation: np.ndarray
    cum_zero3_collectives: np.ndarray
    """Prefix sums of the all-gathers (row 0) and reduce-scatters (row 1) of each unit's
    ZeRO-3 gather pass and gradient reduction: shape (2, units + 1)
    (``costmodel.comm.zero3_collectives``)."""
    cum_kernels: np.ndarray
    """Prefix sums of the kernels the host issues for one micro-batch of each unit, by
    recompute mode: shape (3, units + 1) (``costmodel.host.layer_host_kernels``)."""
    max_params: np.ndarray
    """max_params[s, e]: largest ZeRO-3 gather (in parameters) of the run [s, e), its working
    set (``costmodel.memory.zero3_gathered_params``)."""
    max_transient: np.ndarray
    """max_transient[q, s, e]: largest transient of the run [s, e) under recompute mode q."""
    sources: frozenset
    """'measured' and/or 'roofline': where the timings came from."""

    @property
    def units(self) -> int:
        return len(self.forward)

    @cached_property
    def scalars(self) -> dict:
        """The prefix sums and range maxima as nested Python lists (same values): indexing
        them one stage at a time is several times faster than indexing the arrays."""
        return {name: getattr(self, name).tolist() for name in (
            "cum_forward", "cum_backward_input", "cum_backward_weight", "cum_params", "cum_cast_params",
            "cum_activation", "output_bytes", "max_params", "max_transient", "cum_expert_params",
            "cum_zero_params", "cum_kernels", "cum_zero3_collectives")}


def _range_max(x: np.ndarray) -> np.ndarray:
    """M[s, e] = max(x[s:e]) for s < e (0 elsewhere), in one vectorized pass."""
    n = len(x)
    rows = np.arange(n + 1)[:, None]
    cols = np.arange(n + 1)[None, :]
    vals = np.concatenate(([0.0], x))[cols]          # x[e - 1] at column e
    a = np.where(cols - 1 >= rows, vals, -np.inf)
    out = np.maximum.accumulate(a, axis=1)
    return np.where(np.isfinite(out), out, 0.0)


class Tables:
    """Builds and caches :class:`LayerTable` s and communication costs for one
    (model, cluster, dtype, profiles)."""

    def __init__(self, model: ModelSpec, cluster: Cluster, dtype: str = "bf16",
                 options: EstimateOptions | None = None):
        self.model = model
        self.cluster = cluster
        self.dtype = dtype
        self.options = options or EstimateOptions()
        """The cost model's options (measured profiles, blocking sends, overlap)."""
        self.profiles = self.options.profiles
        self.stack = self.options.stack
        """The training stack whose memory and kernels the tables use."""
        self.weight_bytes = DTYPE_BYTES[dtype]
        """Bytes of a half-precision parameter as communicated (gathers of updated weights)."""
        self.dynamic_factor = 1.0 + self.stack.allocator_fragmentation
        """The cost model's factor on the dynamic working set (fragmentation)."""
        self.margin = self.options.memory_margin
        """Share of each device's memory kept free while searching (see ``capacity``)."""
        cal = self.options.calibration
        self._act_scale = cal.activation_scale if cal is not None else 1.0
        self._extra_bytes = cal.memory_overhead_bytes if cal is not None else 0.0
        self._tables: dict[tuple, LayerTable] = {}
        self._pool_first = [cluster.group_ranks(k).start for k in range(len(cluster.groups))]
        self._node_of = np.array([slot.node for slot in cluster.slots])
        self._pool_of = np.array([slot.group for slot in cluster.slots])
        self._shapes: dict = {}
        self.built = 0
        """Tables built (for the search statistics)."""
        # Per-instance caches (an lru_cache on methods would keep every search's tables alive).
        self._affine: dict = {}
        self._dp_affines: dict = {}
        self._tied: dict = {}
        self._p2p: dict = {}
        self._p2p_classes: dict = {}
        self._opt_rate: dict = {}
        self._zero3_rates: dict = {}
        self._traffic: dict = {}
        self._autocast: dict = {}
        self._cast_all: dict = {}
        self._host_costs: dict = {}

    # --------------------------------------------------------------- layers
    def table(self, kind: Kind, micro_batch: int, sequence_parallel: bool, exact_for=None) -> LayerTable:
        """The units' costs on ``kind`` at this micro-batch size. Times count the stack's own
        traffic where every plan pays it (``Stack.least_traffic``: what bounds may count on)
        and the host's kernels without autocast's casts (the fewest);
        ``exact_for=(skeleton, setting, group index)`` counts both as that plan's group pays
        them (``Stack.traffic_for``, ``Stack.computes_under_autocast``). Memory is the same
        either way."""
        sp = sequence_parallel and kind.tp > 1
        traffic = self.stack.least_traffic if exact_for is None else self.traffic(*exact_for)
        autocast = exact_for is not None and self.autocast(*exact_for)
        key = (kind, micro_batch, sp, traffic, autocast)
        t = self._tables.get(key)
        if t is None:
            t = self._build(kind, micro_batch, sp, traffic, autocast)
            self._tables[key] = t
        return t

    def _degrees(self, sk, st, g: int) -> tuple:
        return group_degrees(sk.groups[g], st.zero, sk.pp, sk.ep, st.schedule, self.dtype)

    def traffic(self, sk, st, g: int) -> tuple | None:
        """The stack's own traffic as group ``g`` of skeleton ``sk`` under setting ``st``
        pays it (``Stack.traffic_for``)."""
        if self.stack.least_traffic == self.stack.traffic:
            return self.stack.traffic         # (the same for every plan: most stacks)
        key = self._degrees(sk, st, g)
        hit = self._traffic.get(key, False)
        if hit is False:
            hit = self._traffic[key] = self.stack.traffic_for(*key)
        return hit

    def cast_field(self, sk, st, g: int) -> str:
        """The prefix sums of the parameters group ``g`` of skeleton ``sk`` under setting
        ``st`` holds a half-precision compute copy of: every one (``cum_params``) where FSDP's
        mixed precision makes it, the matmuls' weights (``cum_cast_params``) otherwise
        (``Stack.casts_all_weights``). The latter is the least, which bounds count on."""
        if not self.stack.weight_cast_bytes_per_param:
            return "cum_cast_params"
        key = self._degrees(sk, st, g)
        hit = self._cast_all.get(key)
        if hit is None:
            hit = self._cast_all[key] = self.stack.casts_all_weights(*key)
        return "cum_params" if hit else "cum_cast_params"

    def autocast(self, sk, st, g: int) -> bool:
        """Whether group ``g`` of skeleton ``sk`` under setting ``st`` computes under autocast
        (``Stack.computes_under_autocast``): its host issues the casts too."""
        if not self.stack.autocasts:
            return False                      # (no plan does: most stacks)
        key = self._degrees(sk, st, g)
        hit = self._autocast.get(key)
        if hit is None:
            hit = self._autocast[key] = self.stack.computes_under_autocast(*key)
        return hit

    def _build(self, kind: Kind, b: int, sp: bool, traffic: tuple | None, autocast: bool = False) -> LayerTable:
        self.built += 1
        model, dtype, tp, cp, ep = self.model, self.dtype, kind.tp, kind.cp, kind.ep
        dev = self.cluster.groups[kind.pool].device
        first = self._pool_first[kind.pool]
        tp_ranks = tuple(range(first, first + tp))
        # One replica's tp x cp ranks sit together (tensor fastest): its context rings.
        cp_groups = [tuple(first + c * tp + t for c in range(cp)) for t in range(tp)]
        # An expert-parallel group: ep consecutive (replica, sequence shard) positions of the
        # pool's first tensor shard.
        ep_ranks = tuple(first + j * tp for j in range(ep))
        n = model.num_layers
        fwd, tpf, bw, params, cast, out, zparams, eparams, gathers = (np.zeros(n) for _ in range(9))
        z3 = np.zeros((2, n))
        stack = self.stack
        eff, scale, label = device_timing_inputs(dev, self.options)
        bi = np.zeros((3, n))
        act = np.zeros((3, n))
        trans = np.zeros((3, n))
        kern = np.zeros((3, n))
        sources = set()
        memo: dict = {}
        for i, layer in enumerate(model.layers):
            # The head's tensor-parallel communication depends on the unit before it.
            memo_key = (layer, context_shard(model.layers[i - 1], cp).output_bytes
                        if layer.kind == "head" and i else 0.0)
            row = memo.get(memo_key)
            if row is None:
                layer = context_shard(layer, cp)   # this rank's share of the sequence
                load = experts.expert_load(layer.experts, ep, b * (model.tokens_per_sample or model.seq_len) / cp,
                                           self.options.expert_load)
                t = layer_timing(dev, layer, b, tp, sp, dtype, self.profiles, stack.attention, eff, ep, load,
                                 stack.forward_host_s_per_kernel, stack.fp8_cast, traffic)
                tp_comm = 0.0
                if tp > 1:
                    # As costmodel.estimate.stage_costs: row-parallel outputs all-reduced; the
                    # head all-reduces its input gradient and, without a vocabulary-parallel
                    # loss, gathers the logits.
                    size = layer.output_bytes if layer.kind != "head" else memo_key[1]
                    if layer.tp_allreduces_fwd:
                        tp_comm = layer.tp_allreduces_fwd * collective_time(
                            self.cluster, tp_ranks, b * size, "all_reduce")
                    if layer.kind == "head" and layer.tp_allreduces_fwd and not stack.vocab_parallel_loss:
                        tp_comm += collective_time(self.cluster, tp_ranks, b * layer.output_bytes, "all_gather")
                # Expert units dispatch and combine by all-to-all, twice each way (as
                # costmodel.estimate.stage_costs).
                ep_comm = 2 * experts.dispatch_time(self.cluster, [ep_ranks], layer, b, load) if ep > 1 else 0.0
                # The forward's collectives fill its wait on the host first; the backward's
                # add in full (as costmodel.estimate.stage_costs).
                tp_back = tp_comm
                tp_comm = hidden_tp_forward(tp_comm, t.forward_host_wait * scale)
                if tp > 1:
                    # The collectives of a unit under operator layouts (forward and backward apart).
                    f_, b_ = layout_comm(self.cluster, [tp_ranks], layer, b)
                    tp_comm, tp_back = tp_comm + f_, tp_back + b_
                rec = (0.0, t.recompute_selective, stack.full_recompute_time(t))
                f, bwi, bww = t.forward * scale, t.backward_input * scale, t.backward_weight * scale
                rec = tuple(r * scale for r in rec)
                cp_f, cp_b, buffers = stage_exchange(self.cluster, cp_groups, kind.cp_comm, model, [layer], [dev],
                                                     b, tp, dtype, self.weight_bytes, stack.overlap_cp_exchange,
                                                     stack.attention)
                # The cost model repeats the forward's tensor-parallel collectives (and expert
                # all-to-alls) when a fully recomputed unit re-runs its forward, and the context
                # exchange when any recomputation re-runs its attention.
                bi_q = tuple(bwi + rec[q] + tp_back + (tp_comm if q == 2 else 0.0) + cp_b + (cp_f if q else 0.0)
                             + ep_comm * (2 if q == 2 else 1) for q in range(3))
                act_q = tuple(self._act_scale * activation_bytes([layer], m, b, tp, sp, stack, dtype, load)
                              for m in RECOMPUTES)
                trans_q = tuple(self._act_scale * transient_bytes([layer], m, b, tp, sp, stack, dtype, ep, load)
                                + buffers for m in RECOMPUTES)
                src = label if label and t.source == "roofline" else t.source
                held, whole = experts.state_params([layer], tp, ep)
                gathered = zero3_gathered_params(layer, tp, ep, stack)
                kern_q = tuple(layer_host_kernels(layer, m, stack, autocast) for m in RECOMPUTES)
                row = (f + tp_comm + cp_f + ep_comm, tp_comm, bi_q, bww, held,
                       held if layer.kind != "embedding" else 0.0,
                       b * layer.output_bytes, act_q, trans_q, src, whole, experts.expert_params([layer], tp) / ep,
                       kern_q, gathered, zero3_collectives([layer], stack))
                memo[memo_key] = row
            (fwd[i], tpf[i], bi_q, bw[i], params[i], cast[i], out[i], act_q, trans_q, src, zparams[i],
             eparams[i], kern_q, gathers[i], z3_i) = row
            z3[:, i] = z3_i
            bi[:, i], act[:, i], trans[:, i], kern[:, i] = bi_q, act_q, trans_q, kern_q
            sources.add(src)

        def cum(x):
            return np.concatenate((np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)), axis=-1)

        return LayerTable(kind=kind, micro_batch=b, sequence_parallel=sp, forward=fwd, tp_forward=tpf,
                          backward_input=bi, backward_weight=bw, params=params, zero_params=zparams,
                          expert_params=eparams, cum_zero_params=cum(zparams), cum_expert_params=cum(eparams),
                          cast_params=cast, activation=act,
                          transient=trans, output_bytes=out, cum_forward=cum(fwd), cum_tp_forward=cum(tpf),
                          cum_backward_input=cum(bi), cum_backward_weight=cum(bw), cum_params=cum(params),
                          cum_cast_params=cum(cast), cum_activation=cum(act), cum_kernels=cum(kern),
                          cum_zero3_collectives=cum(z3),
                          max_params=_range_max(gathers),
                          max_transient=np.stack([_range_max(trans[q]) for q in range(3)]),
                          sources=frozenset(sources))

    # ------------------------------------------------------------ states
    def state_bytes(self, params: float | np.ndarray, max_params: float | np.ndarray, dp: int, zero: int,
                    sharded: float | np.ndarray | None = None):
        """Weights + gradients + optimizer states (+ the ZeRO-3 working set) per GPU, as
        ``costmodel.memory.model_state_bytes`` counts them under the tables' stack.
        ``sharded``: the parameters ZeRO divides by dp (``zero_params``; default ``params``,
        exact without expert parallelism, a lower bound with it)."""
        stack = self.stack
        if sharded is not None and zero >= 1:
            total = sum((sharded / dp if zero >= stage else params) * b for b, stage in stack.state_parts)
        else:
            total = params * stack.state_bytes_per_param(dp, zero)
        if zero >= 3 and dp > 1:
            gathered_w, gathered_g = zero3_working_set(max_params, stack)
            total = total + gathered_w + gathered_g
        return total

    def cast_bytes(self, cast_params: float | np.ndarray, dp: int, zero: int):
        """Half-precision casts of fp32 weights held through forward and backward
        (``ModelStateBytes.casts``); part of the dynamic working set."""
        if zero >= 3 and dp > 1:
            return 0.0 * cast_params
        return cast_params * self.stack.weight_cast_bytes_per_param

    def step_bytes(self, params: float | np.ndarray, dp: int, zero: int, sharded=None):
        """Temporaries per GPU after the backward (``costmodel.memory.after_backward_bytes``)."""
        return after_backward_bytes(params, params if sharded is None else sharded, dp, zero, self.stack)

    def capacity(self, pool: int) -> float:
        """Memory the search lets a GPU of ``pool`` fill: its capacity less the options'
        margin while plans with room are sought (``margin`` is 0 when the search falls
        back to tight plans)."""
        return self.cluster.groups[pool].device.memory_bytes * (1.0 - self.margin)

    def accelerator(self, pool: int) -> bool:
        return is_accelerator(self.cluster.groups[pool].device.name)

    def fixed_bytes(self, pool: int, group: DeviceGroup | None = None, pp: int = 1, ep: int = 1) -> float:
        """Bytes outside states and the dynamic working set on a GPU of ``pool``: CUDA
        context, NCCL buffers per communicator and the stack's data-parallel buckets (as
        ``costmodel.memory.group_memory``). Without a group: the context alone, a lower
        bound for any group."""
        if not self.accelerator(pool):
            return min(self._extra_bytes, 0.0) if group is None else self._extra_bytes
        stack = self.stack
        if group is None:
            return stack.cuda_context_bytes + min(self._extra_bytes, 0.0)
        shards = group.dp * group.cp   # gradients are reduced over data x context ranks
        comms = communicators(group.tp, shards, group.cp, pp, ep)
        return (stack.cuda_context_bytes + comms * stack.nccl_bytes_per_group
                + (stack.dp_buffer_bytes if shards > 1 else 0.0) + self._extra_bytes)

    # -------------------------------------------------------------- comm
    def shape(self, ranks) -> tuple:
        """What ``collective_time`` reads off a group of ranks besides the message size: how
        many ranks, over how many nodes, the fewest ranks on one node, and the node groups
        (their links and devices). Groups of one shape cost the same (a test checks it), so
        the cost model is asked once per shape, not once per group."""
        n = len(ranks)
        first, last = ranks[0], ranks[-1]
        step = ranks[1] - first if n > 1 else 1
        pool = self._pool_of[first]
        # Data-parallel groups are evenly spaced ranks of one node group: their shape
        # depends only on where they start within a node, the spacing and the count.
        even = n > 1 and step > 0 and last == first + step * (n - 1) and self._pool_of[last] == pool \
            and tuple(ranks) == tuple(range(first, last + 1, step))
        if even:
            gpn = self.cluster.groups[pool].gpus_per_node
            key = (pool, (first - self._pool_first[pool]) % gpn, step, n)
            hit = self._shapes.get(key)
            if hit is not None:
                return hit
        idx = np.asarray(ranks)
        _, per_node = np.unique(self._node_of[idx], return_counts=True)
        out = (n, len(per_node), int(per_node.min()), frozenset(np.unique(self._pool_of[idx]).tolist()))
        if even:
            self._shapes[key] = out
        return out

    def affine(self, ranks: tuple[int, ...], kind: str) -> tuple[float, float]:
        """(alpha, beta) with collective_time(ranks, x, kind) == alpha + beta * x for x > 0
        (the alpha-beta model is affine in the message size)."""
        key = (self.shape(ranks), kind)
        hit = self._affine.get(key)
        if hit is None:
            # Probe at sizes where neither term swamps the other (cancellation).
            t1 = collective_time(self.cluster, ranks, PROBE, kind)
            t2 = collective_time(self.cluster, ranks, 2 * PROBE, kind)
            beta = (t2 - t1) / PROBE
            hit = self._affine[key] = (t1 - beta * PROBE, beta)
        return hit

    def dp_affines(self, group: DeviceGroup, kind: str) -> tuple[tuple[float, float], ...]:
        """The affine costs of a collective over each data-parallel group of ``group``."""
        # Keyed by identity: hashing a group hashes all its ranks, and the search asks
        # about the same few group objects over and over (the group is kept alive here).
        key = (id(group), kind)
        hit = self._dp_affines.get(key)
        if hit is not None and hit[0] is group:
            return hit[1]
        # Gradients and ZeRO states are reduced over data x context ranks.
        if group.dp * group.cp <= 1:
            out = ()
        else:
            # Identical groups (the usual case) need one evaluation, not tp of them.
            out = tuple(sorted({self.affine(tuple(r), kind) for r in group.dp_cp_groups()}))
        self._dp_affines[key] = (group, out)
        return out

    def dp_collective(self, group: DeviceGroup, nbytes, kind: str):
        """Slowest data-parallel group's collective time (``nbytes`` may be an array)."""
        aff = self.dp_affines(group, kind)
        if not aff:
            return 0.0 * nbytes
        out = None
        for a, b in aff:
            t = np.where(nbytes > 0, a + b * nbytes, 0.0) if isinstance(nbytes, np.ndarray) else \
                (a + b * nbytes if nbytes > 0 else 0.0)
            out = t if out is None else np.maximum(out, t)
        return out

    def tied_grad(self, sk, zero: int) -> float:
        """Seconds the first and the last pipeline group each spend summing a tied embedding's
        gradient: exactly ``costmodel.estimate.tied_grad_time`` (0 without a pipeline)."""
        first, last = sk.groups[0], sk.groups[-1]
        key = (id(first), id(last), zero)
        hit = self._tied.get(key)
        if hit is None or hit[0] is not first or hit[1] is not last:
            hit = self._tied[key] = (first, last, tied_grad_time(self.model, self.cluster, first, last, zero,
                                                                 self.stack))
        return hit[2]

    def expert_dp_collective(self, group: DeviceGroup, ep: int, nbytes: float, kind: str) -> float:
        """Slowest collective over the ranks of ``group`` that hold the same experts."""
        if nbytes <= 0 or group.dp * group.cp <= ep:
            return 0.0
        return max(a + b * nbytes for a, b in {self.affine(tuple(r), kind) for r in group.expert_dp_groups(ep)})

    def p2p(self, src: DeviceGroup, dst: DeviceGroup, nbytes: float, sequence_parallel: bool = False) -> float:
        """One micro-batch's activation from ``src`` to ``dst``: exactly the cost model's
        transfer, the slowest of the replica-to-replica pair transfers of what each
        tensor-parallel rank sends (``Stack.pipeline_send_shape``), then the receivers'
        all-gather where the stack scatters and gathers. A pair's time depends only on
        (share, same node, node groups), so each such class is timed once with
        ``p2p_time`` on one representative pair."""
        # (Keyed by the groups' identities, kept alive with the entry: hashing a group
        # hashes all its ranks.)
        key = (id(src), id(dst), nbytes, sequence_parallel)
        hit = self._p2p.get(key)
        if hit is None:
            width = min(src.tp, dst.tp)
            split, gather = self.stack.pipeline_send_shape(width, sequence_parallel)
            share = nbytes / width if split else nbytes
            hit = max((p2p_time(self.cluster, [(a,)], [(b,)], share) for a, b in self._pair_classes(src, dst)),
                      default=0.0) if nbytes > 0 else 0.0
            if gather and nbytes > 0:
                hit += max(collective_time(self.cluster, grp, nbytes, "all_gather") for grp in dst.tp_groups())
            self._p2p[key] = (hit, src, dst)
            return hit
        return hit[0]

    def _pair_classes(self, src: DeviceGroup, dst: DeviceGroup) -> list[tuple[int, int]]:
        """One representative (src rank, dst rank) pair per class (same node, node groups)
        of a transfer from ``src`` to ``dst``, the first in order: replica i of src sends
        to replica i of dst, tensor shard t to shard t, as many as both have (all pairs at
        once: groups may hold thousands of ranks)."""
        k = min(src.dp * src.cp, dst.dp * dst.cp)
        width = min(src.tp, dst.tp)
        a = np.asarray(src.ranks).reshape(-1, src.tp)[:k, :width].ravel()
        b = np.asarray(dst.ranks).reshape(-1, dst.tp)[:k, :width].ravel()
        moving = a != b
        a, b = a[moving], b[moving]
        pools = len(self.cluster.groups)
        code = ((self._node_of[a] == self._node_of[b]) * pools + self._pool_of[a]) * pools + self._pool_of[b]
        _, first = np.unique(code, return_index=True)
        return [(int(a[i]), int(b[i])) for i in np.sort(first).tolist()]

    def p2p_classes(self, src: DeviceGroup, dst: DeviceGroup) -> tuple[tuple[float, float, int], ...]:
        """(latency, seconds per byte, width) of every distinct pair class of a transfer
        from ``src`` to ``dst``: p2p_time(n) = max over classes of latency + n / width *
        seconds per byte (read off p2p_time itself at two sizes)."""
        key = (id(src), id(dst))
        hit = self._p2p_classes.get(key)
        if hit is not None:
            return hit[0]
        width = min(src.tp, dst.tp)
        out = []
        for a, b in self._pair_classes(src, dst):
            t1 = p2p_time(self.cluster, [(a,)], [(b,)], PROBE)
            t2 = p2p_time(self.cluster, [(a,)], [(b,)], 2 * PROBE)
            rate = (t2 - t1) / PROBE
            out.append((t1 - rate * PROBE, rate, width))
        hit = tuple(out)
        self._p2p_classes[key] = (hit, src, dst)   # (the groups kept alive: ids stay theirs)
        return hit

    def optimizer_rate(self, pool: int) -> float:
        """Seconds of Adam step per parameter on a device of this pool."""
        hit = self._opt_rate.get(pool)
        if hit is None:
            dev = self.cluster.groups[pool].device
            hit = self._opt_rate[pool] = (self.stack.optimizer_traffic_bytes_per_param
                                          / achieved_memory_bandwidth(dev))
        return hit

    def zero3_copy_rates(self, pool: int) -> tuple[float, float]:
        """Seconds per parameter of ZeRO-3's copies on a device of this pool: those on the
        compute stream and those beside the collectives (``Stack.zero3_copy_bytes_per_param``,
        ``Stack.zero3_stream_copy_bytes_per_param``). Kept per pool: every ZeRO-3 stage the
        search times asks."""
        hit = self._zero3_rates.get(pool)
        if hit is None:
            bandwidth = achieved_memory_bandwidth(self.cluster.groups[pool].device)
            hit = self._zero3_rates[pool] = (self.stack.zero3_copy_bytes_per_param / bandwidth,
                                             self.stack.zero3_stream_copy_bytes_per_param / bandwidth)
        return hit

    def step_overhead(self, pool: int) -> float:
        """A CPU calibration's fixed seconds per step on a device of this pool (an
        accelerator's host overhead runs beside it: ``host_costs``)."""
        cal = self.options.calibration
        name = self.cluster.groups[pool].device.name
        dev = cal.device(name) if cal is not None and not is_accelerator(name) else None
        return (dev.step_overhead_s or 0.0) if dev is not None else 0.0

    def host_costs(self, pool: int) -> HostCosts:
        """The host's costs per step on a device of this pool (``costmodel.host``)."""
        hit = self._host_costs.get(pool)
        if hit is None:
            hit = self._host_costs[pool] = host_costs(self.cluster.groups[pool].device.name, self.stack,
                                                      self.options.calibration)
        return hit

    def memory_total(self, states, activations, transient, step=0.0, fixed=0.0):
        """Per-GPU bytes the cost model reports for these components
        (``costmodel.memory.group_memory``'s total)."""
        return fixed + states + self.dynamic_factor * np.maximum(activations + transient, step)


__all__ = ["Kind", "LayerTable", "Tables", "RECOMPUTES", "GiB"]
