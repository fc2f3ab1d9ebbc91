"""Build this rank's part of a zoo model and parallelize it as the plan says.

Order of application, per unit (a pipeline unit of ``model.layers``):

1. materialize only the units this rank holds, each initialised from ``seed`` and its
   own index, so every plan (and a single-process reference) starts from the same weights;
2. tensor / sequence parallelism with DTensor ``parallelize_module`` from the unit's
   ``tp_plan()``;
3. activation checkpointing as planned (``selective``: the attention core; ``full``:
   the whole unit);
4. data parallelism / ZeRO with FSDP2 ``fully_shard`` or the FSDP-family ``replicate``,
   per unit and then per pipeline stage (the stage is the FSDP root).

Parameter names are the full model's (``layers.<unit>.<...>``) on every rank and under
every plan, which is what lets a checkpoint saved under one plan load under another.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.checkpoint import checkpoint

from autoplan.errors import ConfigError
from autoplan.models.config import SwinConfig, TransformerConfig
from autoplan.models.zoo import build_model, init_parameters
from autoplan.models.zoo.transformer import Block, Head, TokenEmbedding

UNIT_SEED_STRIDE = 1_000_003
"""Unit i of a run seeded s is initialised from seed s * stride + i (a prime stride keeps
seeds of different runs from colliding for any realistic unit count)."""

SEQUENCE_PARALLEL_UNITS = (TokenEmbedding, Block, Head)
"""Unit types whose sequence-parallel layout the runtime knows (see apply_tensor_parallel)."""


def unit_seed(seed: int, index: int) -> int:
    return seed * UNIT_SEED_STRIDE + index


def _seeded_init(unit: nn.Module, seed: int, index: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, index))
        init_parameters(unit)


def meta_model(cfg: TransformerConfig | SwinConfig) -> nn.Module:
    """The whole model on ``meta``: shapes only, no memory."""
    with torch.device("meta"):
        return build_model(cfg)


def tied_embedding_fqns(cfg, num_units: int) -> tuple[str, str] | None:
    """(embedding weight, output weight) names when the model ties them, else None."""
    if isinstance(cfg, TransformerConfig) and cfg.tie_embeddings:
        return ("layers.0.tok_embeddings.weight", f"layers.{num_units - 1}.output.weight")
    return None


def materialize_units(cfg, unit_ids: Iterable[int], seed: int) -> dict[int, nn.Module]:
    """The units ``unit_ids`` of ``cfg``'s model on the CPU, deterministically initialised.

    The model is built on ``meta`` and only the held units are materialized, so a rank
    never allocates the whole model. Tied embeddings are untied: the head holds its own
    copy of the embedding table (initialised to the same values), and the trainer keeps
    the two copies equal by summing their gradients (as Megatron-LM does between the
    first and last pipeline stage)."""
    full = meta_model(cfg)
    n = len(full.layers)
    units: dict[int, nn.Module] = {}
    for i in sorted(set(unit_ids)):
        unit = full.layers[i]
        # to_empty gives each unit fresh storage, which also unties a shared parameter.
        unit.to_empty(device="cpu")
        _seeded_init(unit, seed, i)
        units[i] = unit
    if tied_embedding_fqns(cfg, n) and n - 1 in units:
        if 0 in units:
            table = units[0].tok_embeddings.weight
        else:
            emb = full.layers[0]
            emb.to_empty(device="cpu")
            _seeded_init(emb, seed, 0)
            table = emb.tok_embeddings.weight
        with torch.no_grad():
            units[n - 1].output.weight.copy_(table)
    return units


# --------------------------------------------------------------------- tensor parallel
def tensor_parallel_styles(unit: nn.Module, sequence_parallel: bool) -> tuple[dict, object | None]:
    """(parallelize_module plan for the unit's submodules, style for the unit itself or None).

    The zoo's styles map to DTensor styles as in torchtitan's parallelize_llama:

    * ``colwise`` -> ColwiseParallel, ``rowwise`` -> RowwiseParallel (Megatron MLP/attention);
    * ``embedding`` -> RowwiseParallel on the vocab-sharded table with a replicated output
      (the zoo adds positions to the full sequence, so under SP the unit's *output* is
      split along the sequence instead: a local slice, no communication);
    * ``output`` -> ColwiseParallel over the vocabulary, gathered to replicated logits (no
      loss parallelism: the zoo's loss takes full logits);
    * ``norm`` -> replicated; under SP a SequenceParallel region.

    Under SP a *region* is the top-level child holding colwise/rowwise modules
    (``attention``, ``mlp``, ``moe``): its input is all-gathered along the sequence
    (PrepareModuleInput) and, when its rowwise linears are its direct children, they
    reduce-scatter back to sequence shards. A region whose rowwise linears sit deeper
    (MoE experts see routed tokens, not the sequence) all-reduces inside and slices its
    output instead. Any other parameterised module in a SP unit runs on sequence shards
    as a SequenceParallel module so its replicated weights get all-reduced gradients.
    Every style hands plain local tensors to the next module (``use_local_output``).
    """
    spec = unit.tp_plan()
    sp = sequence_parallel
    regions: dict[str, bool] = {}
    for fqn, style in spec.items():
        if style == "experts":
            # Routed experts see routed tokens, not the sequence: their region gathers its
            # input and splits its output (ExpertParallel all-reduces the experts' output).
            regions[fqn.partition(".")[0]] = False
        elif style in ("colwise", "rowwise"):
            root, _, rest = fqn.partition(".")
            if not rest:
                raise ConfigError("tp_plan", f"{type(unit).__name__} shards {fqn!r} at the top level; the "
                                  "runtime needs colwise/rowwise modules inside a child module")
            if style == "rowwise":
                regions[root] = regions.get(root, True) and "." not in rest
            else:
                regions.setdefault(root, True)
    plan: dict[str, object] = {}
    for fqn, style in spec.items():
        root = fqn.partition(".")[0]
        if style == "colwise":
            plan[fqn] = ColwiseParallel()
        elif style == "rowwise":
            plan[fqn] = RowwiseParallel(output_layouts=Shard(1)) if sp and regions[root] else RowwiseParallel()
        elif style == "norm":
            if sp:
                plan[fqn] = SequenceParallel(use_local_output=True)
        elif style == "embedding":
            plan[fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == "output":
            plan[fqn] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                        output_layouts=Replicate())
        elif style == "experts":
            continue   # sharded by apply_expert_parallel, over the expert mesh
        elif style == "head_shared":
            plan[fqn] = SumGradientOverRanks()
        else:
            raise ConfigError("tp_plan", f"{type(unit).__name__}.{fqn}: unknown style {style!r}")
    own = None
    if sp:
        is_embedding = any(s == "embedding" for s in spec.values())
        if is_embedding:
            own = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                      use_local_output=True)
        for root, direct in regions.items():
            if direct:
                plan[root] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
            else:
                plan[root] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        if not is_embedding:
            for name, mod in unit.named_modules():
                if (name and name not in spec and name.partition(".")[0] not in regions
                        and any(True for _ in mod.parameters(recurse=False))):
                    plan[name] = SequenceParallel(use_local_output=True)
    return plan, own


class SumGradientOverRanks(ParallelStyle):
    """For a module whose input every tensor-parallel rank computes in full and whose output
    each rank's share of the heads reads: the input's gradient is partial on every rank, so
    it is all-reduced over the mesh (the input is treated as a DTensor that is Replicate in
    forward and Partial in backward)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre(_m, args):
            x = args[0]
            return (DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                    .to_local(grad_placements=[Partial()]),) + tuple(args[1:])
        module.register_forward_pre_hook(pre)
        return module


def apply_expert_parallel(unit: nn.Module, experts_mesh: DeviceMesh) -> None:
    """Shard the unit's routed experts over the ("ep", "tp") mesh and exchange their tokens
    by all-to-all over "ep" (:class:`autoplan.runtime.experts.ExpertParallel`)."""
    from autoplan.runtime.experts import ExpertParallel, expert_modules
    for experts in expert_modules([unit]):
        parallelize_module(experts, experts_mesh, ExpertParallel())


def apply_tensor_parallel(unit: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    if sequence_parallel and not isinstance(unit, SEQUENCE_PARALLEL_UNITS):
        raise ConfigError("sequence_parallel", f"is not supported for {type(unit).__name__} units",
                          "set sequence_parallel to false")
    plan, own = tensor_parallel_styles(unit, sequence_parallel)
    if plan:
        parallelize_module(unit, tp_mesh, plan)
    if own is not None:
        parallelize_module(unit, tp_mesh, own)


# ------------------------------------------------------------------------ recompute
def _checkpoint_forward(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant torch.utils.checkpoint).

    The instance's ``forward`` is wrapped rather than the module replaced by a
    CheckpointWrapper, so parameter names stay those of the model (checkpoints written
    with and without recomputation are interchangeable) and the hooks DTensor and FSDP
    put on the module keep running once, outside the recomputed region."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(unit: nn.Module, mode: str) -> None:
    if mode == "full":
        _checkpoint_forward(unit)
    elif mode == "selective":
        core = getattr(getattr(unit, "attention", None), "core", None)
        if core is not None:   # embedding / head units have no attention core
            _checkpoint_forward(core)
    elif mode != "none":
        raise ConfigError("recompute", f"unknown mode {mode!r}")


# ------------------------------------------------------------------------- modules
class StageModule(nn.Module):
    """One pipeline stage: units ``start..end`` run in order. Units are registered under
    their model index (``layers.<i>``) so names match the whole model's."""

    def __init__(self, units: dict[int, nn.Module], autocast_dtype: torch.dtype | None = None,
                 device_type: str = "cpu"):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): units[i] for i in sorted(units)})
        self.autocast_dtype = autocast_dtype
        self.device_type = device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = (torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            for unit in self.layers.values():
                x = unit(x)
        return x


class RankModel(nn.Module):
    """Every unit this rank holds (across its virtual stages), under the model's names:
    what the optimizer and checkpoints see. Its forward is never called; the stage
    modules that share these units are."""

    def __init__(self, units: dict[int, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): units[i] for i in sorted(units)})


