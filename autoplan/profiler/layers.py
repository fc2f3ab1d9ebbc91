"""Measure one pipeline unit at one shard shape, micro-batch and sequence length.

The unit is taken from a one-block model built on ``meta`` at the shard shapes one
tensor-parallel rank runs (heads, kv heads, MLP width and vocabulary divided by the
degree, see :func:`shapes.shard_config`), and only that unit is materialised on the
device: profiling never holds more than one layer's shard, its gradients and its
activations, whatever the model's size.

Per entry it records forward, backward, input-gradient-only backward (what zero-bubble
schedules run first; the weight-gradient part is the difference), the attention core's
forward (what selective recomputation re-runs), and, per requested recompute mode, the
backward with recomputation and the activations it keeps.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from autoplan.models.config import TransformerConfig
from autoplan.models.spec import LayerSpec
from autoplan.profiler.shapes import ShapeKey, shard_config
from autoplan.profiler.timing import (STATISTICS, CacheFlush, Clock, RepeatPolicy, SavedBytes,
                                      profile_pass, repeat_timed, spread)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RECOMPUTE_MODES = ("none", "selective", "full")
UNIT_KINDS = ("embedding", "block", "head")
"""The distinct units of a one-block transformer, in model order."""


@dataclass(frozen=True)
class LayerTask:
    """One entry to measure."""

    model: str
    """Label of the model the shape came from (reports only)."""
    config: TransformerConfig
    """Full-width config with layers=1 at this sequence length (resolved)."""
    unit: int
    """Index into the one-block model's units (0 embedding, 1 block, 2 head)."""
    kind: str
    """'embedding', 'block' or 'head'."""
    tp: int
    """Tensor-parallel degree whose per-rank shard is measured."""
    micro_batch: int
    """Samples per micro-batch."""
    seq_len: int
    """Tokens per sample."""
    spec: LayerSpec = field(compare=False)
    """The planner's full-width spec of this unit (what lookups will present)."""
    key: ShapeKey = field(compare=False)
    """Shape key of ``spec``: with tp and micro_batch, what identifies the entry."""
    need_bytes: float = field(default=0.0, compare=False)
    """Estimated device memory the layer itself needs while measured (one shard, its
    gradients, activations)."""
    flush_bytes: float = field(default=0.0, compare=False)
    """The buffer overwritten before each timed pass to evict the caches (0 without
    flushing); allocated beside the layer, so the memory guard counts both."""
    weight: float = field(default=1.0, compare=False)
    """Relative cost, for the progress ETA."""

    @property
    def total_bytes(self) -> float:
        """Device memory measuring this entry takes: the layer's and the cache flush's."""
        return self.need_bytes + self.flush_bytes

    @property
    def entry_key(self) -> tuple:
        return (self.key.id, self.tp, self.micro_batch)

    def label(self) -> str:
        return f"{self.model} {self.kind} tp={self.tp} mb={self.micro_batch} s={self.seq_len}"


@dataclass
class _Unit:
    """One materialised unit and its inputs."""

    module: torch.nn.Module
    """The unit at shard shapes, on the device, in the compute dtype."""
    inputs: torch.Tensor
    """Token ids (embedding) or hidden states requiring grad."""
    targets: torch.Tensor | None
    """Target ids for the head's loss."""
    float_input: bool
    """The input can have a gradient (not token ids)."""
    loss: Callable | None
    """The loss the head ends in, as the stack runs it (``autoplan.models.zoo.measured_loss_fn``);
    None for the other units."""

    @property
    def is_head(self) -> bool:
        return self.loss is not None

    def forward(self) -> torch.Tensor:
        out = self.module(self.inputs)
        if self.is_head:
            out = self.loss(out, self.targets)
        return out


