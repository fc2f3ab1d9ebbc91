"""Export a plan to the configuration of a training engine a user already runs.

    autoplan export plan.json --to megatron   --model llama3-8b --cluster c.json   # Megatron-LM launch script
    autoplan export plan.json --to deepspeed  --cluster c.json                     # DeepSpeed config JSON
    autoplan export plan.json --to torchtitan --model llama3-8b                    # torchtitan 0.3 Python config
    autoplan export plan.json --to torchtitan --model llama3-8b --engine-version 0.2   # torchtitan 0.2 TOML

Each target is checked against what that engine can express (:mod:`autoplan.engines`,
the same check ``search --for`` uses). A plan the engine cannot run as planned is refused
with a :class:`~autoplan.errors.ConfigError` naming the plan field and the nearest plan it
can run: an exported config that silently runs a different plan would make the
prediction a lie. Where an engine runs the same thing under another name, the export
says so in a note (and in a comment inside the file).

The names are the engines' own, read from their code: Megatron-LM's
``megatron/training/arguments.py`` at the commit in ``autoplan/data/engines/megatron-lm.json``
(every export is checked against that table's flags and ``validate_args`` rules by
:mod:`autoplan.megatron_rules`), DeepSpeed 0.19's ``deepspeed/runtime/config.py``, and
torchtitan's ``torchtitan/config`` (0.3: Python ``Trainer.Config`` functions; 0.2: TOML).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from autoplan.engines import (ENGINES, MEGATRON_COMMIT, all_bf16, blocks_per_stage, check, get_engine,
                              megatron_default_split, preset_name)
from autoplan.errors import ConfigError, one_line
from autoplan.plan import Plan

if TYPE_CHECKING:
    from autoplan.cluster import Cluster
    from autoplan.models.spec import ModelSpec

TARGETS = ("megatron", "deepspeed", "torchtitan")

TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                        "zero-bubble": "InterleavedZeroBubble"}
"""autoplan schedule -> the schedule class name torchtitan looks up (torch.distributed.pipelining's
``get_schedule_class`` names); zero-bubble (ZB-H1) is InterleavedZeroBubble with one stage per rank."""

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
    suffix: str = ""
    """File suffix the content is written with by default ('.sh', '.json', '.py', '.toml')."""
    engine_version: str = ""
    """The engine release the file is written for."""


def export(plan: Plan, target: str, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
           engine_version: str | None = None) -> Exported:
    """The configuration of ``target`` that runs ``plan``.

    ``model`` adds the model's settings (shapes, rotary base and scaling, norm epsilon,
    biases, ...) and lets the layer split be read from its units; without it the plan's
    units are taken to be [embedding, blocks..., head], the zoo's layout for language
    models. ``cluster`` picks the dtype the devices have (no bf16 on V100 or T4: fp16 with
    loss scaling) and is checked against the plan. ``engine_version`` picks the engine
    release (torchtitan: '0.3', the default, or '0.2')."""
    if target not in TARGETS:
        raise ConfigError("to", f"{target!r} is not an export target", f"choose one of {', '.join(TARGETS)}")
    if plan.layouts is not None:
        # Engines take one tensor-parallel recipe per model family, not a layout per operator.
        raise ConfigError("layouts", f"per-operator layouts cannot be expressed as a {target} configuration",
                          "run the plan with autoplan.runtime.operators, or export a plan searched without --layouts")
    engine = get_engine(target, engine_version)
    if model is not None:
        _check_model(plan, model)
    if cluster is not None:
        plan.validate(model, cluster)
    original, plan = plan, _device_dtype(plan, cluster, engine.name)
    check(plan, engine, model, cluster)
    if target == "megatron":
        return to_megatron(plan, model, cluster, original)
    if target == "deepspeed":
        return to_deepspeed(plan, model, cluster, original)
    if engine.version.startswith("0.2"):
        return to_torchtitan_toml(plan, model, cluster, original)
    return to_torchtitan_python(plan, model, cluster, original)


# ----------------------------------------------------------------------------- shared analysis
def _check_model(plan: Plan, model: "ModelSpec") -> None:
    if plan.model and model.name and plan.model != model.name:
        raise ConfigError("model", f"the plan was made for {plan.model!r}, not {model.name!r}",
                          "export with the model the plan was searched for")
    if plan.seq_len and model.seq_len and plan.seq_len != model.seq_len:
        raise ConfigError("seq_len", f"the plan was made for sequence length {plan.seq_len}, the model "
                          f"has {model.seq_len}", f"pass --seq-len {plan.seq_len}")
    plan.validate(model)


def _device_dtype(plan: Plan, cluster: "Cluster | None", target: str) -> Plan:
    """The plan in the dtype the cluster's devices have: bf16 becomes fp16 (with dynamic loss
    scaling) where a device has no bf16 units, for engines that train in fp16 (the cost model
    already timed such devices at their fp16 rate and the bytes are the same)."""
    from dataclasses import replace
    if cluster is None or plan.dtype != "bf16" or all_bf16(cluster):
        return plan
    if "fp16" in ENGINES[target].dtypes:
        return replace(plan, dtype="fp16")
    return plan


def _dtype_note(original: Plan, plan: Plan) -> list[str]:
    if original.dtype == plan.dtype:
        return []
    return [f"the cluster has devices without bf16 units (V100, T4): training in fp16 with dynamic loss "
            f"scaling instead of the plan's {original.dtype}"]


def _layout_kinds(plan: Plan, model: "ModelSpec | None") -> list[str]:
    if model is not None:
        kinds = [l.kind for l in model.layers]
    else:
        n = plan.stages[-1].end
        kinds = ["embedding"] + ["block"] * (n - 2) + ["head"]
    if len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head":
        raise ConfigError("model", "the model's units are not [embedding, blocks..., head]",
                          "only language models split this way can be exported")
    return kinds


def _stage_units(plan: Plan, model: "ModelSpec | None") -> list[list[str]]:
    """Per stage, its units as 'embedding', 'block:<i>' (i counts blocks from 0) or 'head'."""
    kinds = _layout_kinds(plan, model)
    names, b = [], 0
    for k in kinds:
        if k == "block":
            names.append(f"block:{b}")
            b += 1
        elif k in ("embedding", "head"):
            names.append(k)
        else:
            raise ConfigError("model", f"has units of kind {k!r}", "only transformer language models can be exported")
    return [names[s.start:s.end] for s in plan.stages]


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


def _comment(text: str) -> str:
    """``text`` as one comment line: names from the plan or the model's config may hold
    line breaks, which must not start a flag or a section of their own."""
    return one_line(text)


def _counts(blocks: Iterable[int]) -> str:
    return "[" + ", ".join(map(str, blocks)) + "]"


# ----------------------------------------------------------------------------- Megatron-LM
def megatron_args(plan: Plan, model: "ModelSpec | None" = None) -> tuple[list[str], dict[str, str | None], list[str]]:
    """(argv, env, notes): the Megatron-LM flags that run ``plan``, and the environment they
    need (a value of None means the variable must be unset)."""
    name = "Megatron-LM"
    check(plan, "megatron", model)
    tp, pp, v = plan.tp, plan.pp, plan.virtual_stages
    notes: list[str] = []
    env: dict[str, str | None] = {}
    if pp == 1 and plan.schedule == "gpipe" and plan.num_micro_batches > 1:
        notes.append("with one pipeline stage Megatron-LM runs forward and backward per micro-batch, "
                     "which holds less activation memory than the plan's GPipe order")

    argv: list[str] = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    argv += _megatron_expert_parallel_args(plan, model, tp)
    if pp > 1:
        units = _stage_units(plan, model)
        if megatron_default_split(plan, model):
            if v > 1:
                argv += ["--num-layers-per-virtual-pipeline-stage", str(blocks_per_stage(plan, model)[0])]
        else:
            # Any split, virtual stages included: the stages in model order (stage s on rank
            # s % pp, as in autoplan), E = embedding, t = a transformer block, L = output and loss.
            argv += ["--pipeline-model-parallel-layout", megatron_layout(units)]
            notes.append(f"blocks per stage {_counts(blocks_per_stage(plan, model))}: set with "
                         "--pipeline-model-parallel-layout")
    if plan.sequence_parallel and tp > 1:
        argv.append("--sequence-parallel")
    if plan.cp > 1:
        # Megatron-Core's exchange names are the plan's: p2p, all_gather, a2a.
        argv += ["--context-parallel-size", str(plan.cp), "--cp-comm-type", plan.cp_comm]
        notes.append("Megatron-LM runs context parallelism in Transformer Engine's attention "
                     "(--transformer-impl transformer_engine)")
    argv += ["--micro-batch-size", str(plan.micro_batch), "--global-batch-size", str(plan.global_batch)]
    recompute = plan.recompute
    if recompute == "selective":
        argv += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        # "full" keeps only each unit's input: uniform recompute of one layer at a time.
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if plan.zero == 1:
        argv.append("--use-distributed-optimizer")
    elif plan.zero == 3:
        # torch FSDP2 cannot use the fused weight-gradient accumulation into main_grad buffers,
        # and wants several CUDA connections (validate_args refuses CUDA_DEVICE_MAX_CONNECTIONS=1).
        argv += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = None
    if (tp > 1 or plan.cp > 1) and plan.zero != 3:
        # Tensor (and sequence) and context parallel communication must be queued before the
        # compute it overlaps; Megatron-LM asserts this for GPUs before Blackwell.
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if plan.dtype == "bf16":
        argv.append("--bf16")
    elif plan.dtype == "fp16":
        # No --loss-scale: Megatron-LM then scales the loss dynamically.
        argv.append("--fp16")
    if model is not None:
        argv += _megatron_model_args(plan, model, notes)
    note = _placement_note(plan, name)
    if note:
        notes.append(note)
    return argv, env, notes


def megatron_layout(stage_units: list[list[str]]) -> str:
    """``--pipeline-model-parallel-layout``: stages separated by '|', E = embedding, t = a
    transformer block (runs written 't*N'), L = output layer and loss."""
    parts = []
    for units in stage_units:
        blocks = sum(1 for u in units if u.startswith("block:"))
        text = ("E" if "embedding" in units else "") + ("t" if blocks == 1 else f"t*{blocks}" if blocks else "") \
            + ("L" if "head" in units else "")
        parts.append(text)
    return "|".join(parts)


def _megatron_model_args(plan: Plan, model: "ModelSpec", notes: list[str]) -> list[str]:
    cfg = _transformer_config(model, "Megatron-LM")
    seq = _seq_len(plan, model)
    out = ["--num-layers", str(cfg.layers), "--hidden-size", str(cfg.hidden),
           "--num-attention-heads", str(cfg.heads), "--seq-length", str(seq),
           "--max-position-embeddings", str(max(cfg.max_positions or seq, seq)),
           "--ffn-hidden-size", str(cfg.ffn_hidden), "--vocab-size", str(cfg.vocab)]
    if cfg.kv_heads != cfg.heads:
        out += ["--group-query-attention", "--num-query-groups", str(cfg.kv_heads)]
    if cfg.head_dim * cfg.heads != cfg.hidden:
        out += ["--kv-channels", str(cfg.head_dim)]
    if cfg.norm == "rmsnorm":
        out += ["--normalization", "RMSNorm"]
    out += ["--norm-epsilon", repr(float(cfg.norm_eps))]
    if cfg.mlp == "swiglu":
        out.append("--swiglu")
    if cfg.position == "rope":
        out += ["--position-embedding-type", "rope", "--rotary-base", str(int(cfg.rope_theta))]
        if cfg.rope_theta != int(cfg.rope_theta):
            raise ConfigError("model.rope_theta", f"{cfg.rope_theta} is not an integer, which "
                              "Megatron-LM's --rotary-base needs")
        if cfg.rope_scaling_factor:
            out += ["--use-rope-scaling", "--rope-scaling-factor", repr(float(cfg.rope_scaling_factor))]
    if not cfg.bias:
        out.append("--disable-bias-linear")
        if cfg.qkv_bias:
            out.append("--add-qkv-bias")
    if not cfg.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    # The model's own dropout (Megatron-LM's default is 0.1; Llama and Mixtral train without).
    out += ["--attention-dropout", repr(float(cfg.dropout)), "--hidden-dropout", repr(float(cfg.dropout))]
    if cfg.arch == "moe":
        out += _megatron_moe_args(cfg, notes)
    if cfg.kv_lora_rank:
        out += _megatron_latent_attention_args(cfg)
    script = "pretrain_bert.py" if cfg.arch == "bert" else "pretrain_gpt.py"
    notes.append(f"model {model.name}: run Megatron-LM's {script}; --vocab-size {cfg.vocab} is read by "
                 "tokenizers without a vocabulary file (e.g. --tokenizer-type NullTokenizer), others bring "
                 "their own")
    return out


def _megatron_expert_parallel_args(plan: Plan, model: "ModelSpec | None", tp: int) -> list[str]:
    """Megatron-Core folds expert parallelism into data parallelism like autoplan; experts are
    tensor-parallel with the plan's tp (expert-tensor-parallel = tp, Megatron's default, made
    explicit)."""
    if plan.ep == 1 and (model is None or not model.num_experts):
        return []
    out = ["--expert-model-parallel-size", str(plan.ep)]
    if tp > 1:
        out += ["--expert-tensor-parallel-size", str(tp)]
    return out


def _megatron_moe_args(cfg, notes: list[str]) -> list[str]:
    """The routed and shared experts, top-k routing and its load-balancing loss, as the zoo
    builds them: grouped expert GEMMs and all-to-all token dispatch, which is what the cost
    model times."""
    out = ["--num-experts", str(cfg.num_experts), "--moe-router-topk", str(cfg.top_k),
           "--moe-ffn-hidden-size", str(cfg.moe_ffn_hidden), "--moe-grouped-gemm",
           "--moe-token-dispatcher-type", "alltoall",
           "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", repr(float(cfg.aux_loss_coeff))]
    if cfg.shared_ffn_hidden:
        out += ["--moe-shared-expert-intermediate-size", str(cfg.shared_ffn_hidden)]
    if cfg.dense_layers:
        out += ["--moe-layer-freq", f"([0]*{cfg.dense_layers}+[1]*{cfg.layers - cfg.dense_layers})"]
    if not cfg.normalize_top_k:
        # Megatron-Core's default softmax runs over the top-k logits (renormalised weights);
        # pre-softmax takes the top k of the softmax over all experts, as the model does.
        out.append("--moe-router-pre-softmax")
    if cfg.capacity_factor is not None:
        out += ["--moe-expert-capacity-factor", repr(float(cfg.capacity_factor)), "--moe-pad-expert-input-to-capacity"]
    notes.append("the load-balancing loss is exported per micro-batch (aux_loss); a run with autoplan's "
                 "global-batch loss (run --load-balancing global) corresponds to "
                 "--moe-router-load-balancing-type global_aux_loss, which Megatron-Core averages over the "
                 "micro-batches forwarded so far")
    return out


def _megatron_latent_attention_args(cfg) -> list[str]:
    out = ["--multi-latent-attention", "--kv-lora-rank", str(cfg.kv_lora_rank), "--qk-head-dim", str(cfg.head_dim),
           "--qk-pos-emb-head-dim", str(cfg.rope_head_dim), "--v-head-dim", str(cfg.v_head_dim)]
    if cfg.q_lora_rank:
        out += ["--q-lora-rank", str(cfg.q_lora_rank)]
    return out


def to_megatron(plan: Plan, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
                original: Plan | None = None) -> Exported:
    argv, env, notes = megatron_args(plan, model)
    notes = _dtype_note(original or plan, plan) + notes
    world = plan.num_gpus
    script = "pretrain_bert.py" if model is not None and getattr(model.config, "arch", "") == "bert" \
        else "pretrain_gpt.py"
    lines = ["#!/usr/bin/env bash",
             f"# Megatron-LM launch settings for the autoplan plan: {_comment(plan.describe())}",
             f"# Written for Megatron-LM main @ {MEGATRON_COMMIT[:7]} (flags and validate_args rules checked).",
             f"# {world} GPUs = tensor {plan.tp} x pipeline {plan.pp} x data {plan.dp}; Megatron-LM derives "
             "the data-parallel size from the world size.",
             f"# Use: source THIS_FILE; torchrun --nproc-per-node <gpus per node> --nnodes <nodes> {script} "
             '"${MEGATRON_ARGS[@]}" <data, tokenizer, optimizer and logging arguments>']
    lines += [f"# note: {_comment(n)}" for n in notes]
    for key, value in env.items():
        lines.append(f"unset {key}" if value is None else f"export {key}={shlex.quote(value)}")
    lines.append("MEGATRON_ARGS=(")
    # One flag (with its value) per line so the file diffs and reads well.
    i = 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"  {argv[i]} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(f"  {argv[i]}")
            i += 1
    lines.append(")")
    text = "\n".join(lines) + "\n"
    from autoplan.megatron_rules import check_script
    check_script(text, world_size=world)   # the export itself obeys the table it is tested against
    return Exported("megatron", text, tuple(notes), ".sh", f"main@{MEGATRON_COMMIT[:7]}")


# ----------------------------------------------------------------------------- DeepSpeed
def deepspeed_config(plan: Plan, model: "ModelSpec | None" = None) -> tuple[dict, list[str]]:
    """(config, notes): a DeepSpeed config JSON (as a dict) that runs ``plan``."""
    name = "DeepSpeed"
    check(plan, "deepspeed", model)
    recompute = plan.recompute
    notes: list[str] = []
    cfg: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.num_micro_batches,
    }
    if plan.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif plan.dtype == "fp16":
        # loss_scale 0 = dynamic loss scaling, starting at 2**16 (DeepSpeed's documented defaults).
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    cfg["zero_optimization"] = {"stage": plan.zero, "overlap_comm": True, "contiguous_gradients": True}
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
    pp = plan.pp
    if pp > 1:
        parts = [0] + [s.end for s in plan.stages]
        ckpt = ", activation_checkpoint_interval=1" if recompute == "full" else ""
        explain.append(f"pipeline stages: {pp} (not a config key): build the model as deepspeed.pipe."
                       f"PipelineModule(layers, num_stages={pp}, partition_method='uniform'{ckpt}) with the "
                       f"model's {parts[-1]} units as layers; it cuts them at {parts}")
        cfg["autoplan_pipeline"] = {"num_stages": pp, "partition_method": "uniform", "stage_boundaries": parts,
                                    "units_per_stage": [s.num_layers for s in plan.stages]}
    if recompute == "full":
        explain.append("activation checkpointing: wrap every layer with deepspeed.checkpointing.checkpoint "
                       "(or set PipelineModule's activation_checkpoint_interval=1)")
    moe = _deepspeed_moe(plan, model)
    if moe is not None:
        cfg["autoplan_moe"] = moe
        explain.append(f"experts (not a config key): build each MoE layer as deepspeed.moe.layer.MoE("
                       f"hidden_size, expert, num_experts={moe['num_experts']}, ep_size={moe['ep_size']}, "
                       f"k={moe['k']}, capacity_factor={moe['capacity_factor']}, drop_tokens={moe['drop_tokens']})"
                       " and the optimizer's parameter groups with deepspeed.moe.utils."
                       "split_params_into_different_moe_groups_for_optimizer")
    note = _placement_note(plan, name)
    if note:
        notes.append(note)
    # DeepSpeed ignores top-level keys it does not know, so the explanation travels with the file.
    cfg["comment"] = "; ".join(explain + notes)
    return cfg, notes


def _deepspeed_moe(plan: Plan, model: "ModelSpec | None") -> dict | None:
    """DeepSpeed-MoE layer settings of the plan's experts (they go to the model code), or None
    for a dense model (what DeepSpeed-MoE cannot build is refused by autoplan.engines)."""
    cfg = model.config if model is not None else None
    if cfg is None or getattr(cfg, "arch", "") != "moe":
        return None
    return {"num_experts": cfg.num_experts, "ep_size": plan.ep, "k": cfg.top_k,
            "capacity_factor": cfg.capacity_factor if cfg.capacity_factor is not None else 1.0,
            "drop_tokens": cfg.capacity_factor is not None}


def to_deepspeed(plan: Plan, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
                 original: Plan | None = None) -> Exported:
    cfg, notes = deepspeed_config(plan, model)
    notes = _dtype_note(original or plan, plan) + notes
    if notes and plan.dtype != (original or plan).dtype:
        cfg["comment"] = "; ".join([cfg["comment"], notes[0]])
    return Exported("deepspeed", json.dumps(cfg, indent=2) + "\n", tuple(notes), ".json", ENGINES["deepspeed"].version)


# ----------------------------------------------------------------------------- torchtitan
def torchtitan_settings(plan: Plan, model: "ModelSpec | None" = None, version: str = "0.3") -> dict:
    """The torchtitan settings that run ``plan``, as {section: {field: value}} in the names of
    torchtitan's config dataclasses (0.3) or TOML sections (0.2), plus '_notes' and '_comments'."""
    engine = get_engine("torchtitan", version)
    check(plan, engine, model)
    tp, pp, dp, v = plan.tp, plan.pp, plan.dp, plan.virtual_stages
    notes: list[str] = []
    comments: dict[tuple[str, str], str] = {}
    seq = _seq_len(plan, model)
    if not seq:
        raise ConfigError("seq_len", "the plan does not record its sequence length", "pass --model")
    parallel: dict = {}
    # FSDP2 over the data-parallel ranks is ZeRO-3 (parameters re-gathered for backward);
    # without sharding the ranks replicate (DDP). Under pipelining FSDP2 without resharding
    # after forward is ZeRO-1: the pipeline keeps gathered weights and whole gradients
    # until the step's last backward (torchtitan's own default there).
    if plan.zero == 0:
        parallel["data_parallel_replicate_degree"] = dp
        parallel["data_parallel_shard_degree"] = 1
    else:
        parallel["data_parallel_replicate_degree"] = 1
        parallel["data_parallel_shard_degree"] = dp
        parallel["fsdp_reshard_after_forward"] = "always" if plan.zero == 3 else "never"
    parallel["tensor_parallel_degree"] = tp
    if tp > 1 and engine.sequence_parallel_without:
        parallel["enable_sequence_parallel"] = plan.sequence_parallel
    if plan.ep > 1:
        # The experts over ep of the FSDP-sharded ranks (autoplan.engines refuses the plans
        # where torchtitan's expert parallelism would mean another layout).
        parallel["expert_parallel_degree"] = plan.ep
    if plan.cp > 1:
        parallel["context_parallel_degree"] = plan.cp
        if len(engine.cp_comms) > 1:
            # 0.2: 'alltoall' passes key/value shards around the ring (PyTorch's permutation).
            parallel["context_parallel_rotate_method"] = {"p2p": "alltoall", "all_gather": "allgather"}[plan.cp_comm]
        if plan.zero == 0:
            # torchtitan applies FSDP over its flattened (data-shard, context) mesh whenever
            # context parallelism is on.
            notes.append(f"torchtitan shards parameters over the {plan.cp} context ranks (FSDP over data-shard x "
                         "context): the plan's ZeRO-0 runs with them sharded there")
    parallel["pipeline_parallel_degree"] = pp
    parallel["pipeline_parallel_schedule"] = TORCHTITAN_SCHEDULES[plan.schedule]
    head = "lm_head" if engine.version.startswith("0.3") else "output"
    if pp > 1:
        parallel["pipeline_parallel_microbatch_size"] = plan.micro_batch
        parts = []
        for units in _stage_units(plan, model):
            mods = []
            for u in units:
                if u == "embedding":
                    mods.append("tok_embeddings")
                elif u == "head":
                    mods += ["norm", head]
                else:
                    mods.append(f"layers.{u.split(':')[1]}")
            parts.append(mods)
        # The modules of every stage in model order; looped schedules place stage s on rank
        # s % pp like autoplan.
        parallel["module_fqns_per_model_part"] = parts
        comments[("parallelism", "module_fqns_per_model_part")] = (
            f"blocks per stage: {_counts(blocks_per_stage(plan, model))}" + (f" ({v} stages per rank)" if v > 1 else ""))
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
    if pp > 1 and engine.version.startswith("0.3"):
        # torchtitan 0.3 refuses CUDA graphs with pipeline parallelism (Trainer.Config validation).
        training["disable_cuda_graphs"] = True
    note = _placement_note(plan, "torchtitan")
    if note:
        notes.append(note)
    return {"parallelism": parallel, "training": training, "recompute": plan.recompute,
            "model": preset_name(model, engine) if model is not None else None,
            "_notes": notes, "_comments": comments}


