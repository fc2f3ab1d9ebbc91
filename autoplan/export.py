"""Export a plan to the configuration of a training framework a user already runs.

    autoplan export plan.json --to megatron   --model gpt3-13b   # Megatron-LM command-line flags
    autoplan export plan.json --to deepspeed                     # DeepSpeed config JSON
    autoplan export plan.json --to torchtitan --model llama3-8b  # torchtitan TOML job config

Each target is checked against what that framework can express. A plan the target
cannot run as planned (per-stage tensor-parallel degrees on a mixed cluster, a layer
split its pipeline cannot reproduce, a schedule it does not implement, ...) is refused
with a :class:`~autoplan.errors.ConfigError` that says why and what to do instead:
an exported config that silently runs a different plan would make the prediction a lie.
Where a target runs something strictly equivalent or better under another name, the
export says so in a note (and in a comment inside the file).

The flag and key names are the ones the projects document: Megatron-LM's
``megatron/training/arguments.py``, DeepSpeed's "config JSON" documentation and
torchtitan's ``torchtitan/config/job_config.py``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from autoplan.errors import ConfigError, one_line
from autoplan.plan import Plan

if TYPE_CHECKING:
    from autoplan.models.spec import ModelSpec

TARGETS = ("megatron", "deepspeed", "torchtitan")

SUFFIXES = {"megatron": ".args", "deepspeed": ".json", "torchtitan": ".toml"}
"""File suffix a target's output is written with by default."""

TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                        "zero-bubble": "InterleavedZeroBubble"}
"""autoplan schedule -> the schedule class name torchtitan looks up (torch.distributed.pipelining's
``get_schedule_class`` names)."""

TORCHTITAN_FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"),
                      "llama3-405b": ("llama3", "405B")}
"""Zoo presets torchtitan ships as ``[model] name``/``flavor``; other models need a TrainSpec."""

_TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class Exported:
    """One exported configuration."""

    target: str
    """'megatron', 'deepspeed' or 'torchtitan'."""
    text: str
    """The file content, ready to write."""
    notes: tuple[str, ...] = ()
    """What the user must know: substitutions made, rank placement, parts set in code."""

    @property
    def suffix(self) -> str:
        return SUFFIXES[self.target]


def export(plan: Plan, target: str, model: "ModelSpec | None" = None) -> Exported:
    """The configuration of ``target`` that runs ``plan``. ``model`` adds the model-shape
    settings and lets the layer split be read from the model's units; without it the plan's
    units are taken to be [embedding, blocks..., head], the zoo's layout for language models."""
    if target not in TARGETS:
        raise ConfigError("to", f"{target!r} is not an export target", f"choose one of {', '.join(TARGETS)}")
    if model is not None:
        _check_model(plan, model)
    return {"megatron": to_megatron, "deepspeed": to_deepspeed, "torchtitan": to_torchtitan}[target](plan, model)


# ----------------------------------------------------------------------------- shared analysis
@dataclass(frozen=True)
class _Layout:
    """How the plan's stages map onto a language model's transformer blocks."""

    blocks: tuple[int, ...]
    """Transformer blocks in each stage, in stage order."""
    first_block: tuple[int, ...]
    """Index (0-based, among blocks) of each stage's first block."""


def _check_model(plan: Plan, model: "ModelSpec") -> None:
    if plan.model and model.name and plan.model != model.name:
        raise ConfigError("model", f"the plan was made for {plan.model!r}, not {model.name!r}",
                          "export with the model the plan was searched for")
    if plan.seq_len and model.seq_len and plan.seq_len != model.seq_len:
        raise ConfigError("seq_len", f"the plan was made for sequence length {plan.seq_len}, the model "
                          f"has {model.seq_len}", f"pass --seq-len {plan.seq_len}")
    plan.validate(model)


