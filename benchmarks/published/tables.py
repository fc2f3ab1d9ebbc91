"""Published training runs under ``data/`` as *checking* rows of the cost model.

Every run whose configuration can be rebuilt is turned into a :class:`PublishedRow`: the
model shape (rebuilt with ``autoplan.models.transformer`` and the attention and norm
kernels of the training stack the run used), the cluster (``Cluster.homogeneous``, or
two node groups for AMP's mixed V100 + T4 cluster), the plan fields the source gives,
the stack, and what was measured: iteration time, peak memory per GPU, or that the run
ran out of memory. A run that cannot be rebuilt faithfully (async tensor parallelism,
Megatron-FSDP, a model the zoo cannot express, a missing field) becomes a :class:`Skipped`
entry that says why. No constant of the cost model is fitted to any of these rows.

Where a source leaves a plan choice open (micro-batch, interleaving depth, recompute,
sequence parallelism, the distributed optimizer), the row is estimated under every
choice the run's software offers and the fastest one the cost model predicts to fit is
reported, marked ``*`` -- as ``validate.estimate_row`` does for Narayanan Table 1.

One builder per source file; :func:`evaluate` estimates the rows and
:class:`TablesReport` turns the results into the report's per-source figures (time
MAPE and signed mean of measured/predicted - 1, fits/OOM agreement, peak-memory error)
and its per-row table. The AMP per-layer forward profiles check
``costmodel.compute.layer_timing`` directly (:func:`amp_layer_checks`).

    python benchmarks/published/tables.py [--source NAME ...] [--limit N] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autoplan  # noqa: E402
from autoplan.catalog import DeviceSpec, get_device  # noqa: E402
from autoplan.cluster import Cluster, NodeGroup  # noqa: E402
from autoplan.errors import ConfigError  # noqa: E402
from autoplan.models.spec import ModelSpec  # noqa: E402
from autoplan.plan import Plan  # noqa: E402
from autoplan.stacks import STACK_DIR, Stack, get_stack  # noqa: E402
from autoplan.units import GB, Gbit, GiB, MiB  # noqa: E402
from costmodel import estimate  # noqa: E402
from costmodel.comm import collective_time  # noqa: E402
from costmodel.compute import hidden_tp_forward, layer_timing  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"

MEGATRON_DROPOUT = 0.1
"""Megatron-LM's default hidden and attention dropout (``--hidden-dropout``,
``--attention-dropout``), which GPT-style runs that do not override it train with."""
MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes tried where a source does not give one."""
VIRTUAL_STAGES = (1, 2, 3, 4, 6, 8)
"""Interleaving depths tried where a source uses Megatron's interleaved schedule without
saying how deep."""
RECOMPUTE_ORDER = ("none", "selective", "full")
"""Recompute modes from cheapest to leanest: under the cost model each one is at least as
slow as the one before and holds at most as much memory, so the first that fits is the
fastest fitting one."""


# ------------------------------------------------------------------------------- rows
@dataclass(frozen=True, kw_only=True)
class PublishedRow:
    """One published training configuration and what its authors measured."""

    source: str
    """Short name of the source (one section of the report)."""
    ref: str
    """Where in the source: table, row, log line."""
    model: str
    """The model as the source names it."""
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int | None = None
    """MLP width; None: the family's default (4h for GPT)."""
    kv_heads: int | None = None
    arch: str = "gpt"
    dropout: float = 0.0
    """Hidden and attention dropout the run trained with."""
    tie_embeddings: bool = False
    cluster: Cluster
    cluster_note: str = ""
    """What the cluster is and which bandwidths are assumed (and why)."""
    tp: int
    pp: int
    dp: int
    global_batch: int
    cp: int = 1
    """Context-parallel degree: every sequence split over this many ranks."""
    cp_comm: str = "p2p"
    """How the context-parallel ranks exchange keys and values (``autoplan.plan.CP_COMMS``)."""
    micro_batch: int | None = None
    """None: not given by the source (the fastest fitting choice is used)."""
    virtual: int | None = 1
    """Interleaved stages per pipeline rank; None: interleaved but depth not given."""
    recompute: str | None = None
    """'none', 'selective', 'full'; None: not given."""
    recompute_options: tuple[str, ...] = RECOMPUTE_ORDER
    """The modes the run's software offered, tried where ``recompute`` is not given (selective
    recomputation arrived in Megatron-LM in 2022)."""
    recompute_bracket: bool = False
    """The run used a recompute policy between the planner's modes (torchtitan's per-op or
    per-layer selective checkpointing): the row is estimated under 'none' and 'full', which
    bound its memory and time, and is checked against those bounds only."""
    sequence_parallel: bool | None = False
    """None: not given (on when tp > 1: under the cost model it is never slower and never
    holds more memory)."""
    zero: int | tuple[int, ...] = 0
    """ZeRO stage; a tuple lists the stages the run's software could have used (not given)."""
    uneven: bool = False
    """Stages may hold unequal numbers of blocks (the source says so)."""
    split: tuple[int, ...] | None = None
    """Explicit stage boundaries over the model's units (pp + 1 numbers), else an even split."""
    dtype: str = "bf16"
    stack: str
    stack_overrides: dict = field(default_factory=dict)
    """Behaviour switches of the stack the source says this run used or did without (e.g. no
    overlap of data-parallel communication; FSDP's float8 all-gather, 1 B per gathered
    parameter); never a fitted constant."""
    status: str = "ok"
    """'ok' (ran), 'OOM' (ran out of memory) or 'failed' (no timing, cause not logged)."""
    measured_time_s: float | None = None
    measured_tflops: float | None = None
    """Per-GPU TFLOP/s under a FLOP count the source does not state: compared as this
    model's FLOP count per iteration over the measured rate."""
    time_note: str = "measured"
    """'measured', or how the time was derived from the source's figures."""
    measured_peak_GiB: float | None = None
    peak_kind: str = "reserved"
    """'reserved' (the caching allocator's peak reserved) or 'device' (nvidia-smi: all
    memory on the GPU, CUDA context and NCCL included)."""
    peak_ranks: str = "all"
    """'all': the peak over every rank; 'ends': over the first and last pipeline stage."""
    confidence: str = "high"
    group: str = ""
    """A part of the source reported separately (e.g. its runs on another stack or cluster)."""
    fitting: bool = False
    """The row fitted a figure of its stack: reported as its own part, left out of the
    source's checking figures, of the totals and of the stack's interval."""
    note: str = ""

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class Skipped:
    """A published run that is not a checking row, and why."""

    source: str
    ref: str
    reason: str


@dataclass
class RowResult:
    """A row's estimate under its plan (the chosen one where the source left choices open)."""

    row: PublishedRow
    est: object
    """costmodel.estimate.Estimate of the chosen plan."""
    plan: Plan
    chosen: dict
    """Plan fields the source did not give -> the value used."""
    measured_time_s: float | None

    @property
    def time_error(self) -> float | None:
        """measured / predicted - 1 (positive: the prediction is too fast)."""
        if self.measured_time_s is None or self.row.status != "ok":
            return None
        return self.measured_time_s / self.est.iteration_time_s - 1

    @property
    def predicted_peak_GiB(self) -> float:
        """The prediction of what the source measured (allocator-reserved or whole-device)."""
        groups = self.est.memory_by_group
        if self.row.peak_ranks == "ends":
            groups = [groups[0], groups[-1]]
        if self.row.peak_kind == "device":
            return max(g.total for g in groups) / GiB
        return max(g.allocated + g.fragmentation for g in groups) / GiB

    @property
    def memory_error(self) -> float | None:
        if self.row.measured_peak_GiB is None or self.row.status != "ok":
            return None
        return self.row.measured_peak_GiB / self.predicted_peak_GiB - 1

    @property
    def fits_agrees(self) -> bool | None:
        """Whether the predicted fits/out-of-memory matches the outcome ('failed': None)."""
        if self.row.status == "ok":
            return bool(self.est.fits)
        if self.row.status == "OOM":
            return not self.est.fits
        return None


@dataclass
class BracketResult:
    """A row whose recompute policy lies between the planner's modes, estimated at both
    ends: 'full' (the leanest and slowest) and 'none' (the fastest and largest)."""

    row: PublishedRow
    lean: RowResult
    """Estimate with full recomputation."""
    rich: RowResult
    """Estimate with no recomputation."""

    @property
    def measured_time_s(self) -> float | None:
        return self.lean.measured_time_s if self.row.status == "ok" else None

    @property
    def time_bounds(self) -> tuple[float, float]:
        return self.rich.est.iteration_time_s, self.lean.est.iteration_time_s

    @property
    def peak_bounds(self) -> tuple[float, float]:
        return self.lean.predicted_peak_GiB, self.rich.predicted_peak_GiB

    @staticmethod
    def _within(x: float | None, bounds: tuple[float, float]) -> bool | None:
        return None if x is None else bounds[0] <= x <= bounds[1]

    @property
    def time_within(self) -> bool | None:
        return self._within(self.measured_time_s, self.time_bounds)

    @property
    def peak_within(self) -> bool | None:
        return self._within(self.row.measured_peak_GiB if self.row.status == "ok" else None, self.peak_bounds)

    @property
    def predicted(self) -> str:
        """What the model says of every policy in the bracket."""
        if self.rich.est.fits:
            return "fits"
        return "out of memory" if not self.lean.est.fits else "depends on the policy"

    @property
    def contradicts(self) -> bool | None:
        """The outcome contradicts the model: it ran although even 'full' is predicted out
        of memory, or it ran out of memory although even 'none' is predicted to fit."""
        if self.row.status == "ok":
            return not self.lean.est.fits
        if self.row.status == "OOM":
            return bool(self.rich.est.fits)
        return None


# ----------------------------------------------------------------------- small helpers
def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _int(x) -> int | None:
    v = _num(x)
    return None if v is None else int(round(v))


