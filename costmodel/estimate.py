"""``estimate(model, cluster, plan)``: iteration time, throughput and per-rank memory of a
plan on a training stack, by lowering it to its schedule program and simulating that
program with per-stage costs from the compute, communication and memory models, with an
interval from the residuals the model was checked on (or a calibration's)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoplan.catalog import is_accelerator
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.models.spec import ModelSpec
from autoplan.plan import DeviceGroup, Plan
from autoplan.schedule import build_program
from autoplan.stacks import Stack, get_stack
from autoplan.units import DTYPE_BYTES, GiB
from costmodel import experts
from costmodel.calibration import Calibration
from costmodel.comm import (collective_latency, collective_time, p2p_time, zero3_collectives, zero3_gather_passes,
                             zero3_rank_overhead)
from costmodel.compute import ALIGNMENT_BYTES, ProfileSource, hidden_tp_forward, layer_timing, unaligned_rows
from costmodel.context import context_shard, stage_exchange
from costmodel.efficiency import achieved_memory_bandwidth, default_efficiency
from costmodel.host import host_costs, layer_host_kernels, pipeline_host_time, with_host
from costmodel.memory import (DEFAULT_MEMORY_MARGIN, GroupMemory, activation_bytes, communicators, group_memory,
                              model_state_bytes, optimizer_step_bytes, transient_bytes)
from costmodel.redistribute import layout_comm
from costmodel.simulate import Event, StageCosts, simulate
from costmodel.uncertainty import error_bands

@dataclass(frozen=True)
class EstimateOptions:
    """What besides the model, cluster and plan decides a plan's cost: the software it runs
    on, measured inputs, and how cautious to be about memory."""

    stack: Stack | str | None = None
    """The training stack (name, path to a stack .json, or a Stack); None = 'autoplan'."""
    calibration: Calibration | None = None
    """Parameters fitted from measured runs of this stack (None: defaults only)."""
    profiles: ProfileSource | None = None
    """Measured layer profiles; None = catalog roofline only."""
    overlap_grad_reduce: bool | None = None
    """Data-parallel gradient reduction overlaps the backward; None = the stack's behaviour."""
    blocking_p2p: bool | None = None
    """Pipeline sends hold the sender until done; None = the stack's behaviour."""
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    """Share of device memory a plan must leave free not to be called 'tight'."""
    expert_load: float | None = None
    """Mixture of experts: the busiest expert-parallel rank's routed tokens over the balanced
    share, as measured or stated (1.0 = perfectly balanced); None = the model's capacity
    factor, or for dropless routing the expected maximum under uniform routing
    (see ``costmodel.experts.expert_load``)."""

    def __post_init__(self):
        # Resolved once, here: everything downstream reads plain values.
        stack = get_stack(self.stack)
        object.__setattr__(self, "stack", stack)
        if self.overlap_grad_reduce is None:
            object.__setattr__(self, "overlap_grad_reduce", stack.overlap_grad_reduce)
        if self.blocking_p2p is None:
            object.__setattr__(self, "blocking_p2p", stack.blocking_p2p)
        if self.calibration is not None and not isinstance(self.calibration, Calibration):
            raise ConfigError("calibration", f"must be a Calibration, got {type(self.calibration).__name__}",
                              "load one with costmodel.calibration.Calibration.load(path)")
        m = self.memory_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 0.5:
            raise ConfigError("memory_margin", f"must be a share of memory in [0, 0.5), got {m!r}")
        load = self.expert_load
        if load is not None and (isinstance(load, bool) or not isinstance(load, (int, float)) or not load >= 1):
            raise ConfigError("expert_load", f"must be a number >= 1 (the busiest rank over the balanced "
                              f"share) or None, got {load!r}")


MEMORY_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "transient", "buffers", "nccl",
                     "context", "fragmentation")
"""GroupMemory's components, in report order."""