def _layout(plan: Plan, model: "ModelSpec | None") -> _Layout:
    """Blocks per stage; every stage must hold at least one transformer block, because the
    frameworks place the embedding with the first block and the head with the last."""
    if model is not None:
        kinds = [l.kind for l in model.layers]
    else:
        n = plan.stages[-1].end
        kinds = ["embedding"] + ["block"] * (n - 2) + ["head"]
    if len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head":
        raise ConfigError("model", "the model's units are not [embedding, blocks..., head]",
                          "only language models split this way can be exported")
    blocks, first = [], []
    for i, s in enumerate(plan.stages):
        inner = [k for k in kinds[s.start:s.end] if k not in ("embedding", "head")]
        if any(k != "block" for k in inner):
            raise ConfigError(f"stages[{i}]", f"holds units of kind {sorted(set(inner) - {'block'})}",
                              "only transformer blocks can be exported")
        if not inner:
            raise ConfigError(f"stages[{i}]", f"holds no transformer block (units {s.start}..{s.end})",
                              "the target puts the embedding with the first block and the head with the "
                              "last; re-plan so that every stage has a block")
        blocks.append(len(inner))
        first.append(max(0, s.start - 1))
    return _Layout(blocks=tuple(blocks), first_block=tuple(first))


def _uniform_tp(plan: Plan, target_name: str) -> int:
    tps = [g.tp for g in plan.groups]
    if len(set(tps)) > 1:
        raise ConfigError("groups[].tp", f"the plan uses a different tensor-parallel degree per pipeline "
                          f"stage ({'/'.join(map(str, tps))}), which {target_name} cannot express "
                          "(one tensor-parallel size for the whole job)",
                          "search with the tensor-parallel degree fixed, or run the plan with `autoplan run`")
    return tps[0]


def _uniform_recompute(plan: Plan, target_name: str) -> str:
    mode = plan.recompute
    if mode == "mixed":
        per = "/".join(s.recompute for s in plan.stages)
        raise ConfigError("stages[].recompute", f"the plan recomputes differently per stage ({per}), which "
                          f"{target_name} cannot express (one setting for the whole model)",
                          "re-plan with one recompute mode, or run the plan with `autoplan run`")
    return mode


def _placement_note(plan: Plan, framework: str) -> str | None:
    """Megatron-LM, torchtitan and DeepSpeed all number ranks tensor-parallel fastest, then
    data-parallel, then pipeline. When the plan placed its groups differently (a mixed cluster
    puts stages on the devices that suit them), the launcher must start ranks in that order."""
    order = [r for g in plan.groups for r in g.ranks]
    if order == list(range(len(order))):
        return None
    pairs = ", ".join(f"{i}->{r}" for i, r in enumerate(order))
    return (f"{framework} numbers ranks tensor-parallel fastest, then data-parallel, then pipeline; this "
            f"plan places them on other cluster ranks, so launch {framework} rank i on cluster rank "
            f"order[i] (e.g. by ordering hosts and CUDA_VISIBLE_DEVICES): {pairs}")


def _transformer_config(model: "ModelSpec", target_name: str):
    from autoplan.models.config import TransformerConfig
    cfg = model.config
    if not isinstance(cfg, TransformerConfig):
        kind = type(cfg).__name__ if cfg is not None else "a traced module"
        raise ConfigError("model", f"{model.name} is {kind}, not a transformer language model "
                          f"{target_name} can build", "export --to deepspeed, which needs no model shape")
    return cfg


def _seq_len(plan: Plan, model: "ModelSpec | None") -> int:
    return plan.seq_len or (model.seq_len if model is not None else 0)