def _build_unit(task: LayerTask, device: str, dtype: str) -> _Unit:
    from autoplan.models.zoo import build_model, init_parameters, measured_loss_fn

    cfg = shard_config(task.config, task.tp)
    if cfg.layers != 1:
        # The guarantee that profiling needs one layer's memory rests on this.
        raise AssertionError("profiling builds one-block models only")
    with torch.device("meta"):
        model = build_model(cfg)
    unit = model.layers[task.unit]
    del model
    torch.manual_seed(0)
    unit.to_empty(device=device)
    with torch.no_grad():
        init_parameters(unit)
    unit.to(TORCH_DTYPES[dtype]).train()
    gen = torch.Generator().manual_seed(1)
    b, s = task.micro_batch, task.seq_len
    is_head = task.kind == "head"
    if task.kind == "embedding":
        x = torch.randint(0, cfg.vocab, (b, s), generator=gen).to(device)
        float_input = False
    else:
        x = torch.randn(b, s, cfg.hidden, generator=gen).to(device=device, dtype=TORCH_DTYPES[dtype])
        x.requires_grad_(True)
        float_input = True
    targets = torch.randint(0, cfg.vocab, (b, s), generator=gen).to(device) if is_head else None
    return _Unit(unit, x, targets, float_input, measured_loss_fn(cfg) if is_head else None)


def _attention_core(module: torch.nn.Module) -> torch.nn.Module | None:
    attn = getattr(module, "attention", None)
    return getattr(attn, "core", None)


def split_backward(st: dict) -> dict:
    """``st`` (one statistic's times in ms) with the backward split into its input-gradient
    and weight-gradient parts that add up to it. The input-gradient pass is timed on its
    own (0 where it is not); on a layer whose backward is mostly that pass, timing noise can
    put its statistic above the whole backward's. It is part of the backward, so it is held
    to it."""
    st = dict(st)
    st["backward_input_ms"] = min(st.get("backward_input_ms", 0.0), st["backward_ms"])
    st["backward_weight_ms"] = st["backward_ms"] - st["backward_input_ms"]
    return st


def measure_layer(task: LayerTask, device: str, dtype: str, policy: RepeatPolicy,
                  recompute: tuple[str, ...] = ("none",), ops: bool = True) -> dict:
    """Measure ``task`` on ``device``; returns the profile entry (times in ms, bytes)."""
    clock = Clock(device, policy.clock)
    u = _build_unit(task, device, dtype)
    params = list(u.module.parameters())
    # (Sized where the memory guard counts it: plan_tasks.)
    flush = CacheFlush(device, int(task.flush_bytes) if policy.flush else 0)

    # Gradient of the output: fixed, so every backward does the same work.
    with torch.no_grad():
        probe = u.forward()
    grad_out = None if u.is_head else torch.randn_like(probe)
    del probe

    def backward(out):
        out.backward(grad_out)

    def backward_input(out):
        torch.autograd.grad(out, [u.inputs], grad_out)

    def step() -> dict[str, float]:
        flush()
        t_f, out = clock.time(u.forward)
        flush()
        t_b, _ = clock.time(lambda: backward(out))
        times = {"forward": t_f, "backward": t_b}
        if u.float_input:
            flush()
            t_f2, out2 = clock.time(u.forward)
            flush()
            t_bi, _ = clock.time(lambda: backward_input(out2))
            times.update(forward2=t_f2, backward_input=t_bi)
        return times

    samples = repeat_timed(policy, step)
    samples["forward"] = samples["forward"] + samples.pop("forward2", [])
    # Attention core alone: the extra backward work of selective recomputation.
    core = _attention_core(u.module)
    if core is not None:
        samples["recompute_core"] = _time_core(u, core, clock, policy, flush)
    stats = {}
    for name, fn in STATISTICS.items():
        st = {f"{k}_ms": fn(v) * 1e3 for k, v in samples.items()}
        st.setdefault("recompute_core_ms", 0.0)
        stats[name] = split_backward(st)
    entry = {**stats[policy.statistic], "statistic": policy.statistic,
             "forward_spread": spread(samples["forward"]), "backward_spread": spread(samples["backward"]),
             "repeats": len(samples["backward"]), "statistics": stats}

    entry.update(_memory(u, params, clock, device, backward, ops))
    modes = {}
    for mode in recompute:
        if mode == "none":
            continue
        if mode == "selective" and core is None:
            continue
        modes[mode] = _measure_recompute(u, params, core, mode, clock, policy, grad_out, flush)
    if modes:
        entry["recompute"] = modes
    for p in params:
        p.grad = None
    return entry