# ---------------------------------------------------------------- data parallel / ZeRO
@dataclass(frozen=True)
class DataParallelChoice:
    """How the data-parallel dimension is realised for one plan."""

    wrapper: str
    """'none' (dp = 1), 'replicate' (FSDP-family replicate, ZeRO-0) or 'fully_shard' (FSDP2)."""
    reshard_after_forward: bool
    """FSDP2: free gathered parameters after each unit's forward (true ZeRO-3)."""
    note: str
    """One line for logs and the run record: what the plan's zero stage became."""


def data_parallel_choice(dp: int, zero: int, pp: int) -> DataParallelChoice:
    if dp == 1:
        return DataParallelChoice("none", False, "dp=1: no data parallelism (ZeRO has nothing to shard)")
    if zero == 0:
        # replicate_with_fsdp, not the older torch.distributed._composable.replicate, which
        # computes silently wrong gradients under pipelining, nor nn.parallel.DDP, whose
        # reducer asserts on the second step of interleaved/zero-bubble schedules.
        return DataParallelChoice("replicate", False, "ZeRO-0: replicate (FSDP-family all-reduce)")
    if zero in (1, 2):
        return DataParallelChoice("fully_shard", False,
                                  f"ZeRO-{zero}: approximated by FSDP2 with reshard_after_forward=False "
                                  "(optimizer states and gradients sharded; parameters stay gathered "
                                  "from forward to backward)")
    if pp > 1:
        # FSDP2 with reshard_after_forward=True under pipelining computes silently wrong
        # gradients with the split-backward (zero-bubble) schedules; torchtitan never
        # reshards after forward under PP, and neither do we, for every schedule.
        return DataParallelChoice("fully_shard", False,
                                  "ZeRO-3 under pipelining: FSDP2 with reshard_after_forward=False "
                                  "(resharded after each stage's backward)")
    return DataParallelChoice("fully_shard", True, "ZeRO-3: FSDP2 with reshard_after_forward=True")


