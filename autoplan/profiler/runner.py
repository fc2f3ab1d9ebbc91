"""``autoplan.profile(...)``: plan a sweep of layer shapes, measure them, benchmark the
links, and write everything to a profile file as it goes.

The sweep is every distinct unit of a one-block model (embedding, block, head) x
tensor-parallel degree x micro-batch x sequence length. Entries already in the file
are skipped, so an interrupted run resumes where it stopped; each new entry is written
(atomically) as soon as it is measured. Before anything is allocated, each entry's
memory is estimated from the planner's own spec and entries larger than
``max_layer_bytes`` are refused.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from autoplan.errors import ConfigError
from autoplan.models.config import TransformerConfig
from autoplan.profiler.environment import Environment, available_memory_bytes, capture, resolve_device
from autoplan.profiler.layers import RECOMPUTE_MODES, TORCH_DTYPES, UNIT_KINDS, LayerTask, measure_layer
from autoplan.profiler.links import DEFAULT_SIZES, LinkSettings, benchmark_links
from autoplan.profiler.progress import Progress
from autoplan.profiler.shapes import shape_key, spec_to_dict, tp_supported
from autoplan.profiler.store import ProfileFile, ProfileStore, file_name
from autoplan.profiler.timing import RepeatPolicy, flush_bytes
from autoplan.units import DTYPE_BYTES, GiB

DEFAULT_TP = (1, 2, 4, 8)
DEFAULT_MICRO_BATCHES = (1, 2, 4)
DEFAULT_RECOMPUTE = ("none", "full")
CPU_MEMORY_SHARE = 0.5
"""Default ``max_layer_bytes`` on CPU: this share of the host's available RAM (the
rest stays with the other processes of the machine)."""
GPU_MEMORY_SHARE = 0.9
"""Default on GPU: this share of the free device memory (the allocator fragments)."""


@dataclass
class ProfileResult:
    """What a profile run did."""

    path: Path
    """The profile file written (or that would be, for a dry run)."""
    environment: Environment
    """The measuring machine, as recorded in the file."""
    tasks: list[LayerTask]
    """Every entry of the sweep that fits in memory."""
    measured: int = 0
    """Entries measured by this run."""
    resumed: int = 0
    """Entries already in the file and skipped."""
    refused: list[str] = field(default_factory=list)
    """Entries over ``max_layer_bytes``, with their estimated size."""
    skipped_tp: dict[str, str] = field(default_factory=dict)
    """'model tp=N' -> why that degree cannot shard the model."""
    links: dict | None = None
    """The measured ``intra_node`` link record, when benchmarked."""
    elapsed_s: float = 0.0
    """Seconds the call took."""
    dry_run: bool = False
    """Nothing was measured: ``tasks`` is the plan."""

    @property
    def store(self) -> ProfileStore:
        return ProfileStore.load(self.path)

    def summary(self) -> str:
        lines = [f"profile file: {self.path}", f"device: {self.environment.describe()}"]
        verb = "would measure" if self.dry_run else "measured"
        lines.append(f"{verb} {self.measured if not self.dry_run else len(self.tasks) - self.resumed} entries, "
                     f"{self.resumed} already present, {len(self.refused)} refused "
                     f"(over max-layer-bytes), in {self.elapsed_s:.1f} s")
        for k, why in self.skipped_tp.items():
            lines.append(f"  skipped {k}: {why}")
        for r in self.refused[:10]:
            lines.append(f"  refused {r}")
        if len(self.refused) > 10:
            lines.append(f"  ... and {len(self.refused) - 10} more refused")
        if self.links:
            bw = self.links["bandwidth_GBps"]
            lines.append(f"link intra_node ({self.links['backend']}, {self.links['world_size']} ranks): "
                         f"{self.links['latency_us']:.1f} us + "
                         + (f"{bw:.3f} GB/s" if bw is not None else "bandwidth not resolvable at these sizes")
                         + f" (rms error {self.links['rms_rel_error']:.0%})")
            if self.links.get("unsupported"):
                lines.append(f"  not supported by {self.links['backend']}: {', '.join(self.links['unsupported'])}")
        return "\n".join(lines)


# ------------------------------------------------------------------ planning
def _is_moe(source: str) -> bool:
    """Whether a preset name or config.json path describes a mixture of experts."""
    from autoplan.models.presets import PRESETS
    if source.lower() in PRESETS:
        return getattr(PRESETS[source.lower()], "arch", "") == "moe"
    if source.endswith(".json") or os.sep in source or Path(source).is_file():
        from autoplan.models.hf import config_from_hf
        return config_from_hf(source).arch == "moe"
    return False


def _configs(model, seq_lens: Sequence[int] | None) -> list[tuple[str, TransformerConfig]]:
    """(label, one-block config at each sequence length) for one model source."""
    from autoplan.models.config import SwinConfig
    from autoplan.models.spec import ModelSpec

    if isinstance(model, ModelSpec):
        if model.config is None:
            raise ConfigError("model", f"{model.name} was measured from an nn.Module, not a config, so its "
                              "layers cannot be rebuilt at shard shapes", "profile a zoo name or config.json")
        model = model.config

    def at(seq: int | None) -> TransformerConfig:
        over = {"layers": 1, **({"seq_len": seq} if seq else {})}
        if getattr(model, "arch", None) == "moe" or (isinstance(model, str) and _is_moe(model)):
            # Profile the expert block at balanced load, the work its spec describes (the
            # cost model applies the routing's capacity factor or imbalance); dense first
            # blocks of such a model are left to the roofline.
            over.update(dense_layers=0, capacity_factor=1.0)
        if isinstance(model, TransformerConfig):
            c = model.resolved()
            if seq and c.position == "learned" and c.max_positions < seq:
                over["max_positions"] = seq
            return dataclasses.replace(c, **over).resolved()
        if isinstance(model, SwinConfig):
            raise ConfigError("model", "Swin models are not profiled per layer (their stages differ "
                              "in shape)", "profile a transformer; Swin estimates use the roofline")
        text = str(model)
        from autoplan.models import is_config_path
        if is_config_path(model):
            from autoplan.models.hf import config_from_hf
            return config_from_hf(text, **over).resolved()
        from autoplan.models.presets import PRESETS, get_config
        if isinstance(PRESETS.get(text.lower()), SwinConfig):
            raise ConfigError("model", f"{text} is a Swin model, which is not profiled per layer",
                              "profile a transformer; Swin estimates use the roofline")
        return get_config(text, **over)

    first = at(None)
    seqs = list(seq_lens) if seq_lens else [first.seq_len]
    return [(first.name, at(s)) for s in seqs]


def _need_bytes(spec, tp: int, mb: int, dtype: str) -> float:
    """Memory to measure one entry, on the safe side: the shard's weights, their
    accumulated gradients and the fresh gradients backward makes before adding them in
    (an embedding's is a dense table-sized tensor), the fp32 copy initialisation makes
    before casting, what the forward saves and about as much again in backward's
    temporaries, the input and output and their gradients, and the costliest transient
    of its backward (a head's logits gradient, as autoplan's own loss keeps them)."""
    from autoplan.stacks import get_stack
    from costmodel.memory import transient_bytes
    params = spec.params.at(tp)
    w = DTYPE_BYTES[dtype]
    init_copy = params * 4 if dtype != "fp32" else 0.0
    acts = mb * (2 * spec.activation_bytes["none"].at(tp) + 2 * spec.activation_bytes["full"].at(tp)
                 + 2 * spec.output_bytes)
    # A shard is measured standalone: its loss runs on the shard's own logits.
    shard_loss = dataclasses.replace(get_stack("autoplan"), vocab_parallel_loss=True)
    return 3 * params * w + init_copy + acts + transient_bytes([spec], "none", mb, tp, False, shard_loss, dtype)


def plan_tasks(models: Iterable, device_spec, dtype: str, tp: Sequence[int], micro_batches: Sequence[int],
               seq_lens: Sequence[int] | None, policy: RepeatPolicy,
               device: str = "cpu") -> tuple[list[LayerTask], dict[str, str]]:
    """Every entry of the sweep (deduplicated by shape), and the degrees that were skipped.
    With the policy's cache flush, each task also counts the buffer that evicts
    ``device``'s caches before every timed pass (up to twice the last-level cache: on a
    server CPU, hundreds of MiB)."""
    from autoplan import models as zoo
    from costmodel.compute import roofline_timing
    from costmodel.efficiency import default_efficiency

    eff = default_efficiency(device_spec.name)
    tasks: dict[tuple, LayerTask] = {}
    skipped: dict[str, str] = {}
    for source in models:
        for label, cfg in _configs(source, seq_lens):
            spec = zoo.from_config(cfg, dtype)
            if len(spec.layers) != len(UNIT_KINDS):
                raise ConfigError("model", f"{label} has {len(spec.layers)} units in a one-block model, "
                                  f"expected {list(UNIT_KINDS)}")
            for t in tp:
                why = tp_supported(cfg, t)
                if why:
                    skipped[f"{label} tp={t}"] = why
                    continue
                for mb in micro_batches:
                    for i, layer in enumerate(spec.layers):
                        key = shape_key(layer)
                        rt = roofline_timing(device_spec, eff, layer, mb, t, False, dtype)
                        passes = 2 * (policy.warmup + policy.repeats) + 4
                        # The cache flush measure_layer allocates: 4x the shard's weights and
                        # saved activations, within the device's cache sizes (flush_bytes).
                        working = (layer.params.at(t) * DTYPE_BYTES[dtype]
                                   + mb * layer.activation_bytes["none"].at(t))
                        flush = float(flush_bytes(device, working)) if policy.flush else 0.0
                        task = LayerTask(model=label, config=cfg, unit=i, kind=layer.kind, tp=t, micro_batch=mb,
                                         seq_len=cfg.seq_len, spec=layer, key=key,
                                         need_bytes=_need_bytes(layer, t, mb, dtype), flush_bytes=flush,
                                         weight=(rt.forward + rt.backward) * passes + 3 * policy.min_time_s)
                        tasks.setdefault(task.entry_key, task)
    return list(tasks.values()), skipped


def _shape_record(task: LayerTask) -> dict:
    return {"model": task.model, "kind": task.kind, "seq_len": task.seq_len,
            "fingerprint": task.key.fingerprint, "tokens": task.key.tokens,
            "config": {k: v for k, v in dataclasses.asdict(task.config).items()},
            "spec": spec_to_dict(task.spec)}


def _has(f: ProfileFile, task: LayerTask, recompute: Sequence[str]) -> bool:
    e = f.get(task.key.id, task.tp, task.micro_batch)
    if e is None:
        return False
    have = set(e.get("recompute", {}))
    want = {m for m in recompute if m != "none" and not (m == "selective" and task.kind != "block")}
    return want <= have


def _default_command(models, kwargs: dict) -> str:
    args = ", ".join([repr(m) if isinstance(m, (str, os.PathLike)) else getattr(m, "name", type(m).__name__)
                      for m in models]
                     + [f"{k}={v!r}" for k, v in kwargs.items()])
    return f"autoplan.profile({args})"


# ------------------------------------------------------------------- the run
def profile(model, *, device: str = "cpu", dtype: str | None = None, out: str | Path = "profiles",
            tp: Sequence[int] = DEFAULT_TP, micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
            seq_lens: Sequence[int] | None = None, recompute: Sequence[str] = DEFAULT_RECOMPUTE,
            warmup: int = 3, repeats: int = 10, min_time_s: float = 0.05, max_repeats: int = 200,
            clock: str = "wall", statistic: str = "median", flush: bool = True,
            ops: bool = True, links: bool = True, link_world_size: int | None = None,
            link_sizes: Sequence[int] = DEFAULT_SIZES, link_repeats: int = 7,
            max_layer_bytes: float | None = None, threads: int | None = None,
            device_name: str | None = None, restart: bool = False, dry_run: bool = False,
            progress: bool = True, command: str | None = None) -> ProfileResult:
    """Profile the layers of ``model`` (a zoo name, a config.json path, a TransformerConfig,
    a ModelSpec built from one, or a list of these) on this machine's ``device`` and write
    ``<out>/<device>_<dtype>_torch-<version>.json``.

    Layer shapes: every unit of a one-block model at each tensor-parallel degree in ``tp``
    that divides the model, each micro-batch in ``micro_batches`` and each sequence
    length in ``seq_lens`` (default: the model's). ``recompute`` adds, per mode, the
    backward with recomputation and the activations it keeps. ``links`` benchmarks the
    collectives among ``link_world_size`` local ranks (default: 2 on CPU, every GPU on
    cuda). Entries already in the file are kept unless ``restart``; ``dry_run`` only
    plans (and checks memory)."""
    t_start = time.monotonic()
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models:
        raise ConfigError("model", "give at least one model")
    torch_device, device_spec = resolve_device(device, device_name)
    cuda = torch_device.startswith("cuda")
    dtype = dtype or ("bf16" if cuda else "fp32")
    if dtype not in TORCH_DTYPES:
        raise ConfigError("dtype", f"{dtype!r} is not one of {list(TORCH_DTYPES)}")
    for name, values in (("tp", tp), ("micro_batches", micro_batches), ("seq_lens", seq_lens or [1])):
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
            raise ConfigError(name, f"must be positive integers, got {list(values)!r}")
    bad = set(recompute) - set(RECOMPUTE_MODES)
    if bad:
        raise ConfigError("recompute", f"unknown mode(s) {sorted(bad)}", f"choose from {list(RECOMPUTE_MODES)}")
    policy = RepeatPolicy(warmup=warmup, repeats=repeats, min_time_s=min_time_s,
                          max_repeats=max(max_repeats, repeats), clock=clock, flush=flush,
                          statistic=statistic).validate()
    if threads is not None:
        if threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {threads}")
        import torch
        torch.set_num_threads(threads)
    from autoplan.profiler.timing import Clock
    Clock(torch_device, clock)  # refuses 'thread' with several threads
    if command is None:
        command = _default_command(models, {k: v for k, v in dict(
            device=device, dtype=dtype, tp=tuple(tp), micro_batches=tuple(micro_batches),
            seq_lens=tuple(seq_lens) if seq_lens else None, threads=threads,
            clock=clock if clock != "wall" else None,
            statistic=statistic if statistic != "median" else None).items() if v is not None})
    env = capture(torch_device, device_spec, command)
    path = Path(out) / file_name(device_spec.name, dtype, env.torch_version)

    tasks, skipped_tp = plan_tasks(models, device_spec, dtype, tp, micro_batches, seq_lens, policy,
                                   torch_device)
    limit = max_layer_bytes if max_layer_bytes is not None else (
        available_memory_bytes(torch_device) * (GPU_MEMORY_SHARE if cuda else CPU_MEMORY_SHARE))
    fitting = [t for t in tasks if t.total_bytes <= limit]
    refused = [f"{t.label()}: needs ~{t.total_bytes / GiB:.2f} GiB" for t in tasks if t.total_bytes > limit]
    if tasks and not fitting:
        small = min(tasks, key=lambda t: t.total_bytes)
        raise ConfigError("max_layer_bytes", f"no layer fits: the smallest, {small.label()}, needs "
                          f"~{small.total_bytes / GiB:.2f} GiB of the {limit / GiB:.2f} GiB allowed",
                          "profile at a larger --tp, a smaller --micro-batch or a shorter --seq-len, "
                          "or raise --max-layer-bytes")
    if not tasks:
        raise ConfigError("tp", "no tensor-parallel degree can shard the model: " + "; ".join(
            f"{k}: {v}" for k, v in skipped_tp.items()))

    existing = None
    if path.exists() and not restart:
        existing = ProfileFile.load(path)
        if not existing.environment.same_machine(env):
            raise ConfigError(str(path), f"was measured on {existing.environment.describe()}, this run is "
                              f"{env.describe()}", "write to another --out, or pass --restart to replace it")
        # One file, one way of timing: entries must be comparable.
        for key in ("clock", "statistic"):
            had = existing.settings.get(key, getattr(RepeatPolicy(), key))
            if had != getattr(policy, key):
                raise ConfigError(key, f"{getattr(policy, key)!r} differs from the {had!r} that {path.name} was "
                                  f"measured with", f"pass --{key} {had}, another --out, or --restart")
    f = existing or ProfileFile(path, env, dtype)
    f.settings = {**dataclasses.asdict(policy), "ops": ops}
    if command not in f.commands:
        f.commands.append(command)
    todo = [t for t in fitting if not _has(f, t, recompute)]
    result = ProfileResult(path=path, environment=env, tasks=fitting, refused=refused, skipped_tp=skipped_tp,
                           resumed=len(fitting) - len(todo), dry_run=dry_run)
    if dry_run:
        result.elapsed_s = time.monotonic() - t_start
        return result

    # Large entries last: an interrupted run keeps the most entries per second spent.
    todo.sort(key=lambda t: t.weight)
    bar = Progress(len(todo), sum(t.weight for t in todo), title=f"profile {device_spec.name} {dtype}",
                   enabled=progress)
    try:
        if todo:
            # Process warm-up (thread pools, allocator, kernel caches), discarded.
            measure_layer(todo[0], torch_device, dtype, dataclasses.replace(policy, repeats=2, max_repeats=2),
                          ("none",), ops=False)
        for i, task in enumerate(todo):
            bar.show(task.label())
            entry = measure_layer(task, torch_device, dtype, policy, tuple(recompute), ops=ops)
            entry["model"] = task.model
            f.add(task.key.id, _shape_record(task), {"tp": task.tp, "micro_batch": task.micro_batch, **entry})
            f.save()
            result.measured += 1
            bar.step(task.weight, todo[i + 1].label() if i + 1 < len(todo) else "done")
    except KeyboardInterrupt:
        bar.close()
        print(f"interrupted: {result.measured} entries saved to {path}; run the same command again to "
              f"resume", file=sys.stderr)
        raise
    bar.close()
    if not todo:
        f.save()

    if links and ("intra_node" not in f.links or restart):
        import torch
        world = link_world_size or (torch.cuda.device_count() if cuda else 2)
        if world >= 2:
            if progress:
                print(f"benchmarking collectives among {world} local ranks ...", file=sys.stderr)
            settings = LinkSettings(world_size=world, backend="nccl" if cuda else "gloo",
                                    sizes=tuple(link_sizes), repeats=link_repeats, statistic=statistic)
            f.links["intra_node"] = benchmark_links(settings)
            f.save()
        elif progress:
            print("link benchmark skipped: needs at least 2 local devices", file=sys.stderr)
    result.links = f.links.get("intra_node")
    result.elapsed_s = time.monotonic() - t_start
    return result
