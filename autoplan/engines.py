"""What each training engine can run: the one place that knows it.

``autoplan export --to T`` refuses a plan that engine ``T`` cannot express, and
``autoplan search --for T`` searches only plans it can; both ask :func:`violation`, so the
two cannot disagree (the search also narrows its space with :meth:`Engine.constraints`
first, which only saves work: every plan it returns has passed :func:`violation`).

The capabilities are those of one stated release of each engine (:attr:`Engine.version`),
read from its code:

* Megatron-LM: ``megatron/training/arguments.py`` (argument parser and ``validate_args``)
  at the commit in ``autoplan/data/engines/megatron-lm.json``, which also lists the flags
  and ``validate_args`` rules the export relies on (checked by :mod:`autoplan.megatron_rules`).
* DeepSpeed 0.19.8: ``deepspeed/runtime/config.py`` (the config), ``deepspeed/runtime/pipe``
  (``PipelineModule`` partitions, the pipeline engine's schedule and ZeRO limit).
* torchtitan 0.3.0 (Python configs) and 0.2.2 (TOML): ``torchtitan/config``,
  ``torchtitan/distributed/pipeline_parallel.py`` and the ``torch.distributed.pipelining``
  schedules it builds.

A refusal is a :class:`~autoplan.errors.ConfigError` naming the plan field and the
nearest plan the engine can run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoplan.errors import ConfigError, closest
from autoplan.plan import CP_COMMS, SCHEDULES, Plan

if TYPE_CHECKING:
    from autoplan.cluster import Cluster
    from autoplan.models.spec import ModelSpec

MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""Megatron-LM commit (main, 2026-08-22) whose ``arguments.py`` the export follows."""


@dataclass(frozen=True)
class Engine:
    """What one engine (at one release) can express of a plan."""

    name: str
    """Name used by ``--for`` / ``--to``: 'autoplan', 'megatron', 'deepspeed', 'torchtitan'."""
    title: str
    """Human name, e.g. 'Megatron-LM'."""
    version: str
    """The release (or commit) these capabilities were read from."""
    tensor_parallel: bool = True
    """Tensor parallelism can be set in the engine's configuration."""
    uniform_tp: bool = True
    """One tensor-parallel degree for the whole job (no per-stage degrees)."""
    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules it runs with more than one stage."""
    zero: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages it runs without pipeline parallelism."""
    zero_with_pipeline: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages it runs together with pipeline parallelism."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    """Recomputation modes it offers."""
    uniform_recompute: bool = True
    """One recomputation setting for the whole model (no per-stage modes)."""
    sequence_parallel_without: bool = True
    """Tensor parallelism can run without sequence parallelism."""
    dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32")
    """Training dtypes it offers."""
    split: str = "any"
    """Layer splits it can give a pipeline: 'any' (an explicit layout), or 'uniform-units'
    (DeepSpeed's ``PipelineModule(partition_method='uniform')`` over the model's units)."""
    cp_comms: tuple[str, ...] = CP_COMMS
    """Context-parallel exchanges it runs (autoplan.plan.CP_COMMS); empty: no context
    parallelism."""
    cp_chunks_2cp: bool = False
    """The sequence must split into 2*cp chunks whatever the exchange (Megatron-LM's
    validate_args asks it of every context-parallel run)."""
    zero3_excludes_fp16: bool = False
    """ZeRO-3 is unavailable in fp16 (Megatron-LM's torch FSDP2)."""
    zero3_needs_untied: bool = False
    """ZeRO-3 needs untied input and output embeddings (Megatron-LM's torch FSDP2)."""
    microbatch_rules: bool = False
    """torch.distributed.pipelining's rules on micro-batch counts apply (1F1B: at least as
    many micro-batches as stages; looped schedules: a multiple of the rounds)."""
    interleave_needs_multiple: bool = False
    """The interleaved schedule needs the micro-batch count to be a multiple of pp."""
    models: tuple[str, ...] = ()
    """Model families (TransformerConfig.arch) it builds; empty: any model."""
    presets: dict | None = None
    """Zoo presets it ships as named models (name -> its own model name); None: it takes
    the model's shapes as settings. Other models need the user's own model definition, to
    which the export applies the plan."""

    @property
    def stack(self) -> str:
        """Training stack the cost model assumes for this engine (autoplan.stacks.TARGET_STACKS)."""
        from autoplan.stacks import TARGET_STACKS
        return TARGET_STACKS[self.name]

    # ------------------------------------------------------------------ search
    def constraints(self) -> dict:
        """Narrowings of :class:`search.space.Constraints` that this engine implies
        (a subset of what :func:`violation` checks, applied before the search starts)."""
        out: dict = {"schedules": tuple(s for s in SCHEDULES if s in self.schedules or s == "1f1b"),
                     "zero": self.zero, "recompute": self.recompute}
        if not self.tensor_parallel:
            out["tp"] = (1,)
        if self.cp_comms:
            out["cp_comm"] = self.cp_comms
        else:
            out["cp"] = (1,)
        return out

    def dtype_for(self, cluster: "Cluster", wanted: str = "bf16") -> str:
        """The training dtype this engine uses on ``cluster`` for a plan wanting ``wanted``:
        bf16 needs every device to have bf16 units (V100 and T4 have not: fp16 with loss
        scaling there, or fp32 where the engine has no fp16)."""
        if wanted == "bf16" and not all_bf16(cluster):
            wanted = "fp16"
        if wanted not in self.dtypes:
            wanted = "fp32"
        return wanted


def all_bf16(cluster: "Cluster") -> bool:
    """Every device of ``cluster`` computes in bfloat16."""
    return all("bf16" in g.device.peak_flops for g in cluster.groups)


TORCHTITAN_PRESETS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"),
                      "llama3-405b": ("llama3", "405B")}