def apply_data_parallel(stage: StageModule, dp_mesh: DeviceMesh, choice: DataParallelChoice,
                        mp_policy=None, expert_dp_mesh: DeviceMesh | None = None) -> None:
    """Wrap every unit (and the stage, as root) for data parallelism over ``dp_mesh``. With
    ``expert_dp_mesh``, routed experts are wrapped first, over the ranks holding the same
    experts (see :mod:`autoplan.runtime.experts` for how their gradients are averaged)."""
    if choice.wrapper == "none":
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = mp_policy or MixedPrecisionPolicy()
    if choice.wrapper == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        wrap = lambda m, mesh: replicate(m, mesh=mesh, mp_policy=mp)  # noqa: E731
    else:
        wrap = lambda m, mesh: fully_shard(m, mesh=mesh, reshard_after_forward=choice.reshard_after_forward,  # noqa: E731
                                           mp_policy=mp)
    if expert_dp_mesh is not None:
        from autoplan.runtime.experts import expert_modules
        for experts in expert_modules(stage.layers.values()):
            wrap(experts, expert_dp_mesh)
    if choice.wrapper == "replicate":
        for unit in stage.layers.values():
            wrap(unit, dp_mesh)
        wrap(stage, dp_mesh)
        return
    for unit in stage.layers.values():
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=choice.reshard_after_forward, mp_policy=mp)
    # The stage is the FSDP root (it holds no parameters of its own).
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=choice.reshard_after_forward, mp_policy=mp)