def to_torchtitan_toml(plan: Plan, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
                       original: Plan | None = None) -> Exported:
    """torchtitan 0.2.x job config (TOML, read by ``--job.config_file``)."""
    s = torchtitan_settings(plan, model, "0.2")
    notes, comments = _dtype_note(original or plan, plan) + s["_notes"], s["_comments"]
    sections: dict = {"job": {"description": f"autoplan plan: {plan.describe()}"}}
    if s["model"] is not None:
        sections["model"] = {"name": s["model"][0], "flavor": s["model"][1]}
    elif model is not None:
        sections["model"] = {"name": model.name, "flavor": "custom"}
        comments[("model", "name")] = (f"torchtitan ships no model with {model.name}'s shapes: register a "
                                       "TrainSpec with this name and flavor")
    sections["training"] = s["training"]
    sections["parallelism"] = s["parallelism"]
    ac: dict = {"mode": s["recompute"]}
    if s["recompute"] == "selective":
        ac["selective_ac_option"] = "op"
        comments[("activation_checkpoint", "selective_ac_option")] = (
            "per-op selective recomputation: torchtitan's closest to recomputing the attention core")
    sections["activation_checkpoint"] = ac
    lines = ["# torchtitan 0.2 job config exported by autoplan (torchrun ... -m torchtitan.train "
             "--job.config_file THIS_FILE)",
             f"# {plan.num_gpus} GPUs: launch with NGPU={plan.num_gpus} (or torchrun across nodes) and "
             "add dataset, tokenizer, optimizer and step settings."]
    lines += [f"# note: {_comment(n)}" for n in notes]
    lines.append(toml_dumps(sections, comments))
    return Exported("torchtitan", "\n".join(lines), tuple(notes), ".toml", "0.2.2")