def _text(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else str(x)


def _read(name: str) -> pd.DataFrame:
    return pd.read_csv(DATA / name)


def nodes_of(device, gpus: int, inter_node_GBps: float, gpus_per_node: int = 8,
             intra_node_GBps: float | None = None) -> Cluster:
    """``gpus`` devices in nodes of ``gpus_per_node`` (one node when fewer)."""
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ConfigError("num_gpus", f"{gpus} is not a whole number of {gpus_per_node}-GPU nodes")
    return Cluster.homogeneous(device, nodes=max(1, gpus // gpus_per_node), gpus_per_node=min(gpus, gpus_per_node),
                               inter_node_GBps=inter_node_GBps, intra_node_GBps=intra_node_GBps)


# Devices the sources describe that the catalog has only in another variant; the figures
# are the source's own, nothing else changes.
H100_NVL_OVER_SXM = 1671 / 1979
"""The H100 NVL's dense tensor-core peak over the H100 SXM's (NVIDIA H100 datasheet: 1,671 against
1,979 TFLOP/s bf16 with sparsity; the same ratio for fp8 and tf32)."""


def _h100_hbm2e(memory_GB: float) -> DeviceSpec:
    """Meta's Grand Teton H100 (HBM2e, 2.4 TB/s, 500 W): the catalog's H100 SXM with the
    source's memory size and bandwidth, and tensor-core peaks halfway between the SXM's and
    the NVL's: torchtitan's benchmark file says its "actual peak TFLOPs number is between SXM
    and NVL, and we don't know its exact value" (llama3_h100_202412_torchtitan.md, footnote 2)."""
    base = get_device("H100")
    factor = (1 + H100_NVL_OVER_SXM) / 2
    peaks = {dtype: flops * (factor if dtype != "fp32" else 1.0) for dtype, flops in base.peak_flops.items()}
    return dataclasses.replace(base, name=f"H100-{memory_GB:g}GB-HBM2e", memory_bytes=memory_GB * GB,
                               memory_bandwidth=2.4e12, peak_flops=peaks, aliases=(),
                               source=base.source + f"; memory {memory_GB:g} GB and 2.4 TB/s per the torchtitan "
                                                    "benchmark files (Grand Teton H100 HBM2e, 500 W); tensor-core "
                                                    f"peaks {factor:.3f} of the SXM's, halfway to the NVL's "
                                                    "(the peak lies between them, per the same files)")


# --------------------------------------------------------------------------- builders
# Each returns the rows of one data file (PublishedRow or Skipped) in file order.

RECOMPUTE_2021 = ("none", "full")
"""What 2021 software offered: selective recomputation arrived with Korthikanti et al. 2022."""
SELENE = "DGX A100 80GB (NVSwitch), 8 x HDR 200 Gbit/s per node = 25 GB/s per GPU (source)"
SELENE_GBPS = 25.0


def megatron_2024() -> list:
    """Megatron-LM README weak-scaling table (Megatron-Core r0.8.0, H100)."""
    out = []
    for r in _read("megatron_lm_2024_h100_weak_scaling.csv").itertuples():
        tp, pp, dp = int(r.tp), int(r.pp), int(r.dp)
        out.append(PublishedRow(
            source="Megatron-LM 2024 H100", ref=f"README model table, {r.model}", model=r.model,
            layers=int(r.layers), hidden=int(r.hidden), heads=int(r.heads), ffn_hidden=int(r.ffn_hidden),
            seq_len=int(r.seq_len), vocab=int(r.vocab), dropout=MEGATRON_DROPOUT,
            cluster=nodes_of("H100", int(r.num_gpus), 50.0),
            cluster_note="H100 SXM 80GB (variant not stated); 50 GB/s per GPU between nodes assumed "
                         "(DGX H100, 8 x NDR 400 Gbit/s per node; not stated)",
            tp=tp, pp=pp, dp=dp, global_batch=int(r.global_batch), micro_batch=None,
            virtual=None if pp > 1 else 1, recompute=None, sequence_parallel=tp > 1, zero=1,
            stack="megatron-core-2024", measured_time_s=float(r.iter_time_s_derived),
            time_note="derived from TFLOP/s with Megatron-Core r0.8.0's FLOP formula",
            confidence="high (table); medium (derived time; bf16, micro-batch, recompute, interleaving not stated)",
            note="--tp-comm-overlap (not modelled); distributed optimizer and SP implied by the overlap flags"))
    return out


def _megatron_core_h100_row(r, source: str, ref: str, stack: str, confidence: str, note: str, *,
                            measured_time_s: float | None = None, time_note: str = "derived from tokens/s per GPU",
                            **fields) -> PublishedRow:
    """A Megatron-Core run on DGX H100 with every degree given and no recomputation (Transformer
    Engine, distributed optimizer): Llama unless ``fields`` say otherwise (arch, dropout, tied
    embeddings, stack overrides, group). The time is the row's derived one unless given."""
    tp, pp = int(r.tp), int(r.pp)
    vpp = _int(r.vpp) or 1
    row = dict(
        source=source, ref=ref, model=r.model, arch="llama", layers=int(r.layers), hidden=int(r.hidden),
        heads=int(r.heads), kv_heads=int(r.kv_heads), ffn_hidden=int(r.ffn_hidden), seq_len=int(r.seq_len),
        vocab=int(r.vocab), dropout=0.0, cluster=nodes_of("H100", int(r.num_gpus), 50.0),
        cluster_note="H100 SXM 80GB (DGX H100); 50 GB/s per GPU between nodes assumed (8 x NDR 400 Gbit/s per "
                     "node; not stated)",
        tp=tp, pp=pp, dp=int(r.dp), cp=_int(r.cp) or 1, global_batch=int(r.global_batch),
        micro_batch=_int(r.micro_batch), virtual=vpp if pp > 1 else 1, uneven=vpp > 1,
        # (No recomputation: the recipes behind these tables set none for these models, NeMo
        # v2.3.0 scripts/performance model_configs_h100.csv, Megatron-Bridge's H100 Llama 3
        # recipes, recompute_granularity None, and the DGX Cloud recipes'
        # activations_checkpoint_granularity null.)
        recompute="none", sequence_parallel=tp > 1, zero=1, stack=stack,
        measured_time_s=float(r.iter_time_s_derived) if measured_time_s is None else measured_time_s,
        time_note=time_note, confidence=confidence, note=note)
    return PublishedRow(**{**row, **fields})


MEGATRON_FP8_NOTE = "TP communication overlap and the recipe's fusions (not modelled)"


def megatron_fp8_example() -> list:
    """Megatron-LM examples/llama FP8 table (the 8B script: --fp8-format hybrid, --fp8-param-gather;
    the table matches NeMo v2.3.0's H100 performance configs, delayed scaling by default)."""
    return [_megatron_core_h100_row(r, "Megatron-LM Llama3 FP8 example", f"{r.model} on {int(r.num_gpus)} GPUs",
                                    "megatron-core-fp8", "medium (GPU, recompute and the 70B/405B scripts not stated)",
                                    MEGATRON_FP8_NOTE)
            for r in _read("megatron_lm_2025_llama3_fp8_example.csv").itertuples()]


def megatron_bridge() -> list:
    """Megatron-Bridge DGX-H100 Llama rows. From the 25.11 container on, both 'FP8-CS' and 'FP8'
    are current scaling (the fp8_cs configs of scripts/performance) on megatron-core-fp8-cs; the
    25.09 table states no precision and its launcher defaulted to delayed scaling
    (megatron-core-fp8). Megatron-FSDP rows are not modelled."""
    out = []
    for r in _read("megatron_bridge_2025_2026_h100_llama3.csv").itertuples():
        precision = _text(r.precision)
        container = r.framework.split(" ")[-1]
        ref = f"{r.model}, {int(r.num_gpus)} GPUs, NeMo {container}"
        if "FSDP=8" in _text(r.sharding):
            out.append(Skipped("Megatron-Bridge DGX-H100", ref, "Megatron-FSDP (not modelled)"))
            continue
        if precision.startswith("FP8"):
            stack, note = "megatron-core-fp8-cs", MEGATRON_FP8_NOTE
        else:
            stack, note = "megatron-core-fp8", "precision not stated: the launcher's default, delayed scaling; " \
                + MEGATRON_FP8_NOTE
        out.append(_megatron_core_h100_row(r, "Megatron-Bridge DGX-H100", ref, stack,
                                           "medium (recompute, optimizer sharding and the network not stated)", note))
    return out


def dgxc_benchmarking() -> list:
    """NVIDIA's DGX Cloud benchmarking recipes (NeMo 24.12 on DGX H100): Llama 3.1 8B/70B/405B
    (release v25.03) and GPT-3 175B (v25.04.01), each in BF16 (megatron-core) and FP8
    (megatron-core-fp8: the recipes set fp8_hybrid and fp8_params, delayed scaling), weak-scaled
    over 8-2,304 GPUs. Their configs set every degree, no recomputation, bf16 gradients
    (Apex's distributed Adam, grad_sync_dtype bf16) and, for Llama, Megatron's fused cross
    entropy."""
    out = []
    for r in _read("dgxc_benchmarking_2025_h100.csv").itertuples():
        fused_loss = _text(r.cross_entropy_loss_fusion).startswith("yes")
        overrides = {}
        if fused_loss:
            # Megatron's fused vocabulary-parallel cross entropy reads the bf16 logits: no fp32 copy.
            overrides["fp32_loss"] = False
        if _text(r.grad_sync_dtype).startswith("bf16"):
            # Apex's distributed Adam keeps its contiguous gradient buffer and reduces it in bf16.
            overrides.update(gradient_bytes_per_param=2.0, grad_reduce_bytes_per_param=2.0)
        note = "; ".join(n for n in (MEGATRON_FP8_NOTE, "fused cross entropy" if fused_loss else "",
                                     "bf16 gradients" if "gradient_bytes_per_param" in overrides else "",
                                     "truncated 405B proxy" if "proxy" in _text(r.notes) else "") if n)
        out.append(_megatron_core_h100_row(
            r, "NVIDIA DGX Cloud benchmarking", f"{r.source_table}, {int(r.num_gpus)} GPUs",
            "megatron-core-fp8" if r.precision == "FP8" else "megatron-core",
            "high (every degree, the batch and the recompute setting are in the recipe)", note,
            measured_time_s=float(r.iter_time_s), time_note="training step time as the table gives it",
            arch=r.arch, dropout=float(r.dropout), tie_embeddings=r.tie_embeddings == "yes",
            sequence_parallel=r.seq_parallel == "yes", stack_overrides=overrides, group=r.precision))
    return out


NEMO_2024 = "NeMo performance summary (DGX-H100)"


def nemo_performance() -> list:
    """NeMo's 2024 DGX-H100 FP8 tables: the pretraining summary of the 24.07 container (GPT-3 and
    Llama 2/3, every degree and the micro-batch given) and the long-sequence table of 24.03.01
    (Llama 2 7B at 4K-1M tokens with context parallelism; micro-batch, recompute and
    interleaving not given). FP8 as delayed scaling (the launcher's fp8_hybrid); the
    optimizer's dtypes and FP8 parameters are not stated, so the megatron-core-fp8 stack's are
    assumed, on the attention of that software (megatron-core-2024-fp8)."""
    out = []
    for r in _read("nemo_2024_h100_performance.csv").itertuples():
        long_sequence = r.source_table.startswith("Long")
        fused_loss = r.cross_entropy_loss_fusion == "yes"
        ref = (f"{r.model}, {int(r.seq_len) // 1024}K, {int(r.num_gpus)} GPUs" if long_sequence
               else f"{r.model}, {int(r.num_gpus)} GPUs")
        # The pretraining rows' launcher configs set no recomputation (the builder's default).
        unstated = dict(recompute=None, virtual=None if int(r.pp) > 1 else 1) if long_sequence else {}
        out.append(_megatron_core_h100_row(
            r, NEMO_2024, ref, "megatron-core-2024-fp8",
            "medium (degrees and batch given; the launcher configs' recompute; optimizer dtypes and FP8 parameters "
            "not stated)"
            if not long_sequence else "medium (TFLOP/s only; micro-batch, recompute and interleaving not stated)",
            "; ".join(n for n in (MEGATRON_FP8_NOTE, "fused cross entropy" if fused_loss else "") if n),
            time_note="derived from TFLOP/s per GPU with the pretraining table's FLOP count" if long_sequence
            else "derived from tokens/s per GPU",
            arch=r.arch, dropout=float(r.dropout), tie_embeddings=r.tie_embeddings == "yes",
            sequence_parallel=r.seq_parallel == "yes",
            stack_overrides={"fp32_loss": False} if fused_loss else {},
            # The pretraining table chose the stack's attention class (validate.py --fit); the
            # long-sequence table, four to 256 times longer sequences, only checks it.
            group="long sequence (24.03.01)" if long_sequence else "pretraining (24.07, fitting)",
            fitting=not long_sequence, **unstated))
    return out


def llama3_table4() -> list:
    """Llama 3 405B Table 4 (Meta's internal stack; megatron-core is the nearest shipped stack)."""
    out = []
    for r in _read("llama3_2024_table4.csv").itertuples():
        ref = f"Table 4, {int(r.num_gpus)} GPUs, seq {int(r.seq_len)}"
        recompute = "none" if _text(r.recompute).startswith("none") else None
        # Half the attention's FLOPs (a causal count) is this share of the whole count, per
        # token: 12 L h s of attention beside 6 N (Chowdhery et al. 2023, whose MFU Meta quotes).
        attention = 12 * int(r.layers) * int(r.hidden) * int(r.seq_len)
        causal = 0.5 * attention / (6 * float(r.params_b) * 1e9 + attention)
        out.append(PublishedRow(
            source="Llama 3 Table 4", ref=ref, model=r.model, arch="llama", layers=int(r.layers),
            hidden=int(r.hidden), heads=int(r.heads), kv_heads=int(r.kv_heads), ffn_hidden=int(r.ffn_hidden),
            seq_len=int(r.seq_len), vocab=int(r.vocab), dropout=0.0,
            cluster=nodes_of("H100", int(r.num_gpus), 50.0),
            cluster_note="H100 SXM 80GB HBM3, RoCE 400 Gbit/s per GPU = 50 GB/s (source)",
            tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), global_batch=int(r.global_batch), micro_batch=None,
            # (Sec. 3.3.2: "CP is all-gather based", keys and values gathered before attention.)
            cp=_int(r.cp) or 1, cp_comm="all_gather",
            virtual=None, uneven=True, recompute=recompute, sequence_parallel=None, zero=2, stack="megatron-core",
            measured_tflops=float(r.tflops_per_gpu),
            time_note="TFLOP/s per GPU; Meta's FLOP count is not stated, compared with this model's (full s^2 "
                      f"attention; a causal count would be {causal:.0%} smaller)",
            confidence="medium (no iteration time; micro-batch, interleaving and N not stated)",
            note="Meta's own PyTorch stack; FSDP keeping parameters after forward = ZeRO-2 memory"))
    return out


def megascale() -> list:
    """MegaScale (NSDI'24) Tables 2-3: the Megatron-LM baseline rows; MegaScale's own system
    (built on Megatron-LM) changes the model and is skipped."""
    df = _read("megascale_2024_175b.csv")
    table2 = df[df.iter_time_s.notna() & df.model.str.contains(r"\(Megatron-LM\)")]
    # Table 3 gives only MFU; Table 2 fixes the paper's FLOPs per token (MFU x GPUs x time / tokens,
    # constant to 0.6% over its rows), so an MFU converts to a time without knowing the formula.
    per_token = (table2.mfu * table2.num_gpus * table2.iter_time_s / table2.global_batch_tokens)
    out = []
    for r in df.itertuples():
        table = r.source_table.split(" (")[0] + (f" {r.source_table.split('), ')[-1]}" if "), row" in r.source_table
                                                   else "")
        ref = f"{table}: {r.model}, {int(r.num_gpus)} GPUs, batch {int(r.global_batch)}"
        is_baseline = "Megatron-LM" in r.model and "with" not in r.model
        if not is_baseline:
            out.append(Skipped("MegaScale 175B", ref, "MegaScale's system changes the model (parallel transformer "
                               "block, sliding-window attention, LAMB): the zoo cannot express it"))
            continue
        if _num(r.iter_time_s) is not None:
            t, note = float(r.iter_time_s), "measured"
        else:
            t = float(per_token.mean()) * float(r.global_batch_tokens) / (float(r.mfu) * int(r.num_gpus))
            note = (f"derived from MFU {r.mfu} with Table 2's FLOPs per token (spread "
                    f"{(per_token.max() / per_token.min() - 1):.1%})")
        out.append(PublishedRow(
            source="MegaScale 175B", ref=ref, model="GPT 175B (Megatron-LM baseline)", layers=int(r.layers),
            hidden=int(r.hidden), heads=int(r.heads), seq_len=int(r.seq_len), vocab=int(r.vocab),
            dropout=MEGATRON_DROPOUT, tie_embeddings=True,
            cluster=nodes_of("A100-SXM4-80GB", int(r.num_gpus), 25.0),
            cluster_note="'NVIDIA Ampere' (A100 80GB assumed: 2.7B parameters per GPU need the 80GB part); "
                         "8 x 200G NICs per 8-GPU server = 25 GB/s per GPU (source)",
            tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), global_batch=int(r.global_batch), micro_batch=None,
            virtual=int(r.vpp), recompute=None, sequence_parallel=None, zero=(0, 1), stack="megatron-core",
            # Table 3 lists TP, PP and DP communication overlap among MegaScale's additions to
            # this baseline: the baseline ran without them. FlashAttention-2 is another of
            # MegaScale's additions (its "efficient operators", Sec. 3.3), and Megatron-LM's
            # --use-flash-attn is off unless given: the baseline ran the explicit attention.
            stack_overrides=dict(overlap_grad_reduce=False, overlap_param_gather=False, blocking_p2p=True,
                                 attention="math"),
            measured_time_s=t, time_note=note,
            confidence="high (Table 2); medium (GPU model, ffn = 4h; micro-batch, recompute, SP, optimizer "
                       "sharding not stated)",
            note="Megatron-LM @285068c8 without DP/PP communication overlap and without FlashAttention-2 "
                 "(MegaScale adds them); MegaScale is built on Megatron-LM"))
    return out


