"""``estimate(model, cluster, plan)``: iteration time, throughput and per-rank memory of a
plan, by lowering it to its schedule program and simulating that program with per-stage
costs from the compute, communication and memory models."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.models.spec import ModelSpec
from autoplan.plan import Plan
from autoplan.schedule import build_program
from autoplan.units import DTYPE_BYTES, GiB
from costmodel.comm import collective_time, p2p_time
from costmodel.compute import ProfileSource, layer_timing
from costmodel.efficiency import default_efficiency
from costmodel.memory import (FRAGMENTATION, GRAD_BYTES_PER_PARAM, activation_bytes,
                              framework_overhead_bytes, model_state_bytes, transient_bytes)
from costmodel.simulate import Event, StageCosts, simulate

ADAM_STEP_BYTES_PER_PARAM = 30.0
"""HBM traffic of one fused Adam update per parameter: read fp32 master, m, v and gradient
(16 B), write master, m, v (12 B) and the 2-byte compute copy."""


@dataclass(frozen=True)
class EstimateOptions:
    """Knobs of the cost model that are properties of the training software, not the plan."""

    overlap_grad_reduce: bool = True
    """Data-parallel gradient reduction overlaps the last backward (DDP/FSDP buckets).
    Megatron-LM before 2023 did not overlap it."""
    profiles: ProfileSource | None = None
    """Measured layer profiles; None = catalog roofline only."""
    blocking_p2p: bool = True
    """Pipeline sends hold the sending rank until they complete (Megatron-LM's batched
    send/recv); False = asynchronous sends that only delay the receiver."""


@dataclass
class GroupMemory:
    """Peak bytes on each rank of one pipeline group, by component."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    transient: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.transient + self.overhead


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
    breakdown: dict[str, float]
    """Seconds on the critical rank: compute, tp_communication, bubble, dp_communication, optimizer."""
    bubble_fraction: float
    timeline: list[Event] = field(repr=False, default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    """Per device type: 'measured' (profile) or 'roofline' (catalog)."""
    stage_costs: list[StageCosts] = field(repr=False, default_factory=list)

    def summary(self) -> str:
        b = self.breakdown
        parts = ", ".join(f"{k} {v:.3g}s" for k, v in b.items())
        mem = f"{self.peak_memory_bytes / GiB:.1f} GiB peak/GPU"
        return (f"{self.plan.describe()}\n  iteration {self.iteration_time_s:.4g} s, "
                f"{self.tokens_per_s:,.0f} tokens/s, {self.model_tflops_per_gpu:.1f} TFLOP/s/GPU, "
                f"MFU {self.mfu:.1%}, {mem} ({'fits' if self.fits else 'DOES NOT FIT'})\n  {parts}")

    def to_dict(self) -> dict:
        return {
            "iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
            "peak_memory_GiB": self.peak_memory_bytes / GiB, "fits": self.fits,
            "bubble_fraction": self.bubble_fraction, "breakdown_s": dict(self.breakdown),
            "sources": dict(self.sources),
        }


def _group_devices(cluster: Cluster, ranks) -> list:
    seen = {}
    for r in ranks:
        d = cluster.slots[r].device
        seen.setdefault(d.name, d)
    return list(seen.values())


def _worst(cluster: Cluster, groups, nbytes: float, kind: str) -> float:
    return max((collective_time(cluster, grp, nbytes, kind) for grp in groups), default=0.0)


def stage_costs(model: ModelSpec, cluster: Cluster, plan: Plan, options: EstimateOptions,
                sources: dict[str, str] | None = None) -> list[StageCosts]:
    """Per-micro-batch costs of every stage of the plan."""
    b, sp, dtype = plan.micro_batch, plan.sequence_parallel, plan.dtype
    out = []
    n = len(plan.stages)
    for s_idx, stage in enumerate(plan.stages):
        group = plan.groups[stage.group]
        tp, dp = group.tp, group.dp
        layers = model.layers[stage.start:stage.end]
        tp_groups, dp_groups = group.tp_groups(), group.dp_groups()
        fwd = bwd = bwd_i = bwd_w = 0.0
        # A group of mixed device types runs at the pace of its slowest member.
        for dev in _group_devices(cluster, group.ranks):
            f = bi = bw = 0.0
            for layer in layers:
                t = layer_timing(dev, layer, b, tp, sp, dtype, options.profiles)
                if sources is not None:
                    prev = sources.get(dev.name)
                    sources[dev.name] = t.source if prev in (None, t.source) else "mixed"
                rec = {"none": 0.0, "selective": t.recompute_selective, "full": t.forward}[stage.recompute]
                f += t.forward
                bi += t.backward_input + rec
                bw += t.backward_weight
            fwd, bwd_i, bwd_w = max(fwd, f), max(bwd_i, bi), max(bwd_w, bw)
        bwd = bwd_i + bwd_w
        # Tensor-parallel collectives sit on the critical path of every layer.
        tp_f = 0.0
        if tp > 1:
            for layer in layers:
                if layer.tp_allreduces_fwd:
                    tp_f += layer.tp_allreduces_fwd * _worst(cluster, tp_groups, b * layer.output_bytes, "all_reduce")
        tp_b = tp_f * (2 if stage.recompute == "full" else 1)
        fwd += tp_f
        bwd_i += tp_b
        bwd += tp_b
        params = sum(l.params.at(tp) for l in layers)
        w_bytes = DTYPE_BYTES[dtype]
        if plan.zero >= 3 and dp > 1:
            # Parameters are gathered for the forward and again for the backward, and
            # gradients reduce-scattered, every micro-batch; prefetching hides what the
            # compute can cover.
            gather = _worst(cluster, dp_groups, params * w_bytes, "all_gather")
            scatter = _worst(cluster, dp_groups, params * GRAD_BYTES_PER_PARAM, "reduce_scatter")
            fwd = max(fwd, gather)
            extra = max(0.0, gather + scatter - bwd)
            bwd_i += extra
            bwd += extra
            reduce = 0.0
        elif dp > 1:
            kind = "reduce_scatter" if plan.zero >= 1 else "all_reduce"
            reduce = _worst(cluster, dp_groups, params * GRAD_BYTES_PER_PARAM, kind)
        else:
            reduce = 0.0
        out_bytes = b * layers[-1].output_bytes
        if sp and tp > 1:
            out_bytes_sent = out_bytes  # already sequence-sharded: each rank sends 1/t
        else:
            out_bytes_sent = out_bytes
        send_f = 0.0
        if s_idx < n - 1:
            nxt = plan.groups[plan.stages[s_idx + 1].group]
            if nxt is not group:
                send_f = p2p_time(cluster, tp_groups, nxt.tp_groups(), out_bytes_sent)
        send_b = 0.0
        if s_idx > 0:
            prv = plan.groups[plan.stages[s_idx - 1].group]
            in_bytes = b * model.layers[stage.start - 1].output_bytes
            if prv is not group:
                send_b = p2p_time(cluster, tp_groups, prv.tp_groups(), in_bytes)
        act = activation_bytes(list(layers), stage.recompute, b, tp, sp)
        out.append(StageCosts(forward=fwd, backward=bwd, backward_input=bwd_i, backward_weight=bwd_w,
                              send_forward=send_f, send_backward=send_b, activation_bytes=act,
                              grad_reduce=reduce, layers=len(layers), tp_comm_forward=tp_f,
                              tp_comm_backward=tp_b))
    return out


def _optimizer_time(model: ModelSpec, cluster: Cluster, plan: Plan, g: int) -> tuple[float, float]:
    """(Adam step, exposed post-step parameter all-gather) for one pipeline group."""
    group = plan.groups[g]
    layers = [l for s in plan.stages if s.group == g for l in model.layers[s.start:s.end]]
    params = sum(l.params.at(group.tp) for l in layers)
    shard = params / (group.dp if plan.zero >= 1 else 1)
    step = max(shard * ADAM_STEP_BYTES_PER_PARAM / (d.memory_bandwidth * default_efficiency(d.name).memory)
               for d in _group_devices(cluster, group.ranks))
    gather = 0.0
    if plan.zero in (1, 2) and group.dp > 1:
        gather = _worst(cluster, group.dp_groups(), params * DTYPE_BYTES[plan.dtype], "all_gather")
    return step, gather


def estimate(model: ModelSpec, cluster: Cluster, plan: Plan, options: EstimateOptions | None = None,
             **kwargs) -> Estimate:
    """Simulate one training iteration of ``plan``. Keyword arguments override
    :class:`EstimateOptions` fields (e.g. ``profiles=store``)."""
    options = options or EstimateOptions()
    if kwargs:
        unknown = set(kwargs) - set(EstimateOptions.__dataclass_fields__)
        if unknown:
            raise ConfigError(sorted(unknown)[0], "is not an estimate option",
                              f"known: {', '.join(EstimateOptions.__dataclass_fields__)}")
        options = EstimateOptions(**{**options.__dict__, **kwargs})
    plan.validate(model, cluster)
    program = build_program(plan)
    sources: dict[str, str] = {}
    costs = stage_costs(model, cluster, plan, options, sources)
    opt = [_optimizer_time(model, cluster, plan, g) for g in range(plan.pp)]
    sim = simulate(program, costs, [o[0] for o in opt], options.overlap_grad_reduce, [o[1] for o in opt],
                   blocking_p2p=options.blocking_p2p)

    # Memory per group.
    memory_by_group, memory_by_rank, device_mem = [], {}, {}
    for g, group in enumerate(plan.groups):
        stage_ids = plan.stages_of_group(g)
        layers = [l for s in stage_ids for l in model.layers[plan.stages[s].start:plan.stages[s].end]]
        states = model_state_bytes(layers, group.tp, group.dp, plan.zero, plan.dtype)
        transient = max(transient_bytes(list(model.layers[plan.stages[s].start:plan.stages[s].end]),
                                        plan.stages[s].recompute, plan.micro_batch, group.tp,
                                        plan.sequence_parallel) for s in stage_ids)
        dynamic = sim.peak_activation_bytes[g] + transient
        mem = GroupMemory(weights=states.weights + states.zero3_working, gradients=states.gradients,
                          optimizer=states.optimizer, activations=sim.peak_activation_bytes[g],
                          transient=transient,
                          overhead=max(framework_overhead_bytes(d.name) for d in _group_devices(cluster, group.ranks))
                          + FRAGMENTATION * (dynamic + states.total))
        memory_by_group.append(mem)
        for r in group.ranks:
            memory_by_rank[r] = mem.total
            device_mem[r] = cluster.slots[r].device.memory_bytes
    fits = all(memory_by_rank[r] <= device_mem[r] for r in memory_by_rank)

    # Throughput.
    T = sim.iteration_time
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
    breakdown = {
        "compute": sim.busy[g] - sim.tp_comm[g],
        "tp_communication": sim.tp_comm[g],
        "bubble": bubble,
        "dp_communication": max(0.0, sim.comm_end[g] - sim.compute_end[g]),
        "optimizer": sim.rank_end[g] - max(sim.compute_end[g], sim.comm_end[g]),
    }
    return Estimate(
        plan=plan, iteration_time_s=T, tokens_per_s=tokens / T, samples_per_s=samples / T,
        model_tflops_per_gpu=model_flops / T / n_gpus / 1e12,
        hardware_tflops_per_gpu=hardware_flops / T / n_gpus / 1e12,
        mfu=model_flops / T / peak_sum, hfu=hardware_flops / T / peak_sum,
        peak_memory_bytes=max(memory_by_rank.values()), memory_by_rank=memory_by_rank,
        memory_by_group=memory_by_group, device_memory_by_rank=device_mem, fits=fits,
        breakdown=breakdown, bubble_fraction=bubble / sim.compute_end[g] if sim.compute_end[g] else 0.0,
        timeline=sim.events, sources=sources, stage_costs=costs)