@dataclass
class Estimate:
    """What a plan costs. Times in seconds, memory in bytes."""

    plan: Plan
    iteration_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_tflops_per_gpu: float
    """Model FLOPs (no recomputation) per second per GPU, in TFLOP/s."""
    hardware_tflops_per_gpu: float
    """FLOPs actually executed, recomputation included, in TFLOP/s per GPU."""
    mfu: float
    """Model FLOPs utilization: model FLOP/s over the GPUs' summed dense peak."""
    hfu: float
    peak_memory_bytes: float
    """Largest per-rank peak memory."""
    memory_by_rank: dict[int, float]
    memory_by_group: list[GroupMemory]
    device_memory_by_rank: dict[int, float]
    fits: bool
    """Every rank's peak is within its device's memory."""
    breakdown: dict[str, float]
    """Seconds on the critical rank: compute, tp_communication, ep_communication (expert
    dispatch and combine), bubble, dp_communication, optimizer (the step and what follows the
    pipeline with it: the ZeRO-1/2 parameter all-gather, a tied embedding's gradient sum
    between the first and last stage); and 'host' where the step waits on a host slower than
    its device (``costmodel.host``). They add up to the iteration time."""
    bubble_fraction: float
    timeline: list[Event] = field(repr=False, default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    """Per device type: 'measured' (profile), 'calibrated' or 'roofline' (catalog defaults)."""
    stage_costs: list[StageCosts] = field(repr=False, default_factory=list)
    stack: str = "autoplan"
    """The training stack the estimate assumes."""
    tight: bool = False
    """Fits, but some rank has less than the memory margin left: the prediction's own error
    could tip it over."""
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    """The margin 'tight' was judged by (share of device memory)."""
    time_interval_s: tuple[float, float] = (0.0, 0.0)
    """Where the iteration time lies for ~80% of checked plans (see costmodel.uncertainty)."""
    memory_interval_bytes: tuple[float, float] = (0.0, 0.0)
    """The same for the peak memory."""
    inputs: dict[str, str] = field(default_factory=dict)
    """Which inputs were measured, calibrated or default, in words."""

    @property
    def headroom_bytes(self) -> float:
        """Smallest free memory over the ranks (negative: the most any rank lacks)."""
        return min(self.device_memory_by_rank[r] - m for r, m in self.memory_by_rank.items())

    @property
    def status(self) -> str:
        """'fits', 'tight' or 'out of memory'."""
        return "out of memory" if not self.fits else "tight" if self.tight else "fits"

    @property
    def allocated_peak_bytes(self) -> float:
        """Largest peak of live tensors over the ranks (what CUDA's max_memory_allocated
        measures): the total without the CUDA context, NCCL and fragmentation."""
        return max(m.allocated for m in self.memory_by_group)

    def summary(self) -> str:
        b = self.breakdown
        parts = ", ".join(f"{k} {v:.3g}s" for k, v in b.items())
        lo, hi = self.time_interval_s
        mlo, mhi = self.memory_interval_bytes
        band = f" (80% range {lo:.4g}-{hi:.4g} s)" if hi > lo else ""
        mband = f" (80% range {mlo / GiB:.1f}-{mhi / GiB:.1f})" if mhi > mlo else ""
        mem = f"{self.peak_memory_bytes / GiB:.1f} GiB{mband} peak/GPU"
        state = {"fits": "fits", "tight": f"TIGHT: less than {self.memory_margin:.0%} of memory left",
                 "out of memory": "DOES NOT FIT"}[self.status]
        return (f"{self.plan.describe()}\n  iteration {self.iteration_time_s:.4g} s{band}, "
                f"{self.tokens_per_s:,.0f} tokens/s, {self.model_tflops_per_gpu:.1f} TFLOP/s/GPU, "
                f"MFU {self.mfu:.1%}, {mem} ({state}), stack {self.stack}\n  {parts}")

    def to_dict(self) -> dict:
        return {
            "iteration_time_s": self.iteration_time_s, "iteration_time_interval_s": list(self.time_interval_s),
            "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
            "peak_memory_GiB": self.peak_memory_bytes / GiB,
            "peak_memory_interval_GiB": [x / GiB for x in self.memory_interval_bytes],
            "headroom_GiB": self.headroom_bytes / GiB, "fits": self.fits, "tight": self.tight,
            "status": self.status, "stack": self.stack,
            "bubble_fraction": self.bubble_fraction, "breakdown_s": dict(self.breakdown),
            "memory_GiB_by_pipeline_rank": [{**{k: getattr(m, k) / GiB for k in MEMORY_COMPONENTS},
                                             "total": m.total / GiB} for m in self.memory_by_group],
            "sources": dict(self.sources), "inputs": dict(self.inputs),
        }


def _alignment_note(model: ModelSpec, cluster: Cluster, plan: Plan, stack: Stack, sources: dict[str, str]) -> str:
    """What the estimate's inputs say of GEMMs whose rows are not 16-byte aligned on an
    accelerator timed by the roofline (a vocabulary or head size that is not a multiple of 8
    in a 2-byte type): the fallback rate they are charged at, or that the device has none
    measured and their time is optimistic; empty when every row is aligned."""
    found: dict[str, set] = {}
    for g, group in enumerate(plan.groups):
        devices = [d for d in _group_devices(cluster, group.ranks)
                   if is_accelerator(d.name) and sources.get(d.name) != "measured"]
        if not devices:
            continue
        for s in plan.stages_of_group(g):
            for layer in model.layers[plan.stages[s].start:plan.stages[s].end]:
                rows = unaligned_rows(layer, group.tp, plan.dtype, stack.fp8_cast)
                if rows:
                    for d in devices:
                        found.setdefault(d.name, set()).add((layer.kind, rows))
    per_row = int(ALIGNMENT_BYTES / DTYPE_BYTES[plan.dtype])
    notes = []
    for name, where in sorted(found.items()):
        parts = " and ".join(f"the {kind}'s GEMMs read rows of {', '.join(f'{r:g}' for r in rows)} elements"
                             for kind, rows in sorted(where))
        rate = default_efficiency(name).unaligned_matmul
        how = (f"charged at {rate:g} of the aligned rate (measured)" if rate < 1 else
               "charged as aligned, optimistic, as no fallback rate is measured for this device")
        notes.append(f"on {name} {parts}, not 16-byte aligned (a multiple of {per_row} would be): {how}")
    # (No semicolons: the estimate's inputs print as one '; '-separated line.)
    return ", and ".join(notes)


def _group_devices(cluster: Cluster, ranks) -> list:
    if len(cluster.groups) == 1:   # one device type: no need to visit every rank
        return [cluster.groups[0].device]
    seen = {}
    for r in ranks:
        d = cluster.slots[r].device
        seen.setdefault(d.name, d)
    return list(seen.values())


def _worst(cluster: Cluster, groups, nbytes: float, kind: str) -> float:
    return max((collective_time(cluster, grp, nbytes, kind) for grp in groups), default=0.0)


def device_timing_inputs(device, options: EstimateOptions):
    """(efficiency override, compute scale, source label) of a device under the options'
    calibration; (None, 1.0, None) without one. A calibrated cost per kernel is the
    device's own on a CPU; on an accelerator it is the host's (``costmodel.host``)."""
    cal = options.calibration.device(device.name) if options.calibration is not None else None
    if cal is None:
        return None, 1.0, None
    eff = default_efficiency(device.name)
    if cal.launch_s is not None and not is_accelerator(device.name):
        eff = replace(eff, launch_s=cal.launch_s)
    return eff, cal.compute_scale, "calibrated"


def plan_expert_load(model: ModelSpec, plan: Plan, options: EstimateOptions) -> float:
    """The busiest expert rank's load over the balanced share for this plan (1 for dense models)."""
    spec = next((l.experts for l in model.layers if l.experts is not None), None)
    return experts.expert_load(spec, plan.ep, plan.micro_batch * (model.tokens_per_sample or model.seq_len) / plan.cp,
                               options.expert_load)


def _pipeline_groups(plan: Plan) -> list[tuple[int, ...]]:
    """Per data-parallel replica, every tensor-parallel rank of every pipeline group."""
    per_group = [g.tp_groups() for g in plan.groups]
    return [sum((tps[d] for tps in per_group), ()) for d in range(plan.dp)]


def stage_costs(model: ModelSpec, cluster: Cluster, plan: Plan, options: EstimateOptions,
                sources: dict[str, str] | None = None) -> list[StageCosts]:
    """Per-micro-batch costs of every stage of the plan."""
    b, sp, dtype, cp = plan.micro_batch, plan.sequence_parallel, plan.dtype, plan.cp
    stack = options.stack
    ep, load = plan.ep, plan_expert_load(model, plan, options)
    zero = stack.realized_zero(plan.zero, plan.pp)
    out = []
    n = len(plan.stages)
    # Collective and transfer times depend only on the ranks and the bytes: the units of a
    # stage (and the chunks of a group) repeat them, so each is computed once per plan.
    memo: dict = {}

    def worst(groups, nbytes: float, kind: str) -> float:
        key = (id(groups), nbytes, kind)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = _worst(cluster, groups, nbytes, kind)
        return hit

    def p2p(src: DeviceGroup, dst: DeviceGroup, nbytes: float) -> float:
        key = (id(src), id(dst), nbytes, "p2p")
        hit = memo.get(key)
        if hit is None:
            split, gather = stack.pipeline_send_shape(min(src.tp, dst.tp), plan.sequence_parallel)
            hit = p2p_time(cluster, tp_groups_of[id(src)], tp_groups_of[id(dst)], nbytes, split)
            if gather:
                # The receivers put the tensor together again before they compute on it.
                hit += worst(tp_groups_of[id(dst)], nbytes, "all_gather")
            memo[key] = hit
        return hit

    tp_groups_of = {id(g): g.tp_groups() for g in plan.groups}
    dp_groups_of = {id(g): g.dp_cp_groups() for g in plan.groups}
    pipeline = None
    for s_idx, stage in enumerate(plan.stages):
        group = plan.groups[stage.group]
        # Context ranks hold the same weights as data replicas: gradients are reduced, and
        # ZeRO shards, over both. Each rank does 1/cp of every layer's token-wise work.
        tp, dp = group.tp, group.dp * group.cp
        traffic = stack.traffic_for(*_degrees(plan, group))
        layers = [context_shard(l, cp) for l in model.layers[stage.start:stage.end]]
        tp_groups, dp_groups = tp_groups_of[id(group)], dp_groups_of[id(group)]
        fwd = bwd = bwd_i = bwd_w = 0.0
        # Per layer, the forward's wait on the host that its tensor-parallel collectives fill
        # (the least over the group's device types).
        host_wait = [float("inf")] * len(layers)
        # A group of mixed device types runs at the pace of its slowest member.
        for dev in _group_devices(cluster, group.ranks):
            eff, scale, label = device_timing_inputs(dev, options)
            f = bi = bw = 0.0
            for j, layer in enumerate(layers):
                t = layer_timing(dev, layer, b, tp, sp, dtype, options.profiles, stack.attention, eff, ep, load,
                                 stack.forward_host_s_per_kernel, stack.fp8_cast, traffic)
                host_wait[j] = min(host_wait[j], t.forward_host_wait * scale)
                if sources is not None:
                    src = label if label and t.source == "roofline" else t.source
                    prev = sources.get(dev.name)
                    sources[dev.name] = src if prev in (None, src) else "mixed"
                rec = {"none": 0.0, "selective": t.recompute_selective,
                       "full": stack.full_recompute_time(t)}[stage.recompute]
                f += t.forward
                bi += t.backward_input + rec
                bw += t.backward_weight
            fwd, bwd_i, bwd_w = max(fwd, f * scale), max(bwd_i, bi * scale), max(bwd_w, bw * scale)
        bwd = bwd_i + bwd_w
        # Tensor-parallel collectives sit on the critical path of every layer.
        tp_f = tp_b = 0.0
        if tp > 1:
            for j, layer in enumerate(layers):
                # A block's row-parallel outputs are all-reduced; the head's vocabulary-parallel
                # matmul all-reduces its input gradient (the previous unit's output size).
                size = (layer.output_bytes if layer.kind != "head"
                        else context_shard(model.layers[max(stage.start + j - 1, 0)], cp).output_bytes)
                comm = 0.0
                if layer.tp_allreduces_fwd:
                    comm += layer.tp_allreduces_fwd * worst(tp_groups, b * size, "all_reduce")
                if layer.kind == "head" and layer.tp_allreduces_fwd and not stack.vocab_parallel_loss:
                    # The loss needs the full vocabulary on every rank: gather the logits (a head
                    # under operator layouts says itself where its logits are).
                    comm += worst(tp_groups, b * layer.output_bytes, "all_gather")
                # The backward is not held to the host: its collectives add in full.
                tp_f += hidden_tp_forward(comm, host_wait[j])
                tp_b += comm
            # The collectives of units under operator layouts (forward and backward apart).
            if pipeline is None:
                pipeline = _pipeline_groups(plan)   # the same for every stage
            for layer in layers:
                f, b_ = layout_comm(cluster, tp_groups, layer, b, pipeline)
                tp_f, tp_b = tp_f + f, tp_b + b_
        # A fully recomputed stage repeats its forward collectives in the backward.
        tp_b += tp_f if stage.recompute == "full" else 0.0
        # Expert parallelism: every expert unit dispatches and combines its routed tokens by
        # all-to-all in forward, and mirrors both in backward (again when recomputed).
        ep_f = 0.0
        if ep > 1:
            ep_groups = group.ep_groups(ep)
            ep_f = sum(2 * experts.dispatch_time(cluster, ep_groups, l, b, load) for l in layers)
        ep_b = ep_f * (2 if stage.recompute == "full" else 1)
        fwd += tp_f + ep_f
        bwd_i += tp_b + ep_b
        bwd += tp_b + ep_b
        # The context-parallel exchange around attention is on the critical path too, and is
        # repeated when the attention is recomputed (selective or full).
        cp_f, cp_b, _ = stage_exchange(cluster, group.cp_groups() if cp > 1 else [], plan.cp_comm, model, layers,
                                       _group_devices(cluster, group.ranks), b, tp, dtype, DTYPE_BYTES[dtype],
                                       stack.overlap_cp_exchange, stack.attention)
        cp_b += cp_f if stage.recompute != "none" else 0.0
        fwd += cp_f
        bwd_i += cp_b
        bwd += cp_b
        params = sum(l.params.at(tp) for l in layers)
        # Expert gradients are reduced over the ranks holding the same experts, the rest over
        # the data-parallel group (with ep = 1 both are the data-parallel group: one reduction).
        expert_local = experts.expert_params(layers, tp) / ep if ep > 1 else 0.0
        dense = params - experts.expert_params(layers, tp) if ep > 1 else params
        edp_groups = group.expert_dp_groups(ep) if ep > 1 else []
        if zero >= 3 and dp > 1:
            # Parameters are gathered for the forward and again for the backward, and
            # gradients reduce-scattered, every micro-batch; where the stack overlaps them,
            # prefetching hides what the compute can cover.
            gather = experts.grad_reduce_time(cluster, dp_groups, edp_groups, dense * stack.gathered_weights_bytes_per_param,
                                              expert_local * stack.gathered_weights_bytes_per_param, "all_gather")
            scatter = experts.grad_reduce_time(cluster, dp_groups, edp_groups, dense * stack.grad_reduce_bytes_per_param,
                                               expert_local * stack.grad_reduce_bytes_per_param, "reduce_scatter")
            # Split into one collective per gather unit, each further one pays the latency
            # again, and every one the stack's own work per rank of the group.
            devices = _group_devices(cluster, group.ranks)
            gathers, scatters = zero3_collectives(layers, stack)
            per_rank = max(zero3_rank_overhead(stack, d) for d in devices) * max(len(r) for r in dp_groups)
            gather += (gathers - 1) * max(collective_latency(cluster, r, "all_gather") for r in dp_groups) \
                + gathers * per_rank
            scatter += (scatters - 1) * max(collective_latency(cluster, r, "reduce_scatter") for r in dp_groups) \
                + scatters * per_rank
            # The copies around the collectives: on the compute stream, and beside the
            # collectives on theirs.
            bandwidth = min(achieved_memory_bandwidth(d) for d in devices)
            copy = (dense + expert_local) * stack.zero3_copy_bytes_per_param / bandwidth
            beside = (dense + expert_local) * stack.zero3_stream_copy_bytes_per_param / bandwidth
            bwd_i += copy
            bwd += copy
            # The backward's gathers: its own, and a recomputed forward's where it needs one.
            gathers_bwd = (zero3_gather_passes(stack, stage.recompute) - 1) * gather
            if stack.overlap_zero3:
                fwd = max(fwd, gather)
                extra = max(0.0, gathers_bwd + scatter + beside - bwd)
            else:
                fwd += gather
                extra = gathers_bwd + scatter + beside
            bwd_i += extra
            bwd += extra
            reduce = 0.0
        elif dp > 1 and zero >= stack.reduce_every_micro_batch_from_zero:
            # Every micro-batch's gradients are reduce-scattered as its backward produces
            # them, overlapped with the rest of it where the stack overlaps.
            scatter = experts.grad_reduce_time(cluster, dp_groups, edp_groups, dense * stack.grad_reduce_bytes_per_param,
                                               expert_local * stack.grad_reduce_bytes_per_param, "reduce_scatter")
            extra = max(0.0, scatter - bwd) if options.overlap_grad_reduce else scatter
            bwd_i += extra
            bwd += extra
            reduce = 0.0
        elif dp > 1:
            kind = stack.grad_reduce_kind(zero)
            reduce = experts.grad_reduce_time(cluster, dp_groups, edp_groups, dense * stack.grad_reduce_bytes_per_param,
                                              expert_local * stack.grad_reduce_bytes_per_param, kind)
        else:
            reduce = 0.0
        # The whole activation per replica, with or without sequence parallelism: p2p says
        # what each tensor-parallel rank sends of it (Stack.pipeline_send_shape).
        out_bytes = b * layers[-1].output_bytes
        send_f = 0.0
        if s_idx < n - 1:
            nxt = plan.groups[plan.stages[s_idx + 1].group]
            if nxt is not group:
                send_f = p2p(group, nxt, out_bytes)
        send_b = 0.0
        if s_idx > 0:
            prv = plan.groups[plan.stages[s_idx - 1].group]
            in_bytes = b * context_shard(model.layers[stage.start - 1], cp).output_bytes
            if prv is not group:
                send_b = p2p(group, prv, in_bytes)
        act = activation_bytes(layers, stage.recompute, b, tp, sp, stack, dtype, load)
        out.append(StageCosts(forward=fwd, backward=bwd, backward_input=bwd_i, backward_weight=bwd_w,
                              send_forward=send_f, send_backward=send_b, activation_bytes=act,
                              grad_reduce=reduce, layers=len(layers), tp_comm_forward=tp_f,
                              tp_comm_backward=tp_b, ep_comm_forward=ep_f, ep_comm_backward=ep_b,
                              cp_comm_forward=cp_f, cp_comm_backward=cp_b))
    return out


def _optimizer_time(model: ModelSpec, cluster: Cluster, plan: Plan, g: int, stack: Stack,
                    calibration: Calibration | None = None) -> tuple[float, float]:
    """(Adam step, plus a CPU calibration's overhead per step and, on the first and last
    stage's groups, the tied embedding's gradient sum (:func:`tied_grad_time`); exposed
    post-step parameter all-gather) for one pipeline group. (An accelerator's host overhead
    runs beside its device: ``host_time``.)"""
    group = plan.groups[g]
    zero = stack.realized_zero(plan.zero, plan.pp)
    layers = [l for s in plan.stages if s.group == g for l in model.layers[s.start:s.end]]
    params, sharded = experts.state_params(layers, group.tp, plan.ep)
    shard = sharded / (group.dp * group.cp) if zero >= 1 else params
    step = max(shard * stack.optimizer_traffic_bytes_per_param / achieved_memory_bandwidth(d)
               for d in _group_devices(cluster, group.ranks))
    if calibration is not None:
        step += max((c.step_overhead_s or 0.0 for d in _group_devices(cluster, group.ranks)
                     if (c := calibration.device(d.name)) is not None and not is_accelerator(d.name)),
                    default=0.0)
    ends = (plan.stages[0].group, plan.stages[-1].group)
    if g in ends:
        step += tied_grad_time(model, cluster, plan.groups[ends[0]], plan.groups[ends[1]], zero, stack)
    gather = 0.0
    if zero in (1, 2) and group.dp * group.cp > 1 and not stack.overlap_param_gather:
        # Overlapped, the gather of updated parameters runs under the next forward.
        gather = _worst(cluster, group.dp_cp_groups(), params * DTYPE_BYTES[plan.dtype], "all_gather")
    return step, gather


def tied_grad_time(model: ModelSpec, cluster: Cluster, first: DeviceGroup, last: DeviceGroup, zero: int,
                   stack: Stack) -> float:
    """Seconds the pipeline groups of the first and the last stage each spend summing a tied
    embedding's gradient with the head's copy of it (``ModelSpec.shared_params``) when they
    differ: an all-reduce between the two ranks at the same (replica, sequence shard, tensor
    shard) position, after the backward and before the optimizer step (Megatron-LM's
    embedding group, DeepSpeed's tied-module reduction, autoplan's runtime). Each rank's table
    is its tensor shard, and its data-parallel shard too where gradients are sharded by then
    (ZeRO-2/3; from ZeRO-1 on where the stack runs on FSDP, ``weights_sharded_from_zero``,
    whose backward has reduce-scattered them before the sum), in the dtype the stack keeps
    gradients in. ``zero``: the stage the plan runs at."""
    if not model.shared_params or first is last:
        return 0.0
    per_rank = model.shared_params / min(first.tp, last.tp)
    if zero >= min(2, stack.weights_sharded_from_zero):
        per_rank /= min(first.dp * first.cp, last.dp * last.cp)
    return _worst(cluster, list(zip(first.ranks, last.ranks)), per_rank * stack.gradient_bytes_per_param,
                  "all_reduce")


def group_degrees(group: DeviceGroup, zero: int, pp: int, ep: int, schedule: str, dtype: str) -> tuple:
    """(data x context shards, zero, pp, tp, ep, schedule, dtype) of a pipeline group: what
    ``Stack.traffic_for`` and ``Stack.computes_under_autocast`` decide by (the search asks
    with its skeletons and settings, the estimate with its plan)."""
    return group.dp * group.cp, zero, pp, group.tp, ep, schedule, dtype


def _degrees(plan: Plan, group: DeviceGroup) -> tuple:
    return group_degrees(group, plan.zero, plan.pp, plan.ep, plan.schedule, plan.dtype)


def host_time(model: ModelSpec, cluster: Cluster, plan: Plan, options: EstimateOptions) -> float:
    """Host seconds of a step along the pipeline (``costmodel.host.pipeline_host_time``):
    each rank issues its stages' kernels for every micro-batch of its replica; a group of
    mixed device types waits on its slowest host."""
    stack = options.stack
    per_micro_batch, per_step = [], []
    for g, group in enumerate(plan.groups):
        costs = [host_costs(d.name, stack, options.calibration) for d in _group_devices(cluster, group.ranks)]
        autocast = stack.computes_under_autocast(*_degrees(plan, group))
        kernels = sum(layer_host_kernels(l, plan.stages[s].recompute, stack, autocast)
                      for s in plan.stages_of_group(g) for l in model.layers[plan.stages[s].start:plan.stages[s].end])
        per_micro_batch.append(max(c.per_kernel_s for c in costs) * kernels)
        per_step.append(max(c.per_step_s for c in costs))
    return pipeline_host_time(per_micro_batch, per_step, plan.num_micro_batches)


def _transient(model: ModelSpec, cluster: Cluster, plan: Plan, s: int, stack: Stack, load: float = 1.0) -> float:
    """Peak temporary bytes of stage ``s`` (see costmodel.memory.transient_bytes), with the
    context-parallel exchange's buffers of the layer that holds them."""
    stage, group = plan.stages[s], plan.groups[plan.stages[s].group]
    devices = _group_devices(cluster, group.ranks)
    # Without context parallelism nothing is exchanged (and listing a large group's
    # singleton sequence groups per layer would dominate the estimate).
    cp_groups = group.cp_groups() if plan.cp > 1 else []
    worst = 0.0
    for layer in model.layers[stage.start:stage.end]:
        part = context_shard(layer, plan.cp)
        buffers = stage_exchange(cluster, cp_groups, plan.cp_comm, model, [part], devices,
                                 plan.micro_batch, group.tp, plan.dtype, DTYPE_BYTES[plan.dtype])[2]
        worst = max(worst, transient_bytes([part], stage.recompute, plan.micro_batch, group.tp,
                                           plan.sequence_parallel, stack, plan.dtype, plan.ep, load) + buffers)
    return worst


def estimate(model: ModelSpec, cluster: Cluster, plan: Plan, options: EstimateOptions | None = None,
             **kwargs) -> Estimate:
    """Simulate one training iteration of ``plan``. Keyword arguments override
    :class:`EstimateOptions` fields (e.g. ``stack="megatron-core"``, ``profiles=store``)."""
    options = options or EstimateOptions()
    if kwargs:
        unknown = set(kwargs) - set(EstimateOptions.__dataclass_fields__)
        if unknown:
            raise ConfigError(sorted(unknown)[0], "is not an estimate option",
                              f"known: {', '.join(EstimateOptions.__dataclass_fields__)}")
        base = {k: v for k, v in options.__dict__.items()
                if k not in ("overlap_grad_reduce", "blocking_p2p") or k in kwargs}
        options = EstimateOptions(**{**base, **kwargs})
    stack = options.stack
    plan.validate(model, cluster)
    if options.calibration is not None:
        options.calibration.check([cluster.slots[r].device.name for g in plan.groups for r in g.ranks], stack.name)
    program = build_program(plan)
    sources: dict[str, str] = {}
    costs = stage_costs(model, cluster, plan, options, sources)
    opt = [_optimizer_time(model, cluster, plan, g, stack, options.calibration) for g in range(plan.pp)]
    sim = simulate(program, costs, [o[0] for o in opt], options.overlap_grad_reduce, [o[1] for o in opt],
                   blocking_p2p=options.blocking_p2p)

    # Memory per group.
    load = plan_expert_load(model, plan, options)
    zero = stack.realized_zero(plan.zero, plan.pp)
    act_scale = options.calibration.activation_scale if options.calibration else 1.0
    extra = options.calibration.memory_overhead_bytes if options.calibration else 0.0
    memory_by_group, memory_by_rank, device_mem = [], {}, {}
    for g, group in enumerate(plan.groups):
        stage_ids = plan.stages_of_group(g)
        stage_layers = [model.layers[plan.stages[s].start:plan.stages[s].end] for s in stage_ids]
        layers = [l for ls in stage_layers for l in ls]
        shards = group.dp * group.cp   # weights are sharded over data and context ranks
        states = model_state_bytes(layers, group.tp, shards, zero, stack, plan.ep,
                                   stack.casts_all_weights(*_degrees(plan, group)))
        transient = max(_transient(model, cluster, plan, s, stack, load) for s in stage_ids)
        accelerator = any(is_accelerator(d.name) for d in _group_devices(cluster, group.ranks))
        mem = group_memory(states, sim.peak_activation_bytes[g] * act_scale, transient * act_scale,
                           optimizer_step_bytes(layers, group.tp, shards, zero, stack, plan.ep),
                           communicators(group.tp, shards, group.cp, plan.pp, plan.ep), shards, stack,
                           accelerator)
        mem.buffers += extra
        memory_by_group.append(mem)
        for r in group.ranks:
            memory_by_rank[r] = mem.total
            device_mem[r] = cluster.slots[r].device.memory_bytes
    fits = all(memory_by_rank[r] <= device_mem[r] for r in memory_by_rank)
    tight = fits and any(memory_by_rank[r] > device_mem[r] * (1 - options.memory_margin) for r in memory_by_rank)

    # Throughput.
    device_T = sim.iteration_time
    host_s = host_time(model, cluster, plan, options)
    T = with_host(device_T, host_s)
    samples = plan.global_batch
    tokens = samples * (model.tokens_per_sample or model.seq_len)
    model_flops = samples * model.flops_per_sample()
    recompute_flops = 0.0
    for stage in plan.stages:
        group = plan.groups[stage.group]
        for l in model.layers[stage.start:stage.end]:
            if stage.recompute == "full":
                recompute_flops += l.flops_fwd.total
            elif stage.recompute == "selective":
                core = sum(g.flops for g in l.gemms_fwd if g.in_core) + l.attention_flops_fwd.total
                recompute_flops += core
    hardware_flops = model_flops + samples * recompute_flops
    used = sorted(memory_by_rank)
    n_gpus = len(used)
    peak_sum = sum(cluster.slots[r].device.peak(plan.dtype) for r in used)
    g = sim.critical_rank
    bubble = max(0.0, sim.compute_end[g] - sim.busy[g])
    # Exposed context-parallel exchange on the critical rank, from the actions it ran.
    cp_comm = sum(costs[a.stage].cp_comm_forward if a.kind == "F" else
                  costs[a.stage].cp_comm_backward if a.kind in ("B", "I") else 0.0 for a in program.ranks[g])
    breakdown = {
        "compute": sim.busy[g] - sim.tp_comm[g] - sim.ep_comm[g] - cp_comm,
        "tp_communication": sim.tp_comm[g],
        "ep_communication": sim.ep_comm[g],
        **({"cp_communication": cp_comm} if plan.cp > 1 else {}),
        "bubble": bubble,
        "dp_communication": max(0.0, sim.comm_end[g] - sim.compute_end[g]),
        "optimizer": sim.rank_end[g] - max(sim.compute_end[g], sim.comm_end[g]),
        # (A host far below the device still lifts the smoothed step by a rounding error.)
        **({"host": T - device_T} if T - device_T > 1e-9 * T else {}),
    }
    time_band, memory_band = error_bands(stack.name)
    if options.calibration is not None:
        from costmodel.uncertainty import ErrorBand
        cal = options.calibration
        time_band = ErrorBand(*cal.time_error, cal.runs, "calibration (leave-one-out)")
        if cal.loo_memory_mape is not None:
            memory_band = ErrorBand(*cal.memory_error, cal.runs, "calibration (leave-one-out)")
    peak = max(memory_by_rank.values())
    inputs = {"stack": f"{stack.name} ({stack.version})"}
    for dev, src in sources.items():
        inputs[dev] = {"measured": "measured layer profile", "calibrated": "roofline, calibrated",
                       "roofline": "roofline, default efficiencies", "mixed": "measured profile and roofline"}[src]
    inputs["memory"] = f"stack {stack.name}" + (", calibrated" if options.calibration else " defaults")
    if zero != plan.zero:
        inputs["zero"] = (f"ZeRO-{plan.zero} runs as ZeRO-{zero} under pipelining on stack {stack.name}: the pipeline "
                          "keeps the gathered weights and whole gradients until the step's last backward")
    if host_s > 0:
        calibrated = options.calibration is not None and any(
            options.calibration.device(node_group.device.name) is not None for node_group in cluster.groups)
        autocast = any(stack.computes_under_autocast(*_degrees(plan, g)) for g in plan.groups)
        inputs["host"] = (f"{host_s:.3g} s of host work per step"
                          + (" (its kernels counted under autocast, the casts included)" if autocast else "") + ", "
                          + ("calibrated" if calibrated else f"stack {stack.name} defaults"))
    alignment = _alignment_note(model, cluster, plan, stack, sources)
    if alignment:
        inputs["alignment"] = alignment
    inputs["interval"] = time_band.source or "none"
    return Estimate(
        plan=plan, iteration_time_s=T, tokens_per_s=tokens / T, samples_per_s=samples / T,
        model_tflops_per_gpu=model_flops / T / n_gpus / 1e12,
        hardware_tflops_per_gpu=hardware_flops / T / n_gpus / 1e12,
        mfu=model_flops / T / peak_sum, hfu=hardware_flops / T / peak_sum,
        peak_memory_bytes=peak, memory_by_rank=memory_by_rank,
        memory_by_group=memory_by_group, device_memory_by_rank=device_mem, fits=fits,
        breakdown=breakdown, bubble_fraction=bubble / sim.compute_end[g] if sim.compute_end[g] else 0.0,
        timeline=sim.events, sources=sources, stage_costs=costs, stack=stack.name, tight=tight,
        memory_margin=options.memory_margin, time_interval_s=time_band.interval(T),
        memory_interval_bytes=memory_band.interval(peak), inputs=inputs)