def _torchtitan_unmodelled(r) -> str | None:
    """Why a torchtitan row cannot be rebuilt (None: it can, perhaps only as a bracket)."""
    reasons = []
    if _text(getattr(r, "async_tp", "")).lower().startswith("yes"):
        reasons.append("async TP (TP collectives overlapped with matmuls) is not modelled")
    if r.status == "OOM" and _num(r.global_batch) is None:
        reasons.append("local batch and activation checkpointing of the failed attempt are not stated")
    return "; ".join(reasons) or None


def _torchtitan_stack(r) -> tuple[str, dict, str, str]:
    """(stack, stack overrides, group, note) of a torchtitan row: Float8 rows run torchao's
    recipe ('yes' is torchtitan's default of the time, tensorwise dynamic scaling)."""
    float8 = _text(getattr(r, "float8", "")).lower()
    if float8 in ("", "no"):
        return "torchtitan", {}, "bf16", ""
    if float8.startswith("rowwise"):
        slow = "vanilla TP" in _text(r.source_table)
        return "torchtitan-float8-rowwise", {}, "Float8 rowwise", "Float8 rowwise" + (
            " (the source calls this baseline's low throughput a bug being addressed, torchtitan issue 1207)"
            if slow else "")
    if "float8 all-gather" in float8:
        # (The source enables FSDP's float8 all-gather: the weights travel in fp8.)
        return ("torchtitan-float8", {"gathered_weights_bytes_per_param": 1.0}, "Float8 tensorwise",
                "Float8 tensorwise, fp8 all-gather")
    return "torchtitan-float8", {}, "Float8 tensorwise", "Float8 tensorwise"


def _torchtitan_eager_norm(r, compiled: bool) -> str:
    """A note when the run normalized with torchtitan's eager RMSNorm, else ''. Until 2025 its
    ``norm_type = "rmsnorm"`` built a module that upcasts to fp32 and runs pow, mean, rsqrt and
    two products as separate kernels, each saved for the backward (torchtitan/models/norms.py);
    ``fused_rmsnorm`` was a Triton kernel, and torch.compile fuses the eager one. The row's
    ``norm_type`` is the train_config's at the run's commit."""
    norm = _text(getattr(r, "norm_type", "")).split(" ")[0]
    return "eager fp32 RMSNorm (norm_type 'rmsnorm', no compile)" if norm == "rmsnorm" and not compiled else ""


def _torchtitan_row(r, source: str, ref: str, device, cluster_note: str, inter_GBps: float, peak) -> PublishedRow:
    ac = _text(r.recompute)
    # torchtitan's selective checkpointing (every n-th layer, or a per-op save list) lies
    # between the planner's 'none' and 'full': checked against both as bounds.
    bracket = ac.startswith("selective")
    tp, pp, dp = int(r.tp), int(r.pp), int(r.dp)
    local = int(r.local_batch_size)
    compile_ = _text(getattr(r, "torch_compile", "")).lower()
    compiled = compile_.startswith("yes") or "compile = true" in compile_
    stack, overrides, group, float8 = _torchtitan_stack(r)
    eager_norm = _torchtitan_eager_norm(r, compiled)
    if eager_norm:
        overrides = {**overrides, "fused_norm": False}
    notes = [f"AC '{ac}' bracketed by none/full" if bracket else "", float8, eager_norm,
             "torch.compile (not modelled)" if compiled else ""]
    return PublishedRow(
        source=source, ref=ref, model=r.model, arch="llama", layers=int(r.layers), hidden=int(r.hidden),
        heads=int(r.heads), kv_heads=int(r.kv_heads), ffn_hidden=int(r.ffn_hidden), seq_len=int(r.seq_len),
        vocab=int(r.vocab), dropout=0.0, cluster=nodes_of(device, int(r.num_gpus), inter_GBps),
        cluster_note=cluster_note, tp=tp, pp=pp, dp=dp, global_batch=local * dp,
        # (torchtitan's context parallelism all-gathers the key/value shards by default:
        # context_parallel_rotate_method = "allgather".)
        cp=_int(getattr(r, "cp", 1)) or 1, cp_comm="all_gather",
        # Without pipelining a rank runs its whole local batch at once; with it torchtitan
        # then cut the local batch into one micro-batch per stage.
        micro_batch=local if pp == 1 else local // pp, recompute="full" if bracket else ac.split(" ")[0],
        recompute_bracket=bracket, sequence_parallel=tp > 1, zero=3, stack=stack, stack_overrides=overrides,
        group=group,
        status="OOM" if r.status == "OOM" else "ok", measured_time_s=_num(r.iter_time_s_derived),
        time_note="derived from tokens/s per GPU", measured_peak_GiB=peak, peak_kind="reserved", confidence="high",
        note="; ".join(n for n in notes if n))


def torchtitan_benchmarks() -> list:
    """torchtitan benchmarks/*.md (the PyTorch team's on H100 96GB HBM2e; a community file on H200)."""
    out = []
    h100 = _h100_hbm2e(96)
    for r in _read("torchtitan_benchmarks_2024_2025.csv").itertuples():
        doc = re.search(r"benchmarks/([\w.-]+)\.md", r.source)
        ref = f"{doc.group(1) if doc else 'benchmarks'}: {r.source_table}"
        reason = _torchtitan_unmodelled(r)
        if reason:
            out.append(Skipped("torchtitan benchmarks", ref, reason))
            continue
        if r.gpu.startswith("H200"):
            device, note = "H200-SXM-141GB", ("8 x H200 per host on NVLink; RDMA 400 Gbit/s per GPU (ConnectX-7) = "
                                              "50 GB/s (source)")
        else:
            device, note = h100, ("Grand Teton: 8 x H100 96GB HBM2e (2.4 TB/s, 500 W) per host on NVLink; RDMA "
                                  "400 Gbit/s per GPU = 50 GB/s (source)")
        out.append(_torchtitan_row(r, "torchtitan benchmarks", ref, device, note, 50.0,
                                   _num(r.peak_mem_reserved_gib)))
    return out


def torchtitan_docs() -> list:
    """The history of torchtitan docs/performance.md (64 A100, 128 H100)."""
    out = []
    for r in _read("torchtitan_docs_performance_2024.csv").itertuples():
        commit = r.source.split("@")[1].split(" ")[0]
        ref = (f"docs/performance.md {commit}: {r.model}, AC {_text(r.recompute) or 'not stated'}, "
               f"{int(r.num_gpus)} GPUs" + (f", local batch {int(r.local_batch_size)}"
                                            if _num(r.local_batch_size) else ""))
        reason = _torchtitan_unmodelled(r)
        if reason:
            out.append(Skipped("torchtitan docs/performance", ref, reason))
            continue
        if "H100" in r.gpu:
            device, inter, note = _h100_hbm2e(94), 50.0, (
                "H100 94-95GB HBM2e, lower TDP (doc footnote; 94 GB used); 50 GB/s per GPU assumed (not stated; "
                "the later benchmark files' 400 Gbit/s RDMA)")
        else:
            device, inter, note = "A100-SXM4-80GB", 25.0, (
                "64 A100 80GB; 25 GB/s per GPU between nodes assumed (200 Gbit/s per GPU; not stated)")
        out.append(_torchtitan_row(r, "torchtitan docs/performance", ref, device, note, inter, None))
    return out


LLM_FOUNDRY_NOTE = ("MosaicML nodes of 8 GPUs on NVLink; A100 nodes: 1600 Gbit/s RoCE per node = 25 GB/s per GPU "
                    "between nodes (source)")
LLM_FOUNDRY = "llm-foundry MPT"


def llm_foundry() -> list:
    """MosaicML llm-foundry's MPT throughput tables (Composer, PyTorch FSDP): GPT-style blocks
    with biases, learned positions and a tied head (the table's parameter counts match these
    shapes exactly), Triton FlashAttention, low-precision LayerNorm."""
    out = []
    for r in _read("llmfoundry_2023_2024_fsdp.csv").itertuples():
        gpu = {"a100_80gb": "A100-SXM4-80GB", "a100_40gb": "A100-SXM4-40GB", "h100_80gb": "H100-SXM5-80GB"}[r.gpu]
        ref = (f"{r.gpu}: {r.model}, seq {int(r.seq_len)}, {int(r.num_gpus)} GPUs, micro-batch {int(r.micro_batch)} "
               f"x {int(r.grad_accum)}")
        if gpu.startswith("H100") and int(r.num_gpus) > 8:
            out.append(Skipped(LLM_FOUNDRY, ref, "the network between the H100 nodes is not stated"))
            continue
        # precision bf16 with FSDP mixed_precision PURE: 16-bit parameters, gradients and moments.
        pure = (r.precision, r.fsdp_mixed_precision) == ("bf16", "PURE")
        out.append(PublishedRow(
            source=LLM_FOUNDRY, ref=ref, model=r.model, layers=int(r.layers), hidden=int(r.hidden),
            heads=int(r.heads), ffn_hidden=int(r.ffn_hidden), seq_len=int(r.seq_len), vocab=int(r.vocab),
            tie_embeddings=True, cluster=nodes_of(gpu, int(r.num_gpus), 25.0), cluster_note=LLM_FOUNDRY_NOTE,
            tp=1, pp=1, dp=int(r.num_gpus), global_batch=int(r.global_batch), micro_batch=int(r.micro_batch),
            recompute="full" if str(r.activation_checkpointing) == "True" else "none",
            zero=2 if r.sharding == "SHARD_GRAD_OP" else 3, stack="llm-foundry-pure-bf16" if pure else "llm-foundry",
            measured_time_s=float(r.iter_time_s_derived), time_note="derived: global batch tokens / tokens per s",
            confidence="high", group=gpu.split("-")[0] + (" pure bf16" if pure else "")))
    return out


BLOOM_NOTE = ("Jean Zay A100 80GB, 8 per node on NVLink; 4 Omni-Path 100 Gbit/s links per node = 6.25 GB/s "
              "per GPU (source)")
BLOOM_GBPS = 4 * 100 * Gbit / 8 / GB


def bloom_run() -> list:
    out = []
    for r in _read("bloom_176b_2022_training_run.csv").itertuples():
        out.append(PublishedRow(
            source="BLOOM 176B run", ref=_text(r.source_table) or "training log",
            model=r.model, layers=int(r.layers), hidden=int(r.hidden), heads=int(r.heads), seq_len=int(r.seq_len),
            vocab=int(r.vocab), dropout=MEGATRON_DROPOUT, tie_embeddings=True,
            cluster=nodes_of("A100-SXM4-80GB", int(r.num_gpus), BLOOM_GBPS), cluster_note=BLOOM_NOTE,
            tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), global_batch=int(r.global_batch),
            micro_batch=int(r.micro_batch), recompute="full", zero=1, stack="megatron-deepspeed",
            measured_time_s=float(r.iter_time_s), confidence="high",
            note="ALiBi positions (learned positions modelled: <0.02% of the parameters); dropout: "
                 "Megatron-DeepSpeed defaults (the run's script sets none)"))
    return out


DEEPSPEED_ZERO1_OPTIMIZER = dict(
    sharded_grad_collective="reduce_scatter", grad_reduce_bytes_per_param=2.0, grad_reduce_copy_bytes_per_param=0.0,
    gradient_bytes_per_param=2.0, half_gradient_bytes_per_param=0.0, dp_buffer_bytes=1907 * MiB,
    weight_grad_traffic_bytes_per_param=0.0)
"""What the megatron-deepspeed stack (DeepSpeed's BF16 optimizer) changes under DeepSpeed's
ZeRO-1 optimizer (deepspeed/runtime/zero/stage_1_and_2.py), which the BLOOM sweep ran before
2022-02-28: gradients accumulate in the parameters' 2-byte .grad (BigScience's chronicles:
"fp16 which grad accumulates in fp16"), each reduced to the rank owning its partition
(average_tensor, reduce_scatter=True) in that dtype through two 5e8-element buckets of 2 bytes
(zero/config.py defaults: reduce_bucket_size, allgather_bucket_size), and no per-micro-batch
passes copy them into an fp32 buffer."""


def bloom_sweep() -> list:
    out = []
    for r in _read("bloom_2022_topology_sweep.csv").itertuples():
        ref = f"{r.date_2022} {r.source_table} ({r.source.split(', ')[-1]})"
        if _num(r.heads) is None:
            out.append(Skipped("BLOOM topology sweep", ref, "number of heads not given"))
            continue
        precision = _text(r.precision)
        fp16 = precision.startswith("fp16")
        # From 02-28 the sweep ran DeepSpeed's new BF16 optimizer (fp32 gradient accumulation,
        # what the stack describes); before, ZeRO-1 kept 2-byte gradients.
        bf16_optimizer = precision.startswith("bf16") and "BF16 optimizer" in precision
        out.append(PublishedRow(
            source="BLOOM topology sweep", ref=ref, model=f"{int(r.layers)}x{int(r.hidden)}, {int(r.heads)} heads",
            layers=int(r.layers), hidden=int(r.hidden), heads=int(r.heads), seq_len=int(r.seq_len),
            vocab=int(r.vocab), dropout=MEGATRON_DROPOUT, tie_embeddings=True,
            cluster=nodes_of("A100-SXM4-80GB", int(r.num_gpus), BLOOM_GBPS), cluster_note=BLOOM_NOTE,
            tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), global_batch=int(r.global_batch),
            micro_batch=int(r.micro_batch), recompute="full", zero=1, dtype="fp16" if fp16 else "bf16",
            stack="megatron-deepspeed", status="OOM" if r.status == "OOM" else "ok",
            measured_time_s=_num(r.iter_time_s), measured_peak_GiB=_num(r.mem_per_gpu_gb_reported),
            peak_kind="device", peak_ranks="ends",
            confidence="high (numbers); medium (heads of the 02-21 tables, recompute and ZeRO-1 assumed by the "
                       "data set)",
            group="BF16 optimizer (fp32 gradients)" if bf16_optimizer else "ZeRO-1 before it (2-byte gradients)",
            stack_overrides={} if bf16_optimizer else DEEPSPEED_ZERO1_OPTIMIZER,
            note="2nd-iteration time only"))
    return out


def narayanan_table2() -> list:
    out = []
    for r in _read("narayanan2021_table2_zero3.csv").itertuples():
        zero3 = "ZeRO-3" in _text(r.sharding)
        ref = f"Table 2, {r.model}, {'ZeRO-3' if zero3 else 'PTD-P'}, {int(r.num_gpus)} GPUs"
        common = dict(
            source="Narayanan 2021 T2", ref=ref, model=r.model, layers=int(r.layers), hidden=int(r.hidden),
            heads=int(r.heads), ffn_hidden=int(r.ffn_hidden), seq_len=int(r.seq_len), vocab=int(r.vocab),
            dropout=MEGATRON_DROPOUT, tie_embeddings=True,
            cluster=nodes_of("A100-SXM4-80GB", int(r.num_gpus), SELENE_GBPS), cluster_note=SELENE,
            tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), global_batch=int(r.global_batch),
            micro_batch=int(r.micro_batch), status="OOM" if r.status == "OOM" else "ok",
            measured_time_s=_num(r.iter_time_s_derived),
            time_note="derived from TFLOP/s with the paper's Eq. 3 (V = 51,200)")
        if zero3:
            out.append(PublishedRow(**common, recompute=None, recompute_options=RECOMPUTE_2021, zero=3,
                                    stack="deepspeed-2021", group="ZeRO-3 (deepspeed-2021)",
                                    confidence="high (numbers); recompute not stated",
                                    note="DeepSpeed ZeRO-3 of spring 2021 on Megatron's GPT model"))
        else:
            out.append(PublishedRow(**common, virtual=None, recompute="full", zero=0, stack="megatron-lm-2021",
                                    group="PTD-P (megatron-lm-2021)",
                                    confidence="high (numbers); medium (tp = 8 and pp = mp/8 assumed)"))
    return out


def deepspeed_azure() -> list:
    out = []
    for r in _read("deepspeed_2022_azure_zero3.csv").itertuples():
        out.append(Skipped("DeepSpeed Azure ZeRO-3 (low confidence)", f"{r.model}, {int(r.num_gpus)} GPUs",
                           "ZeRO-3 with CPU offload (not modelled); global batch, vocabulary and recompute not "
                           "stated, so no iteration time"))
    return out