TORCHTITAN_PRESETS.update({   # mixtures of experts with a config function in torchtitan's registry
    "qwen3-30b-a3b": ("qwen3", "30B-A3B"), "deepseek-v2-lite": ("deepseek_v3", "16B"),
    "deepseek-v3": ("deepseek_v3", "671B")})
"""Zoo presets torchtitan ships (module/name, flavor), checked against its model registry."""

ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine(name="autoplan", title="autoplan", version="this package"),
    Engine(name="megatron", title="Megatron-LM", version=f"main @ {MEGATRON_COMMIT[:7]} (2026-08-22)",
           schedules=("1f1b", "interleaved-1f1b"), zero=(0, 1, 3), cp_chunks_2cp=True,
           zero_with_pipeline=(0, 1), zero3_excludes_fp16=True, zero3_needs_untied=True,
           interleave_needs_multiple=True, models=("gpt", "llama", "moe", "bert")),
    # DeepSpeed-Ulysses is set up in the model code, not in the config: no context parallelism.
    Engine(name="deepspeed", title="DeepSpeed", version="0.19.8", tensor_parallel=False, cp_comms=(),
           schedules=("1f1b",), zero=(0, 1, 2, 3), zero_with_pipeline=(0, 1), recompute=("none", "full"),
           split="uniform-units"),
    Engine(name="torchtitan", title="torchtitan", version="0.3.0 (0.2.2 with --engine-version 0.2)",
           zero=(0, 3), zero_with_pipeline=(0, 1, 3), dtypes=("bf16", "fp32"),
           # Ring attention only; 0.3 has no rotate-method setting and runs PyTorch's default,
           # the all-gather of keys and values.
           cp_comms=("all_gather",),
           microbatch_rules=True, models=("llama", "moe"), presets=TORCHTITAN_PRESETS),
)}
"""Every engine by name."""

ENGINE_NAMES = tuple(ENGINES)

VERSIONS: dict[str, dict[str, Engine]] = {
    "torchtitan": {
        "0.3": ENGINES["torchtitan"],
        # 0.2.x reads TOML and always pairs tensor with sequence parallelism (0.3 added
        # parallelism.enable_sequence_parallel).
        # 0.2.x also chooses the rotation (parallelism.context_parallel_rotate_method).
        "0.2": dataclasses.replace(ENGINES["torchtitan"], version="0.2.2", sequence_parallel_without=False,
                                   cp_comms=("p2p", "all_gather")),
    },
}
"""Engines whose releases differ in what they express: name -> version -> Engine."""


def get_engine(name: str, version: str | None = None) -> Engine:
    """The engine called ``name`` (at ``version``, default its current release); a one-line
    ConfigError naming the known ones otherwise."""
    if name not in ENGINES:
        raise ConfigError("target", f"{name!r} is not an engine",
                          closest(str(name), ENGINES) or f"choose one of {', '.join(ENGINES)}")
    if version is None:
        return ENGINES[name]
    known = VERSIONS.get(name, {})
    for key, engine in known.items():
        if version == key or version.startswith(key + "."):
            return engine
    raise ConfigError("engine_version", f"{name} {version} is not a release autoplan exports to",
                      f"choose one of {', '.join(known) or 'none (this engine has one)'}")