def to_torchtitan_python(plan: Plan, model: "ModelSpec | None" = None, cluster: "Cluster | None" = None,
                         original: Plan | None = None) -> Exported:
    """torchtitan 0.3 config: a module with a ``Trainer.Config`` function, run as
    ``-m torchtitan.train --module <this module> --config autoplan_plan``."""
    s = torchtitan_settings(plan, model, "0.3")
    notes, comments = _dtype_note(original or plan, plan) + s["_notes"], s["_comments"]
    preset = s["model"]
    if preset is None and model is not None:
        notes.append(f"torchtitan ships no model with {model.name}'s shapes: call apply_autoplan(config) at the "
                     "end of the config function of your own model")
    run = ("    torchrun --nproc-per-node <gpus per node> --nnodes <nodes> -m torchtitan.train \\\n"
           "        --module <name> --config autoplan_plan")
    lines = ['"""torchtitan 0.3 job config exported by autoplan.', "",
             f"Plan: {_comment(plan.describe())}", ""]
    if preset is not None:
        lines += [f"Run on {plan.num_gpus} GPUs: put this file on PYTHONPATH as <name>.py and launch", run,
                  "adding dataset, tokenizer, optimizer and step settings (in autoplan_plan, or as",
                  '--section.field command-line overrides)."""']
    else:
        lines += ["apply_autoplan(config) sets the plan's parallelism, batch and recomputation on the",
                  "Trainer.Config of your model (torchtitan ships no model with these shapes by name): call it",
                  f'at the end of your own config function and run that on {plan.num_gpus} GPUs."""']
    lines += [f"# note: {_comment(n)}" for n in notes]
    lines.append("from torchtitan.config import ParallelismConfig")
    if s["recompute"] == "full":
        lines.append("from torchtitan.distributed.activation_checkpoint import FullAC")
    elif s["recompute"] == "selective":
        lines.append("from torchtitan.distributed.activation_checkpoint import SelectiveAC")
    if preset is not None:
        module, flavor = preset
        base = f"{module}_{flavor.lower().replace('-', '_')}"
        lines.append(f"from torchtitan.models.{module}.config_registry import {base}")
    lines += ["", "", "def apply_autoplan(config):", '    """The plan\'s settings on ``config`` (a Trainer.Config)."""']
    lines.append("    config.parallelism = ParallelismConfig(")
    for key, value in s["parallelism"].items():
        c = comments.get(("parallelism", key))
        if c:
            lines.append(f"        # {_comment(c)}")
        lines.append(f"        {key}={value!r},")
    lines.append("    )")
    for key, value in s["training"].items():
        lines.append(f"    config.training.{key} = {value!r}")
    if s["recompute"] == "full":
        lines.append("    config.activation_checkpoint = FullAC.Config()")
    elif s["recompute"] == "selective":
        lines.append("    # per-op selective recomputation: torchtitan's closest to recomputing the attention core")
        lines.append("    config.activation_checkpoint = SelectiveAC.Config()")
    else:
        lines.append("    config.activation_checkpoint = None")
    lines.append("    return config")
    if preset is not None:
        lines += ["", "", "def autoplan_plan():",
                  f'    """torchtitan\'s own {module} {flavor} config (the plan\'s {model.name}) with the plan applied."""',
                  f"    return apply_autoplan({base}())"]
    return Exported("torchtitan", "\n".join(lines) + "\n", tuple(notes), ".py", "0.3.0")


def toml_dumps(sections: dict, comments: dict | None = None) -> str:
    """TOML for ``{section: {key: value}}`` with str, bool, int, float and (nested) lists of
    those (written by hand so that exporting needs no TOML library)."""
    comments = comments or {}
    out: list[str] = []
    for section, table in sections.items():
        out.append(f"\n[{section}]")
        for key, value in table.items():
            c = comments.get((section, key))
            if c:
                out.append(f"# {_comment(c)}")
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