def mtnlg() -> list:
    out = []
    for r in _read("mtnlg2022_throughput_secondary.csv").itertuples():
        out.append(PublishedRow(
            source="MT-NLG 530B (secondary)", ref=f"Sec. 2.4 via secondary transcription, {int(r.num_gpus)} GPUs",
            model=r.model, layers=int(r.layers), hidden=int(r.hidden), heads=int(r.heads),
            ffn_hidden=int(r.ffn_hidden), seq_len=int(r.seq_len), vocab=int(r.vocab), dropout=MEGATRON_DROPOUT,
            tie_embeddings=True, cluster=nodes_of("A100-SXM4-80GB", int(r.num_gpus), SELENE_GBPS),
            cluster_note=SELENE, tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), global_batch=int(r.global_batch),
            micro_batch=None, virtual=1, recompute=None, recompute_options=RECOMPUTE_2021, zero=(0, 1),
            # Trained in 2021, before DeepSpeed had its BF16 optimizer (2022): 16-bit
            # gradients, reduced in 16 bits through DeepSpeed's buckets.
            stack="megatron-deepspeed", stack_overrides=DEEPSPEED_ZERO1_OPTIMIZER,
            measured_time_s=float(r.iter_time_s), confidence="low (secondary source)",
            note="DeepSpeed pipeline engine (no interleaving); vocabulary 50,272 from the secondary source"))
    return out


# AMP's 30 DeepSpeed layer specs: 0 embedding, 1 transpose, 2-25 blocks, 26 transpose,
# 27 final norm, 28 head, 29 loss. The zoo's units: embedding, 24 blocks, head (final
# norm included), so a spec boundary maps to the number of zoo units that start before it.
AMP_UNIT_SPEC = (0, *range(2, 26), 27)
AMP_NODE_GBPS = {"T4": 50 * Gbit / 4 / GB, "V100": 10 * Gbit / 4 / GB}
"""Per-GPU share of the node's network: g4dn.12xlarge 50 Gbit/s, p3.8xlarge 10 Gbit/s, 4 GPUs each."""
AMP_T4_INTRA_NODE_GBPS = 50 * Gbit / 4 / GB
"""Per-GPU share of a g4dn.12xlarge's links between its GPUs: "4 T4 GPUs with 50 Gbps PCIe
connection intra-node bandwidth" (Li et al. 2022, Sec. 5), shared by its 4 GPUs as the
network figure of the same sentence is, and as AMP's own cost model takes both (its
homogeneous.py and het_cluster.py give every g4dn node 50e9 / 32 bytes/s per GPU, inter- and
intra-node). The catalog's T4 figure is PCIe Gen3's (12 GB/s), which these nodes do not give
their GPUs. The p3.8xlarge keeps the catalog's NVLink (AWS: NVLink between its 4 V100s)."""


def amp_cluster(kind: str) -> Cluster:
    """AMP's clusters: 4 x g4dn.12xlarge (16 T4), or 3 x p3.8xlarge (V100 16GB) + 1 x g4dn.12xlarge."""
    t4 = nodes_of("T4-16GB", 16, AMP_NODE_GBPS["T4"], gpus_per_node=4, intra_node_GBps=AMP_T4_INTRA_NODE_GBPS)
    if kind == "homogeneous":
        return t4
    v100 = nodes_of("V100-SXM2-16GB", 12, AMP_NODE_GBPS["V100"], gpus_per_node=4)

    def group(c: Cluster, name: str, nodes: int) -> NodeGroup:
        return dataclasses.replace(c.groups[0], name=name, nodes=nodes, inter_node=c.inter_node)
    return Cluster(groups=(group(v100, "v100", 3), group(t4, "t4", 1)), inter_node=t4.inter_node,
                   name="amp-3xp3.8xlarge+1xg4dn.12xlarge")


def amp_split(partition: str, pp: int) -> tuple[int, ...] | None:
    """Zoo-unit stage boundaries of an AMP layer partition; None when a stage would hold no unit."""
    bounds = [int(x) for x in partition.strip("[] ").split(",")]
    units = tuple(sum(1 for s in AMP_UNIT_SPEC if s < b) for b in bounds)
    if len(units) != pp + 1 or any(b <= a for a, b in zip(units, units[1:])):
        return None
    return units


def amp_trials() -> list:
    out = []
    for r in _read("amp_2022_gpt2_trials.csv").itertuples():
        kind = "homogeneous" if r.source_table.startswith("homogeneous") else "heterogeneous"
        ref = f"{kind} trial {r.source_table.split('trial ')[-1]}"
        tp, pp = int(r.tp), int(r.pp)
        split = amp_split(r.layer_partition, pp)
        if split is None:
            out.append(Skipped("AMP GPT-2 trials", ref, f"layer partition {r.layer_partition} leaves a pipeline "
                               "stage with only no-op layer specs"))
            continue
        status = {"ok": "ok", "failed": "failed"}.get(r.status, r.status)
        out.append(PublishedRow(
            source="AMP GPT-2 trials", ref=ref, model="GPT-2 24x1024", layers=int(r.layers), hidden=int(r.hidden),
            heads=int(r.heads), seq_len=int(r.seq_len), vocab=get_stack("megatron-deepspeed").padded_vocab(int(r.vocab), tp),
            dropout=MEGATRON_DROPOUT, tie_embeddings=True, cluster=amp_cluster(kind),
            cluster_note=("4 x g4dn.12xlarge (4 T4 on PCIe at 50 Gbit/s per node = 1.56 GB/s per GPU; 50 Gbit/s "
                          "per node between nodes = 1.56 GB/s per GPU)"
                          if kind == "homogeneous" else
                          "3 x p3.8xlarge (4 V100 16GB on NVLink; 10 Gbit/s per node = 0.31 GB/s per GPU) + 1 x "
                          "g4dn.12xlarge (4 T4 on PCIe, 50 Gbit/s per node inside and out); ranks 0-11 on V100 "
                          "(inferred by the data set)"),
            tp=tp, pp=pp, dp=int(r.dp), global_batch=int(r.global_batch), micro_batch=int(r.micro_batch),
            recompute="none", zero=0, split=split, dtype="fp16", stack="megatron-deepspeed", status=status,
            measured_time_s=_num(r.iter_time_s),
            confidence="high" if kind == "homogeneous" else "medium (rank-to-GPU order inferred)",
            group="16 x T4" if kind == "homogeneous" else "12 x V100 + 4 x T4",
            # DeepSpeed's fp16 optimizer without ZeRO keeps the fp16 gradients autograd writes
            # (the tied embedding's are all-reduced so between the first and last stage) and
            # allocates no ZeRO buckets; its data-parallel all-reduce runs in fp32
            # (fp32_allreduce in AMP's examples/ds_config.json): allreduce_bucket flattens the
            # fp16 gradients and casts the flat copy to fp32 (2 + 4 bytes per parameter, in
            # buckets of 5e8 elements, more than a GPT-2 24x1024 rank holds), and it has none
            # of the BF16 optimizer's per-micro-batch passes over the gradients.
            stack_overrides=dict(gradient_bytes_per_param=2.0, half_gradient_bytes_per_param=0.0,
                                 dp_buffer_bytes=0.0, grad_reduce_bytes_per_param=4.0,
                                 grad_reduce_copy_bytes_per_param=6.0, weight_grad_traffic_bytes_per_param=0.0),
            note="DeepSpeed fp16 optimizer without ZeRO: fp16 gradients, no ZeRO buckets, fp32 all-reduce"))
    return out


@dataclass(frozen=True)
class Source:
    """One data file and how its rows are rebuilt."""

    name: str
    build: Callable[[], list]
    stack: str
    """The training stack(s) the rows run on."""
    why: str = ""
    """Why that stack."""


SOURCES: tuple[Source, ...] = (
    Source("Megatron-LM 2024 H100", megatron_2024, "megatron-core-2024",
           "Megatron-Core r0.8.0 (the table's label; added to the README in July 2024)"),
    Source("Megatron-LM Llama3 FP8 example", megatron_fp8_example, "megatron-core-fp8",
           "Transformer Engine FP8 with delayed scaling (--fp8-format hybrid) and FP8 parameters, as the 8B script"),
    Source("Megatron-Bridge DGX-H100", megatron_bridge, "megatron-core-fp8-cs / megatron-core-fp8",
           "Transformer Engine's current scaling ('FP8' and 'FP8-CS' from 25.11 on), delayed scaling for the 25.09 "
           "rows whose precision is not stated"),
    Source("NVIDIA DGX Cloud benchmarking", dgxc_benchmarking, "megatron-core / megatron-core-fp8",
           "NeMo 24.12 (Megatron-Core with Transformer Engine): BF16 rows on megatron-core, FP8 rows on "
           "megatron-core-fp8 (the recipes' fp8_hybrid and fp8_params: delayed scaling)"),
    Source(NEMO_2024, nemo_performance, "megatron-core-2024-fp8",
           "NeMo 24.03-24.07 (Megatron-Core with Transformer Engine 1.x), FP8 with delayed scaling; the stack's FP8 "
           "parameters and bf16 gradients are assumed (the tables do not state them); its attention class is fitted on "
           "the pretraining table"),
    Source("Llama 3 Table 4", llama3_table4, "megatron-core",
           "the nearest shipped stack to Meta's own (bf16 weights, fp32 gradient accumulation and reduce-scatter, "
           "sharded optimizer states)"),
    Source("MegaScale 175B", megascale, "megatron-core",
           "the rows are MegaScale's Megatron-LM baseline (MegaScale itself is built on Megatron-LM), run without "
           "overlap of DP and PP communication and with the explicit attention (MegaScale adds the overlap and "
           "FlashAttention-2)"),
    Source("torchtitan benchmarks", torchtitan_benchmarks, "torchtitan / torchtitan-float8 / torchtitan-float8-rowwise",
           "bf16 runs on torchtitan, Float8 runs on torchao's recipe (tensorwise unless the source says rowwise)"),
    Source("torchtitan docs/performance", torchtitan_docs, "torchtitan / torchtitan-float8",
           "bf16 runs on torchtitan, Float8 runs on torchao's tensorwise recipe"),
    Source(LLM_FOUNDRY, llm_foundry, "llm-foundry / llm-foundry-pure-bf16",
           "amp_bf16 runs (FSDP mixed precision DEFAULT) on llm-foundry, bf16 runs with PURE on llm-foundry-pure-bf16"),
    Source("BLOOM 176B run", bloom_run, "megatron-deepspeed"),
    Source("BLOOM topology sweep", bloom_sweep, "megatron-deepspeed",
           "the stack describes the BF16 optimizer the sweep used from 02-28 on; the earlier rows ran DeepSpeed's "
           "ZeRO-1 optimizer (2-byte gradients reduce-scattered through its buckets: 4 B/param less than the BF16 "
           "optimizer's fp32 buffer and the bf16 gradients it keeps beside it), set per row"),
    Source("Narayanan 2021 T2", narayanan_table2, "megatron-lm-2021 / deepspeed-2021",
           "PTD-P rows on megatron-lm-2021, ZeRO-3 rows on deepspeed"),
    Source("DeepSpeed Azure ZeRO-3 (low confidence)", deepspeed_azure, "deepspeed", "nothing rebuildable"),
    Source("MT-NLG 530B (secondary)", mtnlg, "megatron-deepspeed",
           "MT-NLG trained on Megatron-DeepSpeed, in 2021: with DeepSpeed's 16-bit gradients of the time (set per "
           "row), not the BF16 optimizer of 2022 the stack describes"),
    Source("AMP GPT-2 trials", amp_trials, "megatron-deepspeed",
           "AMP ran Megatron-LM v1.1.5's model code on DeepSpeed's pipeline engine (explicit attention, Apex fused "
           "LayerNorm, gradients reduced after the pipeline flush, blocking p2p), which is what this stack "
           "describes; the deepspeed stack is DeepSpeed ZeRO with HuggingFace models and FlashAttention. AMP's "
           "fp16 optimizer keeps fp16 gradients (the stack: fp32 beside kept bf16 ones), allocates no ZeRO buckets and "
           "all-reduces in fp32 (the stack: bf16): set per row"),
)