# --------------------------------------------------------------------------- checks
def check(plan: Plan, engine: "Engine | str", model: "ModelSpec | None" = None,
          cluster: "Cluster | None" = None) -> None:
    """Raise the first reason ``engine`` cannot run ``plan`` as planned (a ConfigError naming
    the plan field and the nearest plan it can run)."""
    err = violation(plan, engine, model, cluster)
    if err is not None:
        raise err


def violation(plan: Plan, engine: "Engine | str", model: "ModelSpec | None" = None,
              cluster: "Cluster | None" = None) -> ConfigError | None:
    """The first reason ``engine`` cannot run ``plan``, or None when it can."""
    e = get_engine(engine) if isinstance(engine, str) else engine
    if e.name == "autoplan":
        return None
    t = e.title
    tps = [g.tp for g in plan.groups]
    pp, v, m = plan.pp, plan.virtual_stages, plan.num_micro_batches
    if e.uniform_tp and len(set(tps)) > 1:
        return ConfigError("groups[].tp", f"the plan uses a different tensor-parallel degree per pipeline stage "
                           f"({'/'.join(map(str, tps))}); {t} has one tensor-parallel size for the whole job",
                           f"nearest: tp={min(tps)} on every stage (search --for {e.name})")
    if not e.tensor_parallel and max(tps) > 1:
        return ConfigError("groups[].tp", f"the plan uses tensor parallelism (tp={max(tps)}), which is not a {t} "
                           "setting (it comes from the model code, e.g. Megatron-DeepSpeed)",
                           f"nearest: the same plan with tp=1 and {max(tps)}x the data parallelism, or "
                           "export --to megatron")
    if plan.cp > 1 and plan.cp_comm not in e.cp_comms:
        if not e.cp_comms:
            return ConfigError("groups[].cp", f"the plan splits sequences over {plan.cp} ranks (context "
                               f"parallelism), which is not a {t} setting (DeepSpeed-Ulysses lives in the model code)",
                               f"nearest: the same plan with cp=1 and {plan.cp}x the data parallelism, or "
                               "export --to megatron")
        return ConfigError("cp_comm", f"{t}'s context parallelism has no {plan.cp_comm!r} exchange (it runs "
                           f"{', '.join(e.cp_comms)})", f"nearest: cp_comm={e.cp_comms[0]}")
    if plan.cp > 1 and e.cp_chunks_2cp and plan.seq_len and plan.seq_len % (2 * plan.cp):
        return ConfigError("groups[].cp", f"{t} needs the sequence ({plan.seq_len}) to be a multiple of 2*cp = "
                           f"{2 * plan.cp}, whatever the exchange", f"nearest: cp={plan.cp // 2 or 1}")
    if plan.sequence_parallel is False and max(tps) > 1 and not e.sequence_parallel_without:
        return ConfigError("sequence_parallel", f"{t}'s tensor parallelism always shards the sequence",
                           "nearest: the same plan with sequence_parallel=true")
    modes = [s.recompute for s in plan.stages]
    if e.uniform_recompute and len(set(modes)) > 1:
        return ConfigError("stages[].recompute", f"the plan recomputes differently per stage ({'/'.join(modes)}); "
                           f"{t} has one recomputation setting for the whole model",
                           f"nearest: recompute={_heaviest(modes)} on every stage")
    for mode in sorted(set(modes)):
        if mode not in e.recompute:
            better = "full" if mode == "selective" else "none"
            return ConfigError("stages[].recompute", f"{t} has no {mode!r} recomputation "
                               f"(it offers {', '.join(e.recompute)})", f"nearest: recompute={better}")
    if plan.dtype not in e.dtypes:
        return ConfigError("dtype", f"{t} does not train in {plan.dtype} (it offers {', '.join(e.dtypes)})",
                           "nearest: the same plan in " + ("bf16" if plan.dtype == "fp16" else e.dtypes[0])
                           + " (fp32 on devices without bf16)")
    if cluster is not None and plan.dtype == "bf16" and not all_bf16(cluster) and "fp16" not in e.dtypes:
        return ConfigError("dtype", f"the cluster has devices without bf16 units and {t} does not train in fp16",
                           "nearest: the same plan in fp32")
    if pp > 1 and plan.schedule not in e.schedules:
        near = "interleaved-1f1b" if plan.schedule == "zero-bubble" and "interleaved-1f1b" in e.schedules \
            and m % pp == 0 and plan.stages[-1].end >= 2 * pp else "1f1b"
        return ConfigError("schedule", f"{t} has no {plan.schedule!r} pipeline schedule "
                           f"(it runs {', '.join(e.schedules)})", f"nearest: schedule={near}")
    zeros = e.zero_with_pipeline if pp > 1 else e.zero
    if plan.zero not in zeros:
        near = max((z for z in zeros if z <= plan.zero), default=min(zeros))
        why = " with pipeline parallelism" if pp > 1 and plan.zero in e.zero else ""
        return ConfigError("zero", f"{t} cannot run ZeRO-{plan.zero}{why} (it offers "
                           f"{', '.join(f'ZeRO-{z}' for z in zeros)}{' here' if why else ''})",
                           f"nearest: zero={near}" + (" or the same plan without pipeline stages" if why else ""))
    if plan.zero == 3:
        if e.zero3_excludes_fp16 and plan.dtype == "fp16":
            return ConfigError("zero", f"{t}'s ZeRO-3 (torch FSDP2) does not train in fp16",
                               "nearest: zero=1 (distributed optimizer), or bf16 devices")
        if e.zero3_needs_untied and model is not None and _tied(model):
            return ConfigError("zero", f"{t}'s ZeRO-3 (torch FSDP2) needs untied input and output embeddings, "
                               f"and {model.name} ties them", "nearest: zero=1 (distributed optimizer)")
    if v > 1 and e.interleave_needs_multiple and m % pp:
        return ConfigError("num_micro_batches", f"{m} is not a multiple of pp={pp}, which {t}'s interleaved "
                           "schedule needs", f"nearest: {m - m % pp or pp} micro-batches, or schedule=1f1b")
    if e.microbatch_rules and pp > 1:
        if plan.schedule == "1f1b" and m < pp:
            return ConfigError("num_micro_batches", f"torch.distributed.pipelining's 1F1B needs at least as many "
                               f"micro-batches as stages ({m} < {pp})",
                               f"nearest: {pp} micro-batches, or schedule=gpipe")
        if plan.schedule in ("interleaved-1f1b", "zero-bubble") and m % max(1, m // pp):
            return ConfigError("num_micro_batches", f"torch.distributed.pipelining's {plan.schedule} needs the "
                               f"micro-batches ({m}) to be a multiple of their rounds ({m // pp})",
                               f"nearest: {pp * (m // pp)} micro-batches")
    if model is not None:
        err = _model_violation(plan, e, model)
        if err is not None:
            return err
    err = _expert_violation(plan, e, model)
    if err is not None:
        return err
    if pp > 1 and e.split == "uniform-units":
        want = partition_uniform(plan.stages[-1].end, pp)
        have = [0] + [s.end for s in plan.stages]
        if have != want:
            return ConfigError("stages", f"{t}'s PipelineModule splits the {want[-1]} units uniformly "
                               f"(boundaries {want}); the plan cuts at {have}",
                               f"nearest: the same plan split at {want}")
    return None


def _model_violation(plan: Plan, e: Engine, model: "ModelSpec") -> ConfigError | None:
    from autoplan.models.config import TransformerConfig
    cfg = model.config
    if not e.models:
        return None
    if not isinstance(cfg, TransformerConfig) or cfg.arch not in e.models:
        kind = cfg.arch if isinstance(cfg, TransformerConfig) else (type(cfg).__name__ if cfg is not None
                                                                    else "a traced module")
        return ConfigError("model", f"{model.name} is a {kind} model, which {e.title} does not build "
                           f"(it builds {', '.join(e.models)})", "export --to deepspeed, which needs no model shape")
    if cfg.mlp == "relu" and e.name == "megatron":
        return ConfigError("model", f"{model.name} uses a ReLU MLP, which {e.title}'s GPT model does not offer",
                           "export --to deepspeed")
    if e.name == "megatron" and cfg.arch == "bert" and plan.pp > 1 and not megatron_default_split(plan, model):
        return ConfigError("stages", f"{e.title}'s pipeline layout flag does not cover BERT's encoder, which it "
                           "splits evenly", "nearest: the same plan with the blocks split evenly")
    return None


def _expert_violation(plan: Plan, e: Engine, model: "ModelSpec | None") -> ConfigError | None:
    """Expert parallelism (and mixture-of-experts layers) an engine cannot run as planned."""
    cfg = model.config if model is not None else None
    moe = getattr(cfg, "arch", "") == "moe"
    if e.name == "megatron" and plan.ep > 1 and plan.zero == 3:
        # arguments.py:1036-1037: --use-torch-fsdp2 with expert parallelism is refused.
        return ConfigError("zero", f"{e.title}'s ZeRO-3 (torch FSDP2) does not run with expert parallelism",
                           "nearest: zero=1 (distributed optimizer)")
    if e.name == "megatron" and plan.ep > 1 and plan.tp > 1 and not plan.sequence_parallel:
        # megatron/core/model_parallel_config.py:560-564: "When using expert parallelism and tensor
        # parallelism for training, sequence parallelism must be used" (its MoE token dispatcher
        # takes the sequence-split activations).
        return ConfigError("sequence_parallel", f"{e.title} needs sequence parallelism with expert and tensor "
                           "parallelism together", "nearest: the same plan with sequence_parallel=true")
    if e.name == "torchtitan" and plan.ep > 1:
        # torchtitan draws EP ranks from FSDP's shard dimension and from TP (efsdp = dp_shard
        # x cp x tp / ep, experts not TP-sharded): autoplan's layout only with tp = 1 and sharding.
        if plan.tp > 1:
            return ConfigError("ep", f"{e.title}'s expert parallelism (ep={plan.ep}) takes in the tensor-parallel "
                               "ranks and leaves experts unsharded by them, while the plan shards every expert "
                               f"over tp={plan.tp} inside each expert-parallel rank",
                               "nearest: the same plan with tp=1, or export --to megatron")
        if plan.zero == 0:
            return ConfigError("zero", f"{e.title} draws expert-parallel ranks from FSDP's shard dimension, which "
                               "ZeRO-0 (replicated data parallelism) leaves at 1", "nearest: zero=3 (FSDP2)")
    if e.name == "deepspeed" and (moe or plan.ep > 1):
        if plan.zero == 3:
            # deepspeed/runtime/engine.py: native MoE is refused under ZeRO stage 3.
            return ConfigError("zero", f"{e.title}'s native MoE does not run under ZeRO-3",
                               "nearest: zero=2, or export --to megatron / torchtitan")
        if cfg is None:
            return ConfigError("model", "an expert-parallel plan needs the model's experts for DeepSpeed-MoE",
                               "pass --model")
        if cfg.shared_ffn_hidden or cfg.kv_lora_rank:
            return ConfigError("model", f"{model.name} has shared experts or latent attention, which DeepSpeed's "
                               "MoE layer (routed experts, optionally a residual one) does not build",
                               "export --to megatron or torchtitan")
    return None


def blocks_per_stage(plan: Plan, model: "ModelSpec | None" = None) -> list[int]:
    """Transformer blocks in each stage, in stage order."""
    kinds = _kinds(plan, model)
    return [sum(1 for k in kinds[s.start:s.end] if k == "block") for s in plan.stages]


def megatron_default_split(plan: Plan, model: "ModelSpec | None" = None) -> bool:
    """Megatron-LM splits this way without a layout flag: blocks evenly over the
    ``pp * virtual_stages`` stages, the embedding with the first and the head with the last."""
    blocks = blocks_per_stage(plan, model)
    kinds = _kinds(plan, model)
    ends_ok = kinds[0] == "embedding" and kinds[-1] == "head" and \
        "embedding" in kinds[plan.stages[0].start:plan.stages[0].end] and \
        "head" in kinds[plan.stages[-1].start:plan.stages[-1].end]
    return ends_ok and len(set(blocks)) == 1


def preset_name(model: "ModelSpec", engine: Engine):
    """The engine's own (module, flavor) for ``model`` when it ships exactly this model
    (any sequence length), else None."""
    from autoplan.models.config import STACK_KERNELS
    from autoplan.models.presets import PRESETS, get_config
    if engine.presets is None or model.name not in engine.presets or model.name not in PRESETS:
        return None
    preset = get_config(model.name)
    # Sequence length and kernel choices (the stack's attention kernel and norm) are not the model.
    same = dataclasses.replace(model.config, seq_len=preset.seq_len, max_positions=None, name=model.name,
                               attention=preset.attention,
                               **{k: getattr(preset, k) for k in STACK_KERNELS}).resolved()
    return engine.presets[model.name] if same == preset else None


def _tied(model: "ModelSpec") -> bool:
    return bool(getattr(model.config, "tie_embeddings", False))


def _heaviest(modes: list[str]) -> str:
    order = ("none", "selective", "full")
    return max(modes, key=order.index)


def _kinds(plan: Plan, model: "ModelSpec | None") -> list[str]:
    if model is not None:
        return [l.kind for l in model.layers]
    n = plan.stages[-1].end
    return ["embedding"] + ["block"] * (n - 2) + ["head"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of DeepSpeed's ``partition_uniform`` (``deepspeed/runtime/utils.py``): equal
    chunks, the remainder spread one each over the first parts."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts
