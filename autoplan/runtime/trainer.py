"""The training loop: a plan, a zoo model and data in; a measured-run record out.

    import torch.distributed as dist, autoplan
    from autoplan.runtime import train
    dist.init_process_group("gloo")          # or run under `autoplan run` / torchrun
    record = train(autoplan.Plan.load("plan.json"), "gpt-tiny", steps=20, out="run.json")

Each process builds only its own part of the model (see :mod:`autoplan.runtime.build`),
runs the plan's schedule program (:mod:`autoplan.runtime.executor`), keeps tied
embeddings equal, clips the global gradient norm, steps the optimizer, logs and
checkpoints.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.data_parallel import data_parallel_choice
from autoplan.errors import ConfigError
from autoplan.models.config import SwinConfig, TransformerConfig
from autoplan.models.zoo import fp32_loss_fn
from autoplan.plan import Plan
from autoplan.runtime import build as B
from autoplan.runtime.context import apply_context_parallel, check_context_supported, shard_positions
from autoplan.runtime.data import DataSource, replica_slice
from autoplan.runtime.executor import LocalExecutor, PipelineExecutor
from autoplan.runtime.experts import LOAD_BALANCING, configure_load_balancing, start_step, step_value
from autoplan.runtime.layout import EXPERT_DIMS, build_mesh, check_plan_supported, expert_mesh, rank_layout
from autoplan.runtime.record import (MEMORY_SOURCE_CPU, MEMORY_SOURCE_CUDA, RankMemory, RunRecord,
                                     StepRecord)
from autoplan.schedule import build_program

OPTIMIZERS = ("adamw", "sgd")
CLOCKS = ("wall", "thread")


@dataclass(frozen=True)
class TrainOptions:
    """Settings of a training run that are not part of the plan."""

    steps: int = 10
    """Train until this many steps are done in total (a resumed run continues to it)."""
    optimizer: str = "adamw"
    """'adamw' or 'sgd'."""
    lr: float = 3e-4
    """Learning rate (constant)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) / L2 penalty (SGD)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    max_grad_norm: float = 1.0
    """Clip the global gradient 2-norm to this; 0 disables clipping."""
    seed: int = 0
    """Seeds the weights (per unit) and the synthetic data stream."""
    seq_len: int = 0
    """Tokens per sample; 0 = the plan's seq_len, else the model's."""
    checkpoint_dir: str | None = None
    """Directory for checkpoints; None = no checkpoints."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0 = only after the last step)."""
    resume: bool = True
    """Continue from the latest checkpoint in checkpoint_dir, if there is one."""
    log_every: int = 1
    """Print a log line every this many steps on rank 0 (0 = never)."""
    clock: str = "wall"
    """How a step is timed: 'wall' (elapsed time) or 'thread' (CPU time of the training
    thread: on a CPU rank with one torch thread every kernel and the autograd engine run on
    that thread, so other jobs sharing the machine do not inflate the figure; it leaves out
    time spent waiting for other ranks)."""
    load_balancing: str = "micro"
    """Mixture of experts: where the load-balancing loss takes the expert frequencies f from:
    'micro' (each micro-batch on each rank, as GShard / Megatron-Core's aux_loss) or 'global'
    (summed over the step's micro-batches and the data-parallel ranks, Qiu et al. 2025)."""

    def validate(self) -> "TrainOptions":
        """The one place these settings are checked."""
        for name in ("steps", "log_every", "checkpoint_every"):
            v = getattr(self, name)
            minimum = 1 if name == "steps" else 0
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                raise ConfigError(name, f"must be an integer >= {minimum}, got {v!r}")
        if self.clock not in CLOCKS:
            raise ConfigError("clock", f"{self.clock!r} is not one of {list(CLOCKS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", f"{self.optimizer!r} is not one of {list(OPTIMIZERS)}")
        if self.load_balancing not in LOAD_BALANCING:
            raise ConfigError("load_balancing", f"{self.load_balancing!r} is not one of {list(LOAD_BALANCING)}")
        for name in ("lr", "weight_decay", "eps", "momentum", "max_grad_norm"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ConfigError(name, f"must be a finite number >= 0, got {v!r}")
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 0:
            raise ConfigError("seq_len", f"must be an integer >= 0, got {self.seq_len!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("seed", f"must be an integer >= 0, got {self.seed!r}")
        return self


def resolve_model_config(model: Any, seq_len: int = 0) -> TransformerConfig | SwinConfig:
    """The zoo architecture config for a preset name, a HuggingFace-style config.json
    path, a config object, or a ModelSpec that came from one; ``seq_len`` (if > 0)
    overrides a transformer's sequence length."""
    from autoplan.models.spec import ModelSpec

    overrides = {}
    if isinstance(model, ModelSpec):
        if model.config is None:
            raise ConfigError("model", f"the spec {model.name!r} has no architecture config to build from",
                              "pass a zoo preset name, a config.json path or a config object")
        model = model.config
    if isinstance(model, (str, os.PathLike)):
        from autoplan.models import is_config_path
        if is_config_path(model):
            from autoplan.models.hf import config_from_hf
            cfg = config_from_hf(model)
        else:
            from autoplan.models.presets import get_config
            cfg = get_config(str(model))
    elif isinstance(model, (TransformerConfig, SwinConfig)):
        cfg = model
    else:
        raise ConfigError("model", f"the runtime builds zoo models; cannot build from {type(model).__name__}",
                          "pass a preset name, a config.json path, a TransformerConfig/SwinConfig or a ModelSpec")
    if seq_len and isinstance(cfg, TransformerConfig) and seq_len != cfg.seq_len:
        overrides["seq_len"] = seq_len
        if cfg.position == "learned" and (cfg.max_positions or 0) < seq_len:
            overrides["max_positions"] = None  # re-derived from seq_len
    return dataclasses.replace(cfg, **overrides).resolved() if overrides else cfg.resolved()


def check_backend(backend: str, local_ranks: int = 1) -> None:
    """Raise a one-line ConfigError when ``backend`` cannot run ``local_ranks`` ranks on
    this machine (NCCL needs a CUDA GPU per local rank)."""
    if backend != "nccl":
        return
    if not torch.cuda.is_available():
        raise ConfigError("--backend", "nccl needs CUDA GPUs, and torch sees none on this machine",
                          "use --backend gloo (or auto) to run on CPUs")
    if torch.cuda.device_count() < local_ranks:
        raise ConfigError("--backend", f"nccl runs one rank per GPU: {local_ranks} ranks on this node, "
                          f"{torch.cuda.device_count()} GPUs", "run fewer ranks per node, or use gloo")


def default_device() -> torch.device:
    """cuda:LOCAL_RANK under an NCCL process group, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _check_tp_shapes(cfg, tp: int) -> None:
    if tp == 1:
        return
    if isinstance(cfg, TransformerConfig):
        if cfg.qk_norm == "full":
            # OLMo 2 normalises q and k over all heads: a tensor-parallel rank holds only some
            # of them, and the statistic would need an all-reduce inside the norm.
            raise ConfigError("groups[0].tp", f"{tp}: the model's q/k norm spans all heads "
                              "(qk_norm='full'), which the runtime does not shard", "use tp=1")
        checks = {"heads": cfg.heads, "kv_heads": cfg.kv_heads, "ffn_hidden": cfg.ffn_hidden, "vocab": cfg.vocab}
    else:
        checks = {f"heads[{i}]": h for i, h in enumerate(cfg.heads)}
    for name, value in checks.items():
        if value % tp:
            # DTensor would shard unevenly; the zoo's attention derives local head counts
            # from shapes and needs whole heads per rank.
            raise ConfigError(f"model.{name}", f"{value} is not divisible by the plan's tp={tp}",
                              "use a tensor-parallel degree that divides it")


class Trainer:
    """This rank's share of a plan, ready to train. Needs an initialised process group
    with exactly ``plan.num_gpus`` ranks."""

    def __init__(self, plan: Plan, model: Any, options: TrainOptions | None = None,
                 data: Callable[[int], Any] | Iterable | None = None, device: torch.device | str | None = None,
                 log: Callable[[str], None] | None = print):
        # FSDP2 warns whenever a unit returns a view (the zoo's embedding slice under SP,
        # a stage ending in a reshape). The warning is about in-place ops on such outputs,
        # which neither the zoo's units nor the pipeline runtime perform.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        if not dist.is_initialized():
            raise ConfigError("process group", "torch.distributed is not initialized",
                              "launch with `autoplan run` or torchrun, or call "
                              "torch.distributed.init_process_group first")
        self.options = (options or TrainOptions()).validate()
        self.plan = plan.validate()
        self.log = log if dist.get_rank() == 0 and log is not None else (lambda s: None)
        seq = self.options.seq_len or plan.seq_len
        self.cfg = resolve_model_config(model, seq)
        if plan.model and plan.model != self.cfg.name:
            self.log(f"note: the plan was made for {plan.model!r}; running {self.cfg.name!r}")
        self.device = torch.device(device) if device is not None else default_device()
        meta = B.meta_model(self.cfg)
        self.num_units = len(meta.layers)
        self.num_params = sum(p.numel() for p in meta.parameters())   # a tied table counts once
        unit_types = {type(u) for u in meta.layers}
        del meta
        num_experts = self.cfg.num_experts if getattr(self.cfg, "arch", "") == "moe" else 0
        check_plan_supported(plan, self.num_units,
                             kv_heads=getattr(self.cfg, "kv_heads", None),
                             sequence_parallel_ok=all(issubclass(t, B.SEQUENCE_PARALLEL_UNITS) for t in unit_types),
                             num_experts=num_experts)
        _check_tp_shapes(self.cfg, plan.groups[0].tp)
        check_context_supported(self.cfg, plan.cp, plan.cp_comm, self.cfg.seq_len)
        self.mesh = build_mesh(plan, self.device.type)
        self.layout = rank_layout(plan, dist.get_rank())
        lay = self.layout
        # The tokens of every sequence this rank holds (all of them without context parallelism).
        self.positions = (shard_positions(self.cfg.seq_len, lay.cp, lay.cp_rank, plan.cp_comm, self.cfg.causal)
                          if lay.cp > 1 else None)

        # Mixed precision only on GPUs: CPU kernels for bf16 are slow and partial, and the
        # point of CPU runs is checking correctness in fp32.
        dtype = {"bf16": torch.bfloat16, "fp32": None}.get(plan.dtype)
        self.compute_dtype = dtype if self.device.type == "cuda" else None
        if dtype is not None and self.compute_dtype is None:
            self.log(f"warning: the plan computes in {plan.dtype}; on {self.device.type} this run computes in "
                     "fp32, so its step time and memory are not the plan's (run it on GPUs for those)")
        # Context ranks hold the same weights as data replicas: gradients are averaged, and
        # ZeRO shards states, over both (Megatron-Core's data-parallel-with-context group).
        self.dp_choice = data_parallel_choice(lay.dp * lay.cp, plan.zero, lay.pp, lay.tp, plan.schedule, plan.ep)
        mp_policy, autocast = None, self.compute_dtype
        if self.compute_dtype is not None and not self.dp_choice.under_autocast:
            from torch.distributed.fsdp import MixedPrecisionPolicy
            mp_policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            autocast = None

        # ---- build and parallelize this rank's units, stage by stage, on meta; then
        # materialise only the local shards (host memory scales with the shard)
        unit_ids = [u for s in lay.stage_ids for u in range(plan.stages[s].start, plan.stages[s].end)]
        units = B.meta_units(self.cfg, unit_ids)
        tp_mesh, dp_mesh = self.mesh["tp"], self.mesh["dp"]
        if lay.cp > 1:
            dp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        # Routed experts live on the same mesh with "dp" split into ("edp", "ep") whenever
        # they are sharded (by expert, or by tensor parallelism like a dense MLP).
        self.expert_mesh = (expert_mesh(self.mesh, plan) if num_experts and (plan.ep > 1 or lay.tp > 1)
                            else None)
        self.stage_modules: dict[int, torch.nn.Module] = {}
        built: dict[int, B.StageModule] = {}
        for s in lay.stage_ids:
            stage = plan.stages[s]
            mine = {u: units[u] for u in range(stage.start, stage.end)}
            for unit in mine.values():
                if lay.tp > 1:
                    B.apply_tensor_parallel(unit, tp_mesh, plan.sequence_parallel)
                if lay.cp > 1:
                    apply_context_parallel(unit, self.mesh["cp"], plan.cp_comm, self.positions)
                if self.expert_mesh is not None:
                    B.apply_expert_parallel(unit, self.expert_mesh["ep", "tp"])
                B.apply_recompute(unit, stage.recompute)
            module = B.StageModule(mine, autocast_dtype=autocast, device_type=self.device.type)
            B.apply_data_parallel(module, dp_mesh, self.dp_choice, mp_policy,
                                  expert_dp_mesh=self.expert_mesh["edp"] if self.expert_mesh is not None else None)
            module.to_empty(device=self.device)
            built[s] = module
        B.init_local_shards(units, self.cfg, self.num_units, self.options.seed)
        for s, module in built.items():
            self.stage_modules[s] = (B.wrap_ddp(module, dp_mesh, self.device) if self.dp_choice.wrapper == "ddp"
                                     else module)
        self.model = B.RankModel({int(u): m for sm in built.values() for u, m in sm.layers.items()})
        self.params = dict(self.model.named_parameters())
        self._setup_tied()
        self.optimizer = self._make_optimizer()

        # ---- the schedule program the cost model simulates
        self.program = build_program(plan)
        loss = fp32_loss_fn
        # The load-balancing loss's gradient is scaled as the executor scales each
        # micro-batch's loss: the local executor divides the loss, the pipeline runtime
        # divides the gradients afterwards. Its per-step counts start afresh right before
        # each step's first real forward.
        self.balance = configure_load_balancing(
            self.model.layers.values(), self.options.load_balancing,
            dp_mesh.get_group() if lay.dp > 1 else None,
            grad_scale=1.0 / plan.num_micro_batches if lay.pp == 1 else 1.0)
        reset = (lambda: start_step(self.balance)) if self.balance else None
        if lay.pp == 1:
            self.executor = LocalExecutor(self.stage_modules[lay.stage_ids[0]], self.program, loss, self.device,
                                          self.dp_choice, before_compute=reset)
        else:
            self.executor = PipelineExecutor(self.stage_modules, len(plan.stages), self.program, loss,
                                             self.device, self.mesh["pp"].get_group(), before_compute=reset)
        self.data = DataSource(self.cfg, plan.global_batch, self.options.seed, data)
        self.step = 0
        """Completed steps."""
        self.resumed_from: int | None = None
        # Tokens for LMs; patches for Swin (its seq_len property).
        self.tokens_per_step = plan.global_batch * self.cfg.seq_len

    # ------------------------------------------------------------------ set-up
    def _setup_tied(self) -> None:
        """Pair the embedding table with the head's copy of it (tied embeddings)."""
        self.tied = B.tied_embedding_fqns(self.cfg, self.num_units)
        self.tied_group = None
        self.tied_local: list[torch.nn.Parameter] = []
        if self.tied is None:
            return
        self.tied_local = [self.params[f] for f in self.tied if f in self.params]
        first, last = self.plan.stages[0].group, self.plan.stages[-1].group
        if first == last:
            return
        # One two-rank group per (replica, tensor shard): the same position in the first
        # and the last pipeline group hold the same shard of the table. new_group is
        # collective, so every rank creates every pair in the same order.
        from autoplan.runtime.layout import mesh_tensor
        grid = mesh_tensor(self.plan)
        for d in range(grid.shape[1]):
            for c in range(grid.shape[2]):
                for t in range(grid.shape[3]):
                    pair = [int(grid[first, d, c, t]), int(grid[last, d, c, t])]
                    group = dist.new_group(pair)
                    if dist.get_rank() in pair:
                        self.tied_group = group

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.options
        params = list(self.model.parameters())
        # foreach kernels group tensors by type; a mix of DTensor and plain tensors (TP
        # without FSDP leaves norms replicated and plain) is not supported there.
        kinds = {isinstance(p, DTensor) for p in params}
        foreach = None if len(kinds) <= 1 else False
        if o.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                     foreach=foreach)
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                               foreach=foreach)

    # ------------------------------------------------------------------ a step
    def _now(self) -> float:
        if self.options.clock == "thread":
            if self.device.type != "cpu" or torch.get_num_threads() != 1:
                raise ConfigError("clock", "'thread' times only a CPU rank with one torch thread",
                                  "use clock='wall' (or torch.set_num_threads(1) on CPU)")
            return time.thread_time()
        return time.perf_counter()

    def forward_backward(self) -> tuple[list[float], float]:
        """Run the next step's schedule program; leaves gradients in place.
        Returns (this rank's micro-batch losses, seconds spent)."""
        t0 = time.perf_counter()
        batch = self.data.next_batch()
        inputs, targets = replica_slice(batch, self.layout.dp_rank, self.layout.dp)
        if self.positions is not None:
            inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        self.optimizer.zero_grad(set_to_none=True)
        losses = self.executor.run(inputs, targets)
        self._match_grad_placements()
        self._sync_tied_grads()
        return losses, time.perf_counter() - t0

    def _match_grad_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements. DTensor's embedding
        backward returns a vocab-sharded table's gradient Replicate'd (full size); the
        optimizer would cope, but the tied-weight sum and the norm work on local shards,
        which must line up with the parameter's. Replicate -> Shard is a local slice."""
        for p in self.params.values():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def _sync_tied_grads(self) -> None:
        """Both copies of a tied table get the sum of their gradients: the gradient the
        single shared parameter would have."""
        grads = [_local(p.grad) for p in self.tied_local if p.grad is not None]
        if len(grads) != len(self.tied_local):
            return
        if len(grads) == 2:
            total = grads[0] + grads[1]
            grads[0].copy_(total)
            grads[1].copy_(total)
        elif len(grads) == 1 and self.tied_group is not None:
            dist.all_reduce(grads[0], group=self.tied_group)

    def grad_norm(self) -> float:
        """Global gradient 2-norm over every rank, counting each element once."""
        skip = {self.tied[1]} if self.tied else set()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.params.items():
            if p.grad is None or name in skip:
                continue
            if self._counts_here(p.grad):
                sq += _local(p.grad).detach().double().pow(2).sum()
        dist.all_reduce(sq)
        return float(sq.sqrt())

    def _counts_here(self, g: torch.Tensor) -> bool:
        """Whether this rank's copy of ``g`` is the one to count: a tensor replicated over
        the dp, cp or tp axis is counted on coordinate 0 of that axis only. Routed experts'
        tensors see the dp axis as ("edp", "ep") and are judged on those."""
        sharded: set[str] = set()
        names: tuple = ()
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names or ()
            for name, placement in zip(names, g.placements):
                if placement.is_partial():
                    raise RuntimeError(f"unreduced (Partial) gradient on mesh axis {name!r}")
                # Anything not Replicate is a shard (FSDP x TP uses _StridedShard, which
                # is not a Shard subclass and answers is_shard() with False).
                if not placement.is_replicate():
                    sharded.update(name.split("_"))   # the flattened "dp_cp" axis shards both
        data = EXPERT_DIMS if set(EXPERT_DIMS) & set(names) else ("dp", "cp")
        return all(self.layout.coordinate(axis) == 0 for axis in (*data, "tp") if axis not in sharded)

    def optimizer_step(self) -> float:
        """Clip (if enabled) and step; returns the norm before clipping."""
        norm = self.grad_norm()
        max_norm = self.options.max_grad_norm
        if max_norm and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.params.values():
                if p.grad is not None:
                    _local(p.grad).mul_(scale)
        self.optimizer.step()
        return norm

    def train_step(self, inspect: Callable[["Trainer"], None] | None = None) -> StepRecord:
        """One full step; collective. Returns the step's figures (identical on all ranks).
        ``inspect(trainer)`` is called between backward and the optimizer step (e.g. to
        read :meth:`gradients`); its time is not counted."""
        now = self._now
        t0 = now()
        losses, _ = self.forward_backward()
        if inspect is not None:
            t_in = now()
            inspect(self)
            t0 += now() - t_in
        norm = self.optimizer_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = now() - t0
        lay = self.layout
        # The last pipeline rank holds the losses; tp ranks hold copies, dp replicas and cp
        # ranks parts (each the mean over its own, equally many, tokens).
        contrib = sum(losses) / len(losses) / (lay.dp * lay.cp) if losses and lay.tp_rank == 0 else 0.0
        balance, layers = step_value(self.balance) if lay.tp_rank == 0 else (0.0, 0)
        # One all-gather carries every rank's (time, loss share, peak memory, load-balancing
        # loss summed over its MoE layers, and their count).
        mine = torch.tensor([elapsed, contrib, float(self._peak_memory()[0]), balance, float(layers)],
                            dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone).cpu()
        self.step += 1
        t = float(table[:, 0].max())   # the step is as slow as its slowest rank
        moe_layers = float(table[:, 4].sum())   # every MoE layer once per data-parallel replica
        return StepRecord(step=self.step, loss=float(table[:, 1].sum()), step_time_s=t,
                          tokens_per_s=self.tokens_per_step / t, grad_norm=norm,
                          peak_memory_bytes_by_rank=tuple(int(m) for m in table[:, 2]),
                          load_balancing_loss=float(table[:, 3].sum()) / moe_layers if moe_layers else None)

    # ---------------------------------------------------------- introspection
    def gradients(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU copies of this rank's gradients by parameter name. Collective
        over the ranks of this pipeline position; for tests and debugging."""
        return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu().clone()
                for n, p in self.params.items() if p.grad is not None}

    def parameters_full(self) -> dict[str, torch.Tensor]:
        """Full CPU copies of this rank's parameters (collective like :meth:`gradients`)."""
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
                for n, p in self.params.items()}

    def _model_state_bytes(self) -> int:
        state = 0
        for p in self.model.parameters():
            state += _local(p).nbytes
            if p.grad is not None:
                state += _local(p.grad).nbytes
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    state += _local(v).nbytes
        return state

    def _peak_memory(self) -> tuple[int, str]:
        """(peak bytes so far, what they measure): CUDA's allocator peak on GPU; on CPU,
        where there is no allocator peak, the model-state tensor bytes."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), MEMORY_SOURCE_CUDA
        return self._model_state_bytes(), MEMORY_SOURCE_CPU

    def memory(self) -> RankMemory:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
        peak, source = self._peak_memory()
        return RankMemory(rank=dist.get_rank(), peak_memory_bytes=int(peak), memory_source=source,
                          model_state_bytes=int(self._model_state_bytes()), max_rss_bytes=int(rss_bytes))

    # ------------------------------------------------------------ checkpoints
    # torch.distributed.checkpoint is imported only when a run checkpoints: it adds about
    # a second of start-up to every process.
    def save(self, directory: str | os.PathLike) -> Path:
        from autoplan.runtime.checkpoint import save_checkpoint
        train_state = {"seed": self.options.seed, "world_size": dist.get_world_size(),
                       "model": {"name": self.cfg.name, "num_params": self.num_params},
                       "plan": self.plan.to_dict(), "data": {k: v for k, v in self.data.state_dict().items()
                                                             if k != "dataset"}}
        return save_checkpoint(directory, self.step, self.model, self.optimizer, train_state,
                               self.data.state_dict())

    def load(self, path: str | os.PathLike) -> int:
        """Load a checkpoint (any plan's); returns the step it was taken after."""
        from autoplan.runtime.checkpoint import load_checkpoint
        train_state, dataset_state = load_checkpoint(path, self.model, self.optimizer, self.cfg.name)
        data_state = dict(train_state.get("data", {"position": train_state["step"]}))
        if dataset_state is not None:
            data_state["dataset"] = dataset_state
        self.data.load_state_dict(data_state)
        self.step = int(train_state["step"])
        self.resumed_from = self.step
        return self.step

    def maybe_resume(self) -> int | None:
        o = self.options
        if not (o.checkpoint_dir and o.resume):
            return None
        from autoplan.runtime.checkpoint import latest_checkpoint
        found = latest_checkpoint(o.checkpoint_dir)
        if found is None:
            return None
        step, path = found
        self.load(path)
        self.log(f"resumed from {path.name} (step {step})")
        return step

    # ---------------------------------------------------------------- the run
    def fit(self) -> RunRecord:
        """Train to ``options.steps``, checkpointing and logging; return the record."""
        o = self.options
        self.maybe_resume()
        self.log(f"plan: {self.plan.describe()}")
        self.log(f"model: {self.cfg.name}, {self.num_units} units; world {dist.get_world_size()} "
                 f"({dist.get_backend()}, {self.device.type}); {self.dp_choice.note}")
        records: list[StepRecord] = []
        while self.step < o.steps:
            rec = self.train_step()
            records.append(rec)
            if o.log_every and (rec.step % o.log_every == 0 or rec.step == o.steps):
                mem = rec.peak_memory_bytes_by_rank
                top = max(range(len(mem)), key=mem.__getitem__)
                lbl = f"  lbl {rec.load_balancing_loss:.4f}" if rec.load_balancing_loss is not None else ""
                self.log(f"step {rec.step:>5}  loss {rec.loss:.4f}{lbl}  grad_norm {rec.grad_norm:.3f}  "
                         f"{rec.step_time_s * 1e3:.1f} ms  {rec.tokens_per_s:,.0f} tokens/s  "
                         f"peak mem {mem[top] / 2**20:,.1f} MiB (rank {top}{'' if self.device.type == 'cuda' else ', model state'})")
            if o.checkpoint_dir and ((o.checkpoint_every and rec.step % o.checkpoint_every == 0)
                                     or rec.step == o.steps):
                self.save(o.checkpoint_dir)
        return self.record(records)

    def record(self, steps: list[StepRecord]) -> RunRecord:
        """The run record (collective: gathers per-rank memory and device names)."""
        mem = self.memory()
        name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                else f"cpu ({platform.machine()})")
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mem, name))
        o = self.options
        run = {
            "steps_requested": o.steps, "first_step": steps[0].step if steps else None,
            "resumed_from_step": self.resumed_from, "optimizer": o.optimizer, "learning_rate": o.lr,
            "weight_decay": o.weight_decay, "max_grad_norm": o.max_grad_norm, "seed": o.seed,
            "load_balancing": o.load_balancing if self.balance else None,
            "global_batch": self.plan.global_batch, "seq_len": self.cfg.seq_len,
            "tokens_per_step": self.tokens_per_step, "data": self.data.kind,
            "compute_dtype": str(self.compute_dtype or torch.float32).replace("torch.", ""),
            "mixed_precision": ("FSDP MixedPrecisionPolicy" if self.compute_dtype and self.dp_choice.wrapper != "none"
                                else "autocast" if self.compute_dtype else "none (fp32)"),
            "data_parallel": self.dp_choice.note, "clock": o.clock,
            "schedule_program": self.program.to_compute_only(),
            "checkpoint_dir": o.checkpoint_dir,
        }
        env = {"torch_version": torch.__version__, "python_version": platform.python_version(),
               "backend": dist.get_backend(), "device_type": self.device.type,
               "device_names": [g[1] for g in gathered], "world_size": dist.get_world_size(),
               "num_nodes": int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")) or 1)}
        model = {"name": self.cfg.name, "num_units": self.num_units, "num_params": self.num_params,
                 "config": {k: v for k, v in dataclasses.asdict(self.cfg).items()}}
        return RunRecord(plan=self.plan, model=model, environment=env, run=run, steps=tuple(steps),
                         memory=tuple(sorted((g[0] for g in gathered), key=lambda m: m.rank)))


def train(plan: Plan | str | os.PathLike, model: Any, *, steps: int = 10, data=None, out: str | os.PathLike | None = None,
          device=None, log: Callable[[str], None] | None = print, **options) -> RunRecord:
    """Train ``model`` (zoo preset name, config.json path, config or ModelSpec) with
    ``plan`` (a Plan or a plan.json path) for ``steps`` steps inside the current process
    group, and return the run record (also written to ``out`` by rank 0 when given).

    ``data``: None for the seeded synthetic stream, or a callable ``index -> (inputs,
    targets)`` / an iterable of global batches (see :class:`autoplan.runtime.data.DataSource`).
    Other keywords are :class:`TrainOptions` fields (optimizer, lr, seed, max_grad_norm,
    checkpoint_dir, checkpoint_every, resume, ...)."""
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    known = {f.name for f in dataclasses.fields(TrainOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        from autoplan.errors import closest
        raise ConfigError(unknown[0], "is not a training option",
                          closest(unknown[0], known) or f"known: {', '.join(sorted(known))}")
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    trainer = Trainer(plan, model, TrainOptions(steps=steps, **options), data=data, device=device, log=log)
    record = trainer.fit()
    if out is not None and dist.get_rank() == 0:
        record.save(out)
        trainer.log(f"wrote {out}")
    return record


def build_only(plan: Plan | str | os.PathLike, model: Any, rank: int = 0, seq_len: int = 0, seed: int = 0) -> dict:
    """Build rank ``rank``'s part of ``plan`` in this process, as a real run would, and
    report its size: nothing is trained and no other rank is started (a fake process
    group stands in for the others, so one machine can check what one rank of a large
    plan needs). Returns the local parameter bytes, the whole model's parameter bytes
    (fp32) and this process's peak resident memory."""
    # The fake backend ships with torch (torch.testing) and is what torch's own memory
    # tooling uses: collectives return at once and allocate nothing.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if not 0 <= rank < plan.num_gpus:
        raise ConfigError("--rank", f"{rank} is not a rank of the plan (0..{plan.num_gpus - 1})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.num_gpus)
    try:
        t = Trainer(plan, model, TrainOptions(steps=1, seed=seed, seq_len=seq_len), device="cpu", log=None)
        local = sum(_local(p).numel() * _local(p).element_size() for p in t.model.parameters())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"rank": rank, "world_size": plan.num_gpus, "model": t.cfg.name,
                "units": sorted(int(u) for u in t.model.layers), "local_parameter_bytes": int(local),
                "model_parameter_bytes": int(t.num_params * 4),
                "max_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024),
                "data_parallel": t.dp_choice.note}
    finally:
        dist.destroy_process_group()