def build(sources: Iterable[str] | None = None, limit: int | None = None, what_if: dict | None = None) -> list:
    """Rows and skipped entries of the named sources (all by default), at most ``limit``
    checking rows per source (skipped entries are always all listed). ``what_if`` sets stack
    fields on every row, over what the row itself sets: a diagnostic of how much one
    assumption moves a source, never a fit."""
    names = [s.name for s in SOURCES]
    wanted = list(sources) if sources else names
    for name in wanted:
        if name not in names:
            raise ConfigError("source", f"{name!r} is not a published source", f"known: {', '.join(names)}")
    out = []
    for s in SOURCES:
        if s.name not in wanted:
            continue
        rows = s.build()
        kept = 0
        for r in rows:
            if isinstance(r, PublishedRow):
                if limit is not None and kept >= limit:
                    continue
                kept += 1
                if what_if:
                    r = dataclasses.replace(r, stack_overrides={**r.stack_overrides, **what_if})
            out.append(r)
    return out


# -------------------------------------------------------------------------- estimation
_SPECS: dict[tuple, ModelSpec] = {}


def model_for(row: PublishedRow, stack: Stack) -> ModelSpec:
    """The row's model as its stack runs it (measured once per shape and kernel set), with the
    vocabulary the stack pads at the row's tensor-parallel size (``Stack.padded_vocab``)."""
    vocab = stack.padded_vocab(row.vocab, row.tp)
    key = (row.arch, row.layers, row.hidden, row.heads, row.kv_heads, row.ffn_hidden, row.seq_len, vocab,
           row.dropout, row.tie_embeddings, tuple(stack.model_kernels().items()), row.dtype)
    if key not in _SPECS:
        _SPECS[key] = autoplan.models.transformer(
            layers=row.layers, hidden=row.hidden, heads=row.heads, seq_len=row.seq_len, vocab=vocab,
            ffn_hidden=row.ffn_hidden, kv_heads=row.kv_heads, arch=row.arch, dtype=row.dtype,
            **stack.model_kernels(), dropout=row.dropout,
            tie_embeddings=row.tie_embeddings, name=row.model)
    return _SPECS[key]


def candidate_plans(row: PublishedRow, model: ModelSpec) -> list[tuple[dict, list[Plan]]]:
    """For every open choice except recompute: (the choices, plans in RECOMPUTE_ORDER)."""
    mbs = [row.micro_batch] if row.micro_batch else list(MICRO_BATCHES)
    blocks = sum(1 for l in model.layers if l.kind == "block")
    if row.virtual is not None:
        vs = [row.virtual]
    else:
        vs = [v for v in VIRTUAL_STAGES if row.pp > 1 or v == 1]
        vs = [v for v in vs if v == 1 or (row.pp * v <= blocks and (row.uneven or row.layers % (row.pp * v) == 0))]
    zeros = list(row.zero) if isinstance(row.zero, tuple) else [row.zero]
    sp = row.tp > 1 if row.sequence_parallel is None else row.sequence_parallel
    modes = [row.recompute] if row.recompute else [m for m in RECOMPUTE_ORDER if m in row.recompute_options]
    out = []
    for mb in mbs:
        if row.global_batch % (mb * row.dp):
            continue
        m = row.global_batch // (mb * row.dp)
        for v in vs:
            if v > 1 and m % row.pp:
                continue
            for zero in zeros:
                plans = []
                for rc in modes:
                    try:
                        plan = Plan.uniform(model, row.cluster, tp=row.tp, pp=row.pp, dp=row.dp, micro_batch=mb,
                                            global_batch=row.global_batch, virtual_stages=v,
                                            schedule="interleaved-1f1b" if v > 1 else "1f1b", recompute=rc,
                                            sequence_parallel=sp, zero=zero, dtype=row.dtype, cp=row.cp,
                                            cp_comm=row.cp_comm)
                        if row.split is not None:
                            plan = plan.with_split(list(zip(row.split, row.split[1:]))).validate(model, row.cluster)
                    except ConfigError:
                        continue
                    plans.append(plan)
                if plans:
                    out.append((dict(micro_batch=mb, virtual=v, zero=zero, sequence_parallel=sp), plans))
    return out


def evaluate_row(row: PublishedRow, recompute: str | None = None) -> RowResult:
    """The row's estimate; open choices resolved to the fastest plan predicted to fit (when
    none fits: the fastest for a run that ran, the leanest for one that ran out of memory).
    ``recompute`` overrides the row's mode (for the bounds of a bracketed row)."""
    if recompute is not None:
        row = dataclasses.replace(row, recompute=recompute)
    stack = dataclasses.replace(get_stack(row.stack), **row.stack_overrides)
    model = model_for(row, stack)
    tried = []
    for choice, plans in candidate_plans(row, model):
        for plan in plans:
            est = estimate(model, row.cluster, plan, stack=stack)
            # Ranked by time among plans that fit; when none fits, a run that happened is
            # compared with the fastest plan (memory is what the model got wrong), an
            # out-of-memory one with the leanest (the one closest to fitting).
            lean = not est.fits and row.status != "ok"
            tried.append((not est.fits, est.peak_memory_bytes if lean else est.iteration_time_s, choice, plan, est))
            if est.fits:
                break  # the next recompute mode is no faster under the model
    if not tried:
        raise ConfigError(f"{row.source}: {row.ref}", "no plan of the published degrees is valid for this model")
    tried.sort(key=lambda c: (c[0], c[1]))
    _, _, choice, plan, est = tried[0]
    open_ = {}
    if row.micro_batch is None:
        open_["micro_batch"] = choice["micro_batch"]
    if row.virtual is None:
        open_["virtual"] = choice["virtual"]
    if row.recompute is None:
        open_["recompute"] = plan.recompute
    if row.sequence_parallel is None:
        open_["sequence_parallel"] = choice["sequence_parallel"]
    if isinstance(row.zero, tuple):
        open_["zero"] = choice["zero"]
    measured = row.measured_time_s
    if measured is None and row.measured_tflops is not None:
        measured = plan.global_batch * model.flops_per_sample() / (row.gpus * row.measured_tflops * 1e12)
    return RowResult(row=row, est=est, plan=plan, chosen=open_, measured_time_s=measured)


def evaluate(rows: Iterable, progress: Callable[[str], None] | None = None) -> "TablesReport":
    """Estimate every checking row (skipped entries pass through)."""
    results, brackets, skipped = [], [], []
    items = list(rows)
    n = sum(isinstance(r, PublishedRow) for r in items)
    done, start = 0, time.perf_counter()
    for r in items:
        if isinstance(r, Skipped):
            skipped.append(r)
            continue
        if r.recompute_bracket:
            brackets.append(BracketResult(r, lean=evaluate_row(r, "full"), rich=evaluate_row(r, "none")))
        else:
            results.append(evaluate_row(r))
        done += 1
        if progress and (done % 20 == 0 or done == n):
            progress(f"  published rows: {done}/{n} estimated ({time.perf_counter() - start:.0f} s)")
    return TablesReport(results, skipped, brackets)


# ------------------------------------------------------------------- AMP layer profiles
@dataclass(frozen=True)
class LayerCheck:
    """Measured vs roofline forward time of one GPT-2 block (TP all-reduce included)."""

    device: str
    tp: int
    layers: int
    """Transformer-layer rows of the profile."""
    measured_ms: float
    """Median forward time over the profile's 24 transformer layers."""
    measured_spread_ms: tuple[float, float]
    predicted_ms: float
    """max(host, kernels + all-reduce): the forward and the all-reduce that outlasts its wait
    on the host."""
    predicted_compute_ms: float
    """The forward alone: its kernels, or the host's time to issue them where longer."""
    predicted_tp_ms: float
    """The tensor-parallel all-reduce."""

    @property
    def error(self) -> float:
        return self.measured_ms / self.predicted_ms - 1


AMP_PROFILE_DEVICES = {"T4": "T4-16GB", "V100": "V100-SXM2-16GB"}


def write_fitted(stack_name: str, values: dict, sources: dict) -> None:
    """Write fitted figures (file keys -> values) and their sources into a shipped stack file,
    keeping its key order (a new key goes before ``sources``), and drop the cached stacks."""
    path = STACK_DIR / f"{stack_name}.json"
    data = json.loads(path.read_text())
    fresh = {k: v for k, v in values.items() if k not in data}
    data.update({k: v for k, v in values.items() if k in data})
    sourced = data.pop("sources", {})
    data.update(fresh)
    data["sources"] = {**sourced, **sources}
    path.write_text(json.dumps(data, indent=2) + "\n")
    from autoplan import stacks
    stacks._load.cache_clear()


def fit_forward_host_time(stack_name: str = "megatron-deepspeed", dtype: str = "fp16") -> float:
    """The stack's forward host time per kernel, fitted on AMP's per-layer forward profiles
    (its fitting data; AMP's end-to-end trials only check it): the median over the profiles
    of the measured forward less the predicted tensor-parallel all-reduce, per forward
    kernel of the block. Rewrites the stack file and returns the figure in seconds."""
    stack = dataclasses.replace(get_stack(stack_name), forward_host_s_per_kernel=0.0)
    per_kernel = []
    for c, block in _amp_blocks(stack, dtype):
        # A profile the device alone (its kernels and all-reduces) would not fill waited on
        # the host for the whole of it: the host issues the all-reduces too.
        if c.measured_ms > c.predicted_ms:
            per_kernel.append(c.measured_ms * 1e-3 / block.kernels_fwd)
    value = float(np.median(per_kernel))
    write_fitted(stack_name, {"forward_host_us_per_kernel": round(value * 1e6, 1)}, {"forward_host_us_per_kernel": (
        f"fitted on AMP's per-layer forward profiles of a GPT-2 block on T4 and V100 (PyTorch 1.7, Megatron-LM v1.1.5 "
        f"model code; `python benchmarks/published/validate.py --fit`): the median over the {len(per_kernel)} profiles "
        "longer than their predicted kernels and tensor-parallel all-reduces of the measured forward / the "
        "block's forward kernels (the host issues the all-reduces as well and goes on while they run); they run "
        "3-9x the GPU's roofline at micro-batch 1 whatever the GPU, as host-bound work does. AMP's end-to-end "
        "trials only check it")})
    return value


def amp_layer_checks(stack_name: str = "megatron-deepspeed", dtype: str = "fp16") -> list[LayerCheck]:
    """AMP's per-layer forward profiles (micro-batch 1, one node of ``tp`` GPUs) against
    ``layer_timing`` of the same GPT-2 block on the same device, in the dtype AMP ran
    (``--fp16`` in its profiling script and DeepSpeed config); they are the fitting data of
    the stack's forward host time per kernel."""
    return [c for c, _ in _amp_blocks(get_stack(stack_name), dtype)]