# ----------------------------------------------------------------------------- Megatron-LM
def megatron_args(plan: Plan, model: "ModelSpec | None" = None) -> tuple[list[str], list[str]]:
    """(argv, notes): the Megatron-LM flags that run ``plan``."""
    name = "Megatron-LM"
    tp = _uniform_tp(plan, name)
    pp, v = plan.pp, plan.virtual_stages
    layout = _layout(plan, model)
    recompute = _uniform_recompute(plan, name)
    notes: list[str] = []
    if pp > 1 and plan.schedule == "zero-bubble":
        raise ConfigError("schedule", "Megatron-LM has no zero-bubble pipeline schedule",
                          "export --to torchtitan (InterleavedZeroBubble), or re-plan with 1f1b")
    if pp > 1 and plan.schedule == "gpipe":
        raise ConfigError("schedule", "Megatron-LM runs 1F1B, not GPipe",
                          "re-plan with schedule '1f1b' (same bubble, less activation memory)")
    if pp == 1 and plan.schedule == "gpipe" and plan.num_micro_batches > 1:
        notes.append("with one pipeline stage Megatron-LM runs forward and backward per micro-batch, "
                     "which holds less activation memory than the plan's GPipe order")

    argv: list[str] = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    blocks = layout.blocks
    if v > 1:
        if pp < 2:
            raise ConfigError("virtual_stages", "Megatron-LM's interleaved schedule needs at least 2 "
                              "pipeline stages", "set virtual_stages to 1")
        if len(set(blocks)) > 1:
            raise ConfigError("stages", f"the interleaved schedule splits the blocks unevenly ({_counts(blocks)}); "
                              "Megatron-LM's --num-layers-per-virtual-pipeline-stage needs the same count in "
                              "every virtual stage", "re-plan with an even split or export --to torchtitan")
        if plan.num_micro_batches % pp:
            raise ConfigError("num_micro_batches", f"{plan.num_micro_batches} is not a multiple of pp={pp}, "
                              "which Megatron-LM's interleaved schedule requires")
        argv += ["--num-layers-per-virtual-pipeline-stage", str(blocks[0])]
    elif pp > 1 and len(set(blocks)) > 1:
        # Megatron splits evenly, except that the first and last stage may be given their own
        # counts (--decoder-first/last-pipeline-num-layers); anything else is refused.
        middle = blocks[1:-1]
        if len(set(middle)) > 1:
            raise ConfigError("stages", f"the layer split {_counts(blocks)} is uneven in the middle stages; "
                              "Megatron-LM splits blocks evenly and only lets the first and last stage differ",
                              "export --to torchtitan (arbitrary split points), or re-plan with an even split")
        even = middle[0] if middle else None
        if even is None:
            # pp == 2: fixing the first stage leaves the rest to the last, so any split works.
            argv += ["--decoder-first-pipeline-num-layers", str(blocks[0])]
        else:
            if blocks[0] != even:
                argv += ["--decoder-first-pipeline-num-layers", str(blocks[0])]
            if blocks[-1] != even:
                argv += ["--decoder-last-pipeline-num-layers", str(blocks[-1])]
    if plan.sequence_parallel and tp > 1:
        argv.append("--sequence-parallel")
    argv += ["--micro-batch-size", str(plan.micro_batch), "--global-batch-size", str(plan.global_batch)]
    if recompute == "selective":
        argv += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        # "full" keeps only each unit's input: uniform recompute of one layer at a time.
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if plan.zero == 1:
        argv.append("--use-distributed-optimizer")
    elif plan.zero == 2:
        raise ConfigError("zero", "Megatron-LM has no ZeRO-2: its distributed optimizer shards optimizer "
                          "states but keeps a full gradient buffer",
                          "re-plan with zero 1 (--use-distributed-optimizer) or export --to deepspeed / torchtitan")
    elif plan.zero == 3:
        if pp > 1:
            raise ConfigError("zero", "Megatron-LM's ZeRO-3 (--use-torch-fsdp2) does not work with pipeline "
                              "parallelism", "export --to torchtitan, or re-plan without pipeline stages")
        argv.append("--use-torch-fsdp2")
    if plan.dtype == "bf16":
        argv.append("--bf16")
    elif plan.dtype == "fp16":
        argv.append("--fp16")
    if model is not None:
        argv += _megatron_model_args(plan, model, notes)
    note = _placement_note(plan, name)
    if note:
        notes.append(note)
    return argv, notes


def _megatron_model_args(plan: Plan, model: "ModelSpec", notes: list[str]) -> list[str]:
    cfg = _transformer_config(model, "Megatron-LM")
    seq = _seq_len(plan, model)
    out = ["--num-layers", str(cfg.layers), "--hidden-size", str(cfg.hidden),
           "--num-attention-heads", str(cfg.heads), "--seq-length", str(seq),
           "--max-position-embeddings", str(max(cfg.max_positions or seq, seq)),
           "--ffn-hidden-size", str(cfg.ffn_hidden)]
    if cfg.kv_heads != cfg.heads:
        out += ["--group-query-attention", "--num-query-groups", str(cfg.kv_heads)]
    if cfg.head_dim * cfg.heads != cfg.hidden:
        out += ["--kv-channels", str(cfg.head_dim)]
    if cfg.norm == "rmsnorm":
        out += ["--normalization", "RMSNorm"]
    if cfg.mlp == "swiglu":
        out.append("--swiglu")
    elif cfg.mlp == "relu":
        raise ConfigError("model", f"{model.name} uses a ReLU MLP, which Megatron-LM's GPT model does not offer")
    if cfg.position == "rope":
        out += ["--position-embedding-type", "rope"]
    if not cfg.bias:
        out.append("--disable-bias-linear")
    if not cfg.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if cfg.arch == "moe":
        out += ["--num-experts", str(cfg.num_experts), "--moe-router-topk", str(cfg.top_k)]
    script = "pretrain_bert.py" if cfg.arch == "bert" else "pretrain_gpt.py"
    notes.append(f"model {model.name}: run Megatron-LM's {script}; its vocabulary ({cfg.vocab}) comes from the "
                 "tokenizer arguments you add (e.g. --tokenizer-type NullTokenizer --vocab-size "
                 f"{cfg.vocab} for synthetic data)")
    return out