def _time_core(u: _Unit, core: torch.nn.Module, clock: Clock, policy: RepeatPolicy, flush) -> list[float]:
    captured = {}

    def grab(_m, args):
        captured["args"] = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)

    h = core.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            u.forward()
    finally:
        h.remove()
    q, k, v = captured["args"]
    def step():
        flush()
        return {"core": clock.time(lambda: core(q, k, v))[0]}
    return repeat_timed(policy, step)["core"]


def _memory(u: _Unit, params, clock: Clock, device: str, backward, ops: bool) -> dict:
    """Saved activations (hooks), peaks (allocator), per-operator shares (profiler)."""
    saved = SavedBytes(params)
    out: dict = {}
    if clock.cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            y = u.forward()
        torch.cuda.synchronize(device)
        out["forward_peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - base)
        held = torch.cuda.memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        backward(y)
        del y
        torch.cuda.synchronize(device)
        out["backward_peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - base)
        out["held_after_forward_bytes"] = float(held)
        out["memory_source"] = "cuda allocator"
        if ops:
            f, y = profile_pass(u.forward, clock, memory=False)
            b, _ = profile_pass(lambda: backward(y), clock, memory=False)
            out["ops_forward"], out["ops_backward"] = f.times_ms, b.times_ms
            del y
    else:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            f, y = profile_pass(u.forward, clock, memory=True)
        b, _ = profile_pass(lambda: backward(y), clock, memory=True)
        del y
        if f.peak_bytes is not None and b.peak_bytes is not None:
            out["forward_peak_bytes"] = f.peak_bytes
            out["held_after_forward_bytes"] = f.end_bytes
            out["backward_peak_bytes"] = f.end_bytes + b.peak_bytes
            out["memory_source"] = "cpu allocation records"
        else:
            out["memory_source"] = "saved-tensor hooks only"
        if ops:
            out["ops_forward"], out["ops_backward"] = f.times_ms, b.times_ms
    out["saved_bytes"] = float(saved.total)
    return out


def _measure_recompute(u: _Unit, params, core, mode: str, clock: Clock, policy: RepeatPolicy,
                       grad_out, flush) -> dict:
    """Backward time and kept activations with ``mode`` recomputation (non-reentrant
    ``torch.utils.checkpoint`` of the whole unit, or of the attention core only).

    Kept bytes: what autograd saves outside the checkpointed region (hooks) plus the
    region's tensor inputs, which the checkpoint holds to re-run it."""
    saved = SavedBytes(params)

    def hold(args):
        for a in args:
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                saved.seen.setdefault(st.data_ptr(), st.nbytes())

    if mode == "full":
        def fwd():
            hold((u.inputs,))
            return checkpoint(u.forward, use_reentrant=False)
        restore = None
    else:
        original = core.forward

        def ckpt_core(*args):
            hold(args)
            return checkpoint(original, *args, use_reentrant=False)
        core.forward = ckpt_core
        restore = original
        fwd = u.forward
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            y = fwd()
        y.backward(grad_out)
        kept = float(saved.total)

        def step():
            out = fwd()
            flush()
            return {"backward": clock.time(lambda: out.backward(grad_out))[0]}
        samples = repeat_timed(dataclasses.replace(policy, warmup=1), step)
    finally:
        if restore is not None:
            core.forward = restore
    return {"backward_ms": STATISTICS[policy.statistic](samples["backward"]) * 1e3, "saved_bytes": kept}