def _amp_blocks(stack: Stack, dtype: str) -> list:
    """(check, block spec) per AMP profile under ``stack``."""
    df = _read("amp_2022_gpt2_layer_forward_profile.csv")
    stack_name = stack.name
    out: list = []
    for (gpu, tp), g in df.groupby(["gpu", "tp"], sort=True):
        device_name = next(v for k, v in AMP_PROFILE_DEVICES.items() if gpu.startswith(k))
        device = get_device(device_name)
        blocks = g[g.layer_kind == "transformer layer"].forward_ms
        r = g.iloc[0]
        row = PublishedRow(source="AMP layer profile", ref=f"{gpu} tp={tp}", model="GPT-2 24x1024",
                           layers=int(r.layers), hidden=int(r.hidden), heads=int(r.heads), seq_len=int(r.seq_len),
                           # Only the block is timed, and it does not depend on the vocabulary.
                           vocab=stack.padded_vocab(int(r.vocab)), dropout=MEGATRON_DROPOUT,
                           # (The profiles ran on the trials' nodes: the same links inside them.)
                           tie_embeddings=True, cluster=nodes_of(
                               device_name, int(tp), 1.0, gpus_per_node=4,
                               intra_node_GBps=AMP_T4_INTRA_NODE_GBPS if device_name == "T4-16GB" else None),
                           tp=int(tp), pp=1, dp=1, global_batch=1, dtype=dtype, stack=stack_name)
        block = next(l for l in model_for(row, stack).layers if l.kind == "block")
        t = layer_timing(device, block, 1, int(tp), False, dtype, None, stack.attention,
                         forward_host_s_per_kernel=stack.forward_host_s_per_kernel)
        comm = 0.0
        if tp > 1:
            comm = block.tp_allreduces_fwd * collective_time(row.cluster, list(range(int(tp))), block.output_bytes,
                                                             "all_reduce")
        out.append((LayerCheck(device=device_name, tp=int(tp), layers=len(blocks), measured_ms=float(blocks.median()),
                               measured_spread_ms=(float(blocks.min()), float(blocks.max())),
                               predicted_ms=(t.forward + hidden_tp_forward(comm, t.forward_host_wait)) * 1e3,
                               predicted_compute_ms=t.forward * 1e3, predicted_tp_ms=comm * 1e3), block))
    return out