def to_megatron(plan: Plan, model: "ModelSpec | None" = None) -> Exported:
    argv, notes = megatron_args(plan, model)
    world = plan.num_gpus
    lines = [f"# Megatron-LM arguments for the autoplan plan: {plan.describe()}",
             f"# {world} GPUs = tensor {plan.tp} x pipeline {plan.pp} x data {plan.dp}; Megatron-LM derives "
             "the data-parallel size from the world size.",
             "# Use: torchrun --nproc-per-node <gpus per node> --nnodes <nodes> pretrain_gpt.py "
             "$(grep -v '^#' THIS_FILE) <data, tokenizer, optimizer and logging arguments>"]
    # Notes quote names from the plan and the model's config: one line each, so a line
    # break in a name cannot start a flag or a section of its own.
    lines += [f"# note: {one_line(n)}" for n in notes]
    # One flag (with its value) per line so the file diffs and reads well.
    i = 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{argv[i]} {argv[i + 1]}")
            i += 2
        else:
            lines.append(argv[i])
            i += 1
    return Exported("megatron", "\n".join(lines) + "\n", tuple(notes))


def _counts(blocks: Iterable[int]) -> str:
    return "[" + ", ".join(map(str, blocks)) + "]"


# ----------------------------------------------------------------------------- DeepSpeed
def deepspeed_config(plan: Plan, model: "ModelSpec | None" = None) -> tuple[dict, list[str]]:
    """(config, notes): a DeepSpeed config JSON (as a dict) that runs ``plan``."""
    name = "DeepSpeed"
    tp = _uniform_tp(plan, name)
    if tp > 1:
        raise ConfigError("groups[].tp", f"the plan uses tensor parallelism (tp={tp}), which is not a "
                          "DeepSpeed config setting: it comes from the model code (Megatron-DeepSpeed)",
                          "export --to megatron for the tensor-parallel part, or re-plan with tp=1")
    recompute = _uniform_recompute(plan, name)
    if recompute == "selective":
        raise ConfigError("stages[].recompute", "DeepSpeed's activation checkpointing recomputes whole layers; "
                          "it has no selective (attention-only) recomputation",
                          "re-plan with recompute 'full' or 'none', or export --to megatron / torchtitan")
    if plan.dtype == "fp32":
        dtype_cfg: dict = {}
    else:
        dtype_cfg = {plan.dtype: {"enabled": True}}
    pp = plan.pp
    notes: list[str] = []
    if pp > 1:
        if plan.zero >= 2:
            raise ConfigError("zero", f"DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only, the plan "
                              f"uses ZeRO-{plan.zero} with {pp} pipeline stages",
                              "re-plan with zero <= 1, or export --to torchtitan")
        if plan.schedule != "1f1b":
            raise ConfigError("schedule", f"DeepSpeed's pipeline engine runs its own 1F1B-style schedule, not "
                              f"{plan.schedule!r}", "re-plan with schedule '1f1b', or export --to torchtitan")
    cfg: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.num_micro_batches,
        **dtype_cfg,
        "zero_optimization": {"stage": plan.zero, "overlap_comm": True, "contiguous_gradients": True},
    }
    if recompute == "full":
        # Settings of deepspeed.checkpointing; the model (or PipelineModule) decides where to
        # checkpoint, here every layer.
        cfg["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False,
                                           "number_checkpoints": None, "synchronize_checkpoint_boundary": False,
                                           "profile": False}
    explain = [f"autoplan plan: {plan.describe()}",
               "tensor parallelism: none (DeepSpeed has no config key for it; use the megatron export "
               "for tensor-parallel plans)"]
    if pp > 1:
        units = [s.num_layers for s in plan.stages]
        parts = [0]
        for s in plan.stages:
            parts.append(s.end)
        uniform = _ds_partition_uniform(parts[-1], pp) == parts
        method = "uniform" if uniform else "custom"
        ckpt = ", activation_checkpoint_interval=1" if recompute == "full" else ""
        how = ("partition_method='uniform'" if uniform
               else "layers cut at autoplan_pipeline.stage_boundaries")
        explain.append(f"pipeline stages: {pp} (not a config key): build the model as deepspeed.pipe."
                       f"PipelineModule(layers, num_stages={pp}{ckpt}) with {how}")
        cfg["autoplan_pipeline"] = {"num_stages": pp, "partition_method": method, "stage_boundaries": parts,
                                    "units_per_stage": units}
        if not uniform:
            notes.append(f"DeepSpeed's uniform partition of {parts[-1]} layers differs from the plan's split "
                         f"{units}: give PipelineModule those boundaries ({parts})")
    if recompute == "full":
        explain.append("activation checkpointing: wrap every layer with deepspeed.checkpointing.checkpoint "
                       "(or set PipelineModule's activation_checkpoint_interval=1)")
    note = _placement_note(plan, name)
    if note:
        notes.append(note)
    # DeepSpeed ignores top-level keys it does not know, so the explanation travels with the file.
    cfg["comment"] = "; ".join(explain + notes)
    return cfg, notes