# ------------------------------------------------------------------------------ report
def _pct(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def _mean(xs: list[float], absolute: bool = False) -> float | None:
    return float(np.mean(np.abs(xs) if absolute else xs)) if xs else None


@dataclass
class SourceStats:
    """The report's figures for one source."""

    source: str
    rows: int
    """Checking rows (bracketed rows not included)."""
    skipped: int
    time_errors: list[float]
    """measured / predicted - 1 of the rows that ran and have a time."""
    agree: int
    outcomes: int
    """Rows with a clean outcome (ran or out of memory) the agreement is over."""
    oom_rows: int
    failed_rows: int
    failed_predicted_oom: int
    memory_errors: list[float]
    brackets: int = 0
    bracket_time_within: tuple[int, int] = (0, 0)
    bracket_peak_within: tuple[int, int] = (0, 0)
    bracket_contradictions: tuple[int, int] = (0, 0)

    @property
    def time_mape(self) -> float | None:
        return _mean(self.time_errors, absolute=True)

    @property
    def time_signed(self) -> float | None:
        return _mean(self.time_errors)

    @property
    def memory_mape(self) -> float | None:
        return _mean(self.memory_errors, absolute=True)

    @property
    def memory_signed(self) -> float | None:
        return _mean(self.memory_errors)


def _count(values) -> tuple[int, int]:
    """(how many are True, how many are not None)."""
    vals = [v for v in values if v is not None]
    return sum(bool(v) for v in vals), len(vals)


@dataclass
class TablesReport:
    """Estimates of every published source, and the report built from them."""

    results: list[RowResult]
    skipped: list[Skipped]
    brackets: list[BracketResult] = field(default_factory=list)
    layer_checks: list[LayerCheck] = field(default_factory=list)

    def sources(self) -> list[str]:
        """Sources present in the report, in SOURCES order."""
        present = ({r.row.source for r in self.results} | {b.row.source for b in self.brackets}
                   | {s.source for s in self.skipped})
        return [s.name for s in SOURCES if s.name in present]

    def groups(self, source: str) -> list[str]:
        """The named parts of a source, in row order (empty when it has none)."""
        seen = []
        for r in [r.row for r in self.results] + [b.row for b in self.brackets]:
            if r.source == source and r.group and r.group not in seen:
                seen.append(r.group)
        return seen

    def stats(self, source: str, group: str | None = None) -> SourceStats:
        """Figures of a source's checking rows (or of one of its groups, fitting or not)."""
        res = [r for r in self.results if r.row.source == source
               and (r.row.group == group if group is not None else not r.row.fitting)]
        br = [b for b in self.brackets if b.row.source == source and group in (None, b.row.group)]
        clean = [r for r in res if r.fits_agrees is not None]
        failed = [r for r in res if r.row.status == "failed"]
        return SourceStats(
            source=source, rows=len(res), skipped=sum(s.source == source for s in self.skipped),
            time_errors=[e for r in res if (e := r.time_error) is not None],
            agree=sum(bool(r.fits_agrees) for r in clean), outcomes=len(clean),
            oom_rows=sum(r.row.status == "OOM" for r in res), failed_rows=len(failed),
            failed_predicted_oom=sum(not r.est.fits for r in failed),
            memory_errors=[e for r in res if (e := r.memory_error) is not None], brackets=len(br),
            bracket_time_within=_count(b.time_within for b in br),
            bracket_peak_within=_count(b.peak_within for b in br),
            bracket_contradictions=_count(b.contradicts for b in br))

    def fitting_rows(self, source: str, group: str | None = None) -> int:
        """How many of a source's rows (or of one of its groups) fitted a figure of their stack."""
        return sum(r.row.fitting for r in self.results
                   if r.row.source == source and group in (None, r.row.group))

    def time_errors_by_stack(self) -> dict[str, list[float]]:
        """measured / predicted - 1 of every checking row with a measured (or derived) time,
        by the stack it ran on (bracketed rows have no single prediction and are left out)."""
        out: dict[str, list[float]] = {}
        for r in self.results:
            if not r.row.fitting and (e := r.time_error) is not None:
                out.setdefault(r.row.stack, []).append(e)
        return out

    def summary_lines(self) -> list[str]:
        """One line per source, for the report's summary list."""
        lines = []
        for name in self.sources():
            s = self.stats(name)
            parts = [f"{s.rows} rows, {s.skipped} skipped"]
            fitting = self.fitting_rows(name)
            if fitting:
                parts[0] += f" ({fitting} more fitted a figure of the stack: their part below, not in the figures)"
            if s.time_errors:
                parts.append(f"iteration-time MAPE **{_pct(s.time_mape)}** over {len(s.time_errors)} rows "
                             f"(mean signed {_pct(s.time_signed, True)})")
            if s.oom_rows:
                parts.append(f"fits/OOM agreement {s.agree}/{s.outcomes} ({s.oom_rows} out of memory)")
            elif s.outcomes:
                parts.append(f"predicted to fit {s.agree}/{s.outcomes}")
            if s.failed_rows:
                parts.append(f"{s.failed_predicted_oom} of {s.failed_rows} failed runs predicted out of memory")
            if s.memory_errors:
                parts.append(f"peak-memory error {_pct(s.memory_mape)} over {len(s.memory_errors)} rows "
                             f"(mean signed {_pct(s.memory_signed, True)})")
            by_group = [(g, self.stats(name, g)) for g in self.groups(name)]
            if len(by_group) > 1:
                parts.append("by part: " + ", ".join(
                    f"{g}: " + ", ".join(x for x in (
                        f"time {_pct(gs.time_mape)}" if gs.time_errors else "",
                        f"memory {_pct(gs.memory_signed, True)} signed" if gs.memory_errors else "",
                        f"fits/OOM {gs.agree}/{gs.outcomes}" if gs.oom_rows else "") if x)
                    for g, gs in by_group))
            if s.brackets:
                parts.append(f"{s.brackets} bracketed rows: time within the none..full bounds "
                             f"{s.bracket_time_within[0]}/{s.bracket_time_within[1]}, peak within "
                             f"{s.bracket_peak_within[0]}/{s.bracket_peak_within[1]}, outcome contradicted "
                             f"{s.bracket_contradictions[0]}/{s.bracket_contradictions[1]}")
            lines.append(f"- {name}: " + "; ".join(parts))
        allt = [e for errs in self.time_errors_by_stack().values() for e in errs]
        if allt:
            lines.append(f"- all published rows above: iteration-time MAPE **{_pct(_mean(allt, True))}** over "
                         f"{len(allt)} rows (mean signed {_pct(_mean(allt), True)})")
        if self.layer_checks:
            lines.append("- AMP per-layer forward profiles (GPT-2 block, fp16; fitting data of the stack's forward host "
                         "time per kernel), measured / predicted: "
                         + ", ".join(f"{c.device.split('-')[0]} tp{c.tp} {c.measured_ms / c.predicted_ms:.2f}x"
                                     for c in self.layer_checks))
        return lines

    def section_lines(self) -> list[str]:
        """Per-source figures, assumptions, per-row tables, bracketed and skipped runs and the
        layer check, as markdown."""
        by_name = {s.name: s for s in SOURCES}
        lines = ["Error = measured / predicted - 1 (positive: the prediction is too fast; MAPE is the mean of "
                 "its absolute value). Fits/OOM agreement is given where the source has out-of-memory rows.", "",
                 "| source | stack | rows | skipped | time MAPE | signed mean | fits/OOM agree | peak-memory MAPE | "
                 "memory signed | bracketed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name in self.sources():
            for group in [None, *self.groups(name)]:
                s = self.stats(name, group)
                agree = (f"{s.agree}/{s.outcomes}" if s.oom_rows else
                         (f"({s.agree}/{s.outcomes} fit)" if s.outcomes else ""))
                label = (name if group is None else f"&nbsp;&nbsp;apart: {group}" if self.fitting_rows(name, group)
                         else f"&nbsp;&nbsp;of which {group}")
                skipped = s.skipped if group is None else ""
                lines.append(f"| {label} | {by_name[name].stack if group is None else ''} | {s.rows} | {skipped} | "
                             f"{_pct(s.time_mape)} | {_pct(s.time_signed, True)} | {agree} | {_pct(s.memory_mape)} | "
                             f"{_pct(s.memory_signed, True)} | {s.brackets or ''} |")
        lines += ["", "Stacks, clusters and confidence per source:", ""]
        for name in self.sources():
            rows = [r.row for r in self.results if r.row.source == name] + \
                   [b.row for b in self.brackets if b.row.source == name]
            notes = sorted({r.cluster_note for r in rows if r.cluster_note})
            conf = sorted({r.confidence for r in rows})
            src = by_name[name]
            lines.append(f"- **{name}**: stack {src.stack}" + (f" — {src.why}" if src.why else "") + "."
                         + (f" Cluster: {'; '.join(notes)}." if notes else "")
                         + (f" Confidence: {'; '.join(conf)}." if conf else ""))
        lines += ["", "Per row (`*` = not given by the source: the fastest choice the cost model predicts to fit; "
                  "when none fits, the fastest for a run that ran and the leanest for one that did not. Peak GiB = "
                  "measured / predicted, allocator-reserved or whole-device as the source measured, or the predicted "
                  "total against the device's memory when nothing was measured):", "",
                  "| source | row | model | GPUs | t | p | d | mb | v | recompute | zero | stack | measured s | "
                  "predicted s | error | outcome | predicted | peak GiB | note |", "|" + "---|" * 19]
        lines += [self._row_line(r) for r in self.results]
        if self.brackets:
            lines += ["", "Bracketed rows (the run's recompute policy lies between the planner's 'none' and 'full'; "
                      "the bounds are the estimates under each):", "",
                      "| source | row | model | GPUs | t | p | d | mb | measured s | predicted s (none..full) | "
                      "outcome | predicted | peak GiB measured | predicted (full..none) | note |",
                      "|" + "---|" * 15]
            for b in self.brackets:
                row = b.row
                meas = f"{b.measured_time_s:.3g}" if b.measured_time_s is not None else ""
                lo, hi = b.time_bounds
                plo, phi = b.peak_bounds
                mark = {True: "", False: " ✗", None: ""}
                lines.append(f"| {row.source} | {row.ref} | {row.model} | {row.gpus} | {row.tp} | {row.pp} | "
                             f"{row.dp} | {b.lean.plan.micro_batch} | {meas} | {lo:.3g}..{hi:.3g}"
                             f"{mark[b.time_within]} | {self._outcome(row.status)} | {b.predicted}"
                             f"{' ✗' if b.contradicts else ''} | "
                             f"{'' if row.measured_peak_GiB is None else f'{row.measured_peak_GiB:.1f}'} | "
                             f"{plo:.1f}..{phi:.1f}{mark[b.peak_within]} | {row.note} |")
            lines.append("")
            lines.append("✗ = the measurement lies outside the bounds, or the outcome contradicts the model.")
        lines += self._float8_lines()
        if self.skipped:
            lines += ["", "Not checking rows (skipped, with the reason):", "", "| source | run | reason |",
                      "|---|---|---|"]
            lines += [f"| {s.source} | {s.ref} | {s.reason} |" for s in self.skipped]
        if self.layer_checks:
            lines += ["", *self._layer_lines()]
        lines += self._amp_layout_lines()
        return lines

    def _amp_layout_lines(self) -> list[str]:
        """AMP's trials by layout: where what is left of their error lies."""
        cells: dict = {}
        for r in self.results:
            if r.row.source == "AMP GPT-2 trials" and r.time_error is not None:
                key = (r.row.group, "no" if r.plan.pp == 1 else "yes", r.plan.tp)
                cells.setdefault(key, []).append(r.time_error)
        if not cells:
            return []
        lines = ["", "AMP GPT-2 trials by layout, measured / predicted - 1 (mean signed, with the number of trials):",
                 "", "| cluster | pipelined | tensor-parallel degree | trials | mean signed | range |",
                 "|---|---|---:|---:|---:|---:|"]
        for (group, piped, tp), errs in sorted(cells.items()):
            lines.append(f"| {group} | {piped} | {tp} | {len(errs)} | {_pct(float(np.mean(errs)), True)} | "
                         f"{_pct(min(errs), True)} to {_pct(max(errs), True)} |")
        return lines

    def float8_pairs(self) -> list[tuple[PublishedRow, float, tuple[float, float]]]:
        """(fp8 row, measured speedup, predicted speedup under 'none' and under 'full'
        recompute) of every fp8 run whose document also ran its configuration in bf16 (same
        table or file, model, degrees, batch, recompute and compilation): the two share every
        other error, so their ratio checks the fp8 model alone."""
        def key(row):
            return (row.source, row.ref.split(":")[0], row.model, row.gpus, row.tp, row.pp, row.dp, row.cp,
                    row.seq_len, row.global_batch, row.micro_batch, row.recompute, "torch.compile" in row.note)
        entries = [(r.row, r.measured_time_s, (r.est.iteration_time_s,) * 2) for r in self.results]
        entries += [(b.row, b.measured_time_s, b.time_bounds) for b in self.brackets]
        bf16 = {key(row): (m, p) for row, m, p in entries if m and get_stack(row.stack).fp8_cast is None}
        out = []
        for row, m, p in entries:
            if m and get_stack(row.stack).fp8_cast is not None and key(row) in bf16:
                base_m, base_p = bf16[key(row)]
                out.append((row, base_m / m, (base_p[0] / p[0], base_p[1] / p[1])))
        return out

    def _float8_lines(self) -> list[str]:
        pairs = self.float8_pairs()
        if not pairs:
            return []
        lines = ["", "Float8 over bf16, the same configuration run both ways in one document (speedup = bf16 "
                 "time / fp8 time; a bracketed run's predicted speedup under 'none' and 'full' recompute):", "",
                 "| source | fp8 run | stack | measured speedup | predicted speedup |", "|---|---|---|---:|---:|"]
        for row, measured, (rich, lean) in pairs:
            predicted = f"{rich:.2f}" if abs(rich - lean) < 5e-3 else f"{rich:.2f}..{lean:.2f}"
            lines.append(f"| {row.source} | {row.ref} | {row.stack} | {measured:.2f} | {predicted} |")
        return lines

    @staticmethod
    def _outcome(status: str) -> str:
        return {"ok": "ran", "OOM": "**OOM**", "failed": "failed"}[status]

    def _row_line(self, r: RowResult) -> str:
        row, c = r.row, r.chosen

        def mark(key, value):
            return f"{value}*" if key in c else f"{value}"
        rc = mark("recompute", r.plan.recompute)
        if r.plan.sequence_parallel:
            rc += " + SP" + ("*" if "sequence_parallel" in c else "")
        meas = f"{r.measured_time_s:.3g}" if r.measured_time_s is not None else ""
        if row.measured_tflops is not None:
            meas += f" ({row.measured_tflops:g} TFLOP/s)"
        if row.measured_peak_GiB is not None:
            mem = f"{row.measured_peak_GiB:.1f} / {r.predicted_peak_GiB:.1f}"
        else:
            mem = f"— / {r.est.peak_memory_bytes / GiB:.1f} total"
        cp = f"context parallelism {row.cp} ({row.cp_comm})" if row.cp > 1 else ""
        note = "; ".join(x for x in ("fitting row" if row.fitting else "", cp,
                                     row.time_note if row.time_note != "measured" else "", row.note) if x)
        return (f"| {row.source} | {row.ref} | {row.model} | {row.gpus} | {row.tp} | {row.pp} | {row.dp} | "
                f"{mark('micro_batch', r.plan.micro_batch)} | {mark('virtual', r.plan.virtual_stages)} | {rc} | "
                f"{mark('zero', r.plan.zero)} | {row.stack} | {meas} | {r.est.iteration_time_s:.3g} | "
                f"{_pct(r.time_error, True)} | {self._outcome(row.status)} | {r.est.status} | {mem} | {note} |")

    def _layer_lines(self) -> list[str]:
        lines = ["AMP per-layer forward profiles against `costmodel.compute.layer_timing` (GPT-2 block, seq 1024, "
                 "micro-batch 1, fp16 as AMP ran it; the tensor-parallel all-reduce is included on both sides). "
                 "They are the fitting data of the `megatron-deepspeed` stack's forward host time per kernel; the "
                 "AMP trials above only check it:", "",
                 "| device | tp | blocks | measured ms (median; min-max) | predicted ms (forward, its wait on the host "
                 "included; TP all-reduce, which fills that wait first) | "
                 "measured/predicted |", "|---|---:|---:|---:|---:|---:|"]
        for c in self.layer_checks:
            lines.append(f"| {c.device} | {c.tp} | {c.layers} | {c.measured_ms:.2f} ({c.measured_spread_ms[0]:.2f}-"
                         f"{c.measured_spread_ms[1]:.2f}) | {c.predicted_ms:.2f} ({c.predicted_compute_ms:.2f}; "
                         f"{c.predicted_tp_ms:.2f}) | {c.measured_ms / c.predicted_ms:.2f} |")
        by = {(c.device.split("-")[0], c.tp): c for c in self.layer_checks}
        ratios = [f"tp{tp}: measured {by['T4', tp].measured_ms / by['V100', tp].measured_ms:.2f}, predicted "
                  f"{by['T4', tp].predicted_ms / by['V100', tp].predicted_ms:.2f}"
                  for tp in sorted({c.tp for c in self.layer_checks}) if ("T4", tp) in by and ("V100", tp) in by]
        if ratios:
            lines += ["", "T4 / V100 block-time ratio: " + "; ".join(ratios) + "."]
        return lines


def report(sources: Iterable[str] | None = None, limit: int | None = None,
           progress: Callable[[str], None] | None = None, layers: bool = True,
           what_if: dict | None = None) -> TablesReport:
    """Build, estimate and collect every published source (the AMP layer check included)."""
    rep = evaluate(build(sources, limit, what_if), progress)
    if layers and (sources is None or "AMP GPT-2 trials" in sources):
        rep.layer_checks = amp_layer_checks()
    return rep


def parse_what_if(items: Iterable[str]) -> dict:
    """``FIELD=VALUE`` pairs as stack overrides. FIELD is spelled as stack files and ``autoplan
    stacks NAME`` spell it (``nccl_MiB_per_group``: converted to the field's SI unit) or as the
    Stack field; VALUE is read as JSON where it parses (numbers, true/false), else as text."""
    from autoplan.stacks import _FILE_KEYS, _FILE_UNITS
    fields = {f.name for f in dataclasses.fields(Stack)}
    by_file_key = {key: (name, _FILE_UNITS[name]) for name, key in _FILE_KEYS.items()}
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        field_name, unit = by_file_key.get(name, (name, 1))
        if not sep or field_name not in fields:
            raise ConfigError("--what-if", f"{item!r} is not FIELD=VALUE with a stack field",
                              "e.g. --what-if attention=flash2 (the fields: autoplan stacks megatron-core)")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out[field_name] = value * unit if unit != 1 and isinstance(value, (int, float)) else value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", action="append", help="only this source (repeatable); default: all")
    ap.add_argument("--limit", type=int, default=None, help="at most this many checking rows per source")
    ap.add_argument("--out", default=None, help="also write the section as markdown to this file")
    ap.add_argument("--what-if", action="append", default=[], metavar="FIELD=VALUE",
                    help="estimate every row with this stack field set (repeatable; e.g. attention=flash2): how "
                         "much one assumption moves a source, never written anywhere but --out")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rep = report(args.source, args.limit, progress=print, what_if=parse_what_if(args.what_if))
    text = ["# Cost model against the published runs under benchmarks/published/data", "",
            *rep.summary_lines(), "", *rep.section_lines(), "",
            f"({len(rep.results)} rows estimated in {time.perf_counter() - start:.0f} s)", ""]
    print("\n".join(rep.summary_lines()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(text))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