def _ds_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries DeepSpeed's ``partition_uniform`` (deepspeed/runtime/utils.py) gives: equal
    chunks, the remainder spread one each over the first parts."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def to_deepspeed(plan: Plan, model: "ModelSpec | None" = None) -> Exported:
    cfg, notes = deepspeed_config(plan, model)
    return Exported("deepspeed", json.dumps(cfg, indent=2) + "\n", tuple(notes))


# ----------------------------------------------------------------------------- torchtitan
def torchtitan_config(plan: Plan, model: "ModelSpec | None" = None) -> tuple[dict, list[str], dict]:
    """(sections, notes, comments): the torchtitan job config as {section: {key: value}},
    and per-key comments ``{(section, key): text}`` for the TOML writer."""
    name = "torchtitan"
    tp = _uniform_tp(plan, name)
    recompute = _uniform_recompute(plan, name)
    pp, dp, v = plan.pp, plan.dp, plan.virtual_stages
    notes: list[str] = []
    comments: dict[tuple[str, str], str] = {}
    if plan.dtype not in _TORCH_DTYPES:
        raise ConfigError("dtype", f"torchtitan trains in bfloat16 or float32, not {plan.dtype}",
                          "re-plan with dtype bf16")
    seq = _seq_len(plan, model)
    if not seq:
        raise ConfigError("seq_len", "the plan does not record its sequence length", "pass --model")
    if model is not None:
        _transformer_config(model, name)
    model_name = plan.model or (model.name if model is not None else "")
    flavor = TORCHTITAN_FLAVORS.get(model_name)
    if flavor is not None and model is not None:
        from autoplan.models.presets import get_config
        if dataclasses.replace(model.config, seq_len=get_config(model_name).seq_len,
                               max_positions=None).resolved() != get_config(model_name):
            flavor = None  # the preset with changed shapes is not torchtitan's flavor any more
    if flavor is None:
        tt_name, tt_flavor = model_name or "custom", "custom"
        comments[("model", "name")] = (f"torchtitan ships no '{model_name or 'custom'}' model: register a "
                                       "TrainSpec with this name and flavor")
    else:
        tt_name, tt_flavor = flavor

    parallel: dict = {}
    if plan.zero == 0:
        parallel["data_parallel_replicate_degree"] = dp
        parallel["data_parallel_shard_degree"] = 1
    else:
        parallel["data_parallel_replicate_degree"] = 1
        parallel["data_parallel_shard_degree"] = dp
        if plan.zero == 3:
            parallel["fsdp_reshard_after_forward"] = "always"
        else:
            # FSDP2 that keeps parameters gathered from forward to backward is ZeRO-2.
            parallel["fsdp_reshard_after_forward"] = "never"
            if plan.zero == 1 and dp > 1:
                notes.append("FSDP2 has no optimizer-only sharding: the plan's ZeRO-1 runs as ZeRO-2 "
                             "(gradients sharded too), which moves the same bytes and holds less memory")
                comments[("parallelism", "fsdp_reshard_after_forward")] = "ZeRO-1 in the plan, run as ZeRO-2"
    parallel["tensor_parallel_degree"] = tp
    parallel["enable_async_tensor_parallel"] = False
    if tp > 1 and not plan.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards the sequence in norms and dropout "
                     "(sequence parallel), which the plan did not assume: same traffic, less memory")
    parallel["pipeline_parallel_degree"] = pp
    parallel["pipeline_parallel_schedule"] = TORCHTITAN_SCHEDULES[plan.schedule]
    if pp > 1:
        layout = _layout(plan, model)
        parallel["pipeline_parallel_microbatch_size"] = plan.micro_batch
        # Each later stage begins at its first transformer block (embedding and head stay with
        # the first and last stage); looped schedules place stage s on rank s % pp like autoplan.
        parallel["pipeline_parallel_split_points"] = [f"layers.{b}" for b in layout.first_block[1:]]
        comments[("parallelism", "pipeline_parallel_split_points")] = (
            f"blocks per stage: {_counts(layout.blocks)}" + (f" ({v} stages per rank)" if v > 1 else ""))
        if plan.schedule == "zero-bubble":
            comments[("parallelism", "pipeline_parallel_schedule")] = (
                "zero-bubble (ZB-H1): split input/weight gradients, one stage per rank")
        # With a pipeline the local batch is split into micro-batches inside one step.
        local_batch = plan.micro_batch * plan.num_micro_batches
    else:
        # Without a pipeline torchtitan accumulates gradients over global / (local * dp) steps.
        local_batch = plan.micro_batch
    training = {"local_batch_size": local_batch, "global_batch_size": plan.global_batch, "seq_len": seq,
                "mixed_precision_param": _TORCH_DTYPES[plan.dtype]}
    ac: dict = {"mode": recompute}
    if recompute == "selective":
        ac["selective_ac_option"] = "op"
        comments[("activation_checkpoint", "selective_ac_option")] = (
            "per-op selective recomputation: torchtitan's closest to recomputing the attention core")
    note = _placement_note(plan, name)
    if note:
        notes.append(note)
    sections = {"job": {"description": f"autoplan plan: {plan.describe()}"},
                "model": {"name": tt_name, "flavor": tt_flavor},
                "training": training, "parallelism": parallel, "activation_checkpoint": ac}
    return sections, notes, comments


def to_torchtitan(plan: Plan, model: "ModelSpec | None" = None) -> Exported:
    sections, notes, comments = torchtitan_config(plan, model)
    lines = ["# torchtitan job config exported by autoplan",
             f"# {plan.num_gpus} GPUs: launch with NGPU={plan.num_gpus} (or torchrun across nodes) and "
             "add dataset, tokenizer, optimizer and step settings."]
    lines += [f"# note: {one_line(n)}" for n in notes]
    lines.append(toml_dumps(sections, comments))
    return Exported("torchtitan", "\n".join(lines), tuple(notes))


def toml_dumps(sections: dict, comments: dict | None = None) -> str:
    """TOML for ``{section: {key: value}}`` with str, bool, int, float and lists of those
    (written by hand so that exporting needs no TOML library)."""
    comments = comments or {}
    out: list[str] = []
    for section, table in sections.items():
        out.append(f"\n[{section}]")
        for key, value in table.items():
            c = comments.get((section, key))
            if c:
                out.append(f"# {one_line(c)}")
            out.append(f"{key} = {_toml_value(value, f'{section}.{key}')}")
    return "\n".join(out).lstrip("\n") + "\n"


def _toml_value(v, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            raise ConfigError(where, f"{v} cannot be written to TOML")
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"')
        escaped = "".join(c if c >= " " or c == "\t" else f"\\u{ord(c):04x}" for c in escaped)
        return f'"{escaped}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x, where) for x in v) + "]"
    raise ConfigError(where, f"cannot write a {type(v).__name__} to TOML")
