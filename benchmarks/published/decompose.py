"""Where the cost model's iteration-time error lives.

For every published row the validation report checks (``validate.py``: the Megatron-LM
tables, the sources under ``data/``, the Hagemann et al. 2023 runs), the predicted
iteration time of the row's plan is split into its parts on the critical rank -- compute
(itself split into GEMMs, attention, bandwidth-bound kernels and launches by the
roofline), tensor-parallel communication, pipeline bubble, and the exposed data-parallel
reduction, parameter gather and optimizer step -- and the error (measured / predicted - 1)
is set against those parts. The views:

1. per source, each part's mean share of the predicted time;
2. per source and part, the factor that part alone would need to be scaled by for the
   source's mean signed error to vanish (holding the others), and the MAPE it would leave:
   a mechanism that explains a bias should need about the same factor in every source it
   touches;
3. within a source, the error against the bandwidth-bound share of the time;
4. for the Hagemann runs, a non-negative least-squares fit of measured time on the parts,
   fitting and checking tables apart;
5. for the Hagemann runs, whether a fixed cost per micro-batch of pipelined runs, fitted on
   the fitting tables, ranks the checking tables better;
6. for the Hagemann runs, whether the pipelined runs' excess shows under every attention
   kernel the sweep ran (each in its own batch of trials) or in one batch only.

Diagnostics only: nothing here is fitted into the model or its stacks.

    python benchmarks/published/decompose.py     # writes benchmarks/results/time_decomposition.md
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import brentq, nnls
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autoplan.catalog import get_device  # noqa: E402
from autoplan.stacks import get_stack  # noqa: E402
from benchmarks.published import tables, validate  # noqa: E402
from costmodel import estimate  # noqa: E402
from costmodel.compute import roofline_parts  # noqa: E402
from costmodel.efficiency import default_efficiency  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "time_decomposition.md"
COMPUTE_KINDS = ("gemm", "attention", "bandwidth", "launch")
"""How the roofline spends a layer's compute time: matmuls (linear layers and an explicit
attention's batched products), fused-attention FLOPs, bandwidth-bound kernels, launches."""
PARTS = (*COMPUTE_KINDS, "tp", "bubble", "dp")
"""The parts of a predicted iteration: the compute kinds, tensor-parallel communication,
pipeline bubble (waiting, imbalance included), and exposed data-parallel reduction,
parameter gather and optimizer step ('dp')."""
SKIPPED_SOURCES = {"AMP GPT-2 trials": "host-bound fp16 trials on T4/V100 (the stack's forward host time per "
                                       "kernel, fitted on AMP's layer profiles, decides them)"}
FACTOR_RANGE = (0.05, 50.0)


# ----------------------------------------------------------------------------- parts
def compute_split(device, layers, micro_batch: int, tp: int, sequence_parallel: bool, stack,
                  dtype: str = "bf16") -> dict[str, float]:
    """Roofline seconds of one forward and backward of ``layers`` by kind (no recompute), with
    the stack's attention kernel and fp8 linears."""
    eff = default_efficiency(device.name)
    out = dict.fromkeys(COMPUTE_KINDS, 0.0)
    for layer in layers:
        for kind, seconds in roofline_parts(device, eff, layer, micro_batch, tp, sequence_parallel, dtype,
                                            stack.attention, stack.fp8_cast,
                                            stack.traffic).items():
            out[kind] += seconds
    return out


def row_parts(est, model, device, stack) -> dict[str, float]:
    """Seconds of each part of an estimate's iteration on its critical rank; the compute
    is split in the proportions of the roofline over the model's layers."""
    b = est.breakdown
    plan = est.plan
    split = compute_split(device, model.layers, plan.micro_batch, plan.tp, plan.sequence_parallel, stack,
                          plan.dtype)
    total = sum(split.values()) or 1.0
    out = {k: b["compute"] * v / total for k, v in split.items()}
    out["tp"] = b["tp_communication"] + b.get("ep_communication", 0.0) + b.get("cp_communication", 0.0)
    out["bubble"] = b["bubble"]
    out["dp"] = b["dp_communication"] + b["optimizer"]
    return out


def _record(source: str, ref: str, measured: float, est, model, device, stack, **extra) -> dict:
    return dict(source=source, ref=ref, measured=measured, predicted=est.iteration_time_s, stack=stack.name,
                **row_parts(est, model, device, stack), **extra)


# ------------------------------------------------------------------------------ rows
def public_rows() -> list[dict]:
    """The Megatron-LM tables of validate.py and every source under data/ with a time."""
    out = []
    a100 = get_device("A100-SXM4-80GB")   # the cluster validate.estimate_row builds
    for row in validate.narayanan_rows() + validate.korthikanti_rows():
        est, _, _ = validate.estimate_row(row)
        out.append(_record(row.source, row.model, row.measured_time_s, est, validate.row_model(row), a100,
                           validate.row_stack(row)))
    for r in tables.build():
        if (not isinstance(r, tables.PublishedRow) or r.recompute_bracket or r.status != "ok"
                or r.source in SKIPPED_SOURCES):
            continue
        res = tables.evaluate_row(r)
        if res.measured_time_s is None:
            continue
        stack = dataclasses.replace(get_stack(r.stack), **r.stack_overrides)
        # Parts on different stacks, and rows that fitted a figure of their stack, are shown apart.
        apart = r.source.startswith("Narayanan") or r.fitting
        source = f"{r.source} ({r.group})" if r.group and apart else r.source
        out.append(_record(source, r.ref, res.measured_time_s, res.est, tables.model_for(r, stack),
                           r.cluster.groups[0].device, stack, dropout=r.dropout))
    return out


def hagemann_rows() -> tuple[list[dict], float]:
    """The Hagemann runs that ran, each with its own attention and norm kernels, on the
    network the report chooses (``fa2``: a FlashAttention-2 run, the ones the report ranks)."""
    H = validate.hagemann_frame()
    gbps, _, _ = validate.fit_hagemann_network(H[H.fitting])   # (the choice reads the fitting tables only)
    out, specs = [], {}
    for r in H[H.status == "ok"].itertuples():
        stack = validate.hagemann_stack(r.kernel_raw)
        model, cluster, plan = validate._hagemann_run(r, stack, specs, gbps)
        est = estimate(model, cluster, plan, stack=stack)
        source = "Hagemann 13B (fitting)" if r.fitting else "Hagemann 30B/65B (checking)"
        out.append(_record(source, r.table, r.iter_time_s, est, model, cluster.groups[0].device, stack,
                           dp_degree=plan.dp, pp_degree=plan.pp, micro_batches=plan.num_micro_batches,
                           kernel=r.kernel_raw, fa2=bool(r.fa2), trial=int(r.trial_id)))
    return out, gbps


# ------------------------------------------------------------------------- analysis
def closing_factor(measured: np.ndarray, predicted: np.ndarray, part: np.ndarray) -> float:
    """The factor f for which scaling ``part`` alone (predicted + (f - 1) * part) makes the
    mean of measured / predicted - 1 zero; NaN when no f in FACTOR_RANGE does."""
    if not np.any(part > 0):
        return float("nan")

    def signed(f: float) -> float:
        return float(np.mean(measured / (predicted + (f - 1.0) * part) - 1.0))

    lo, hi = FACTOR_RANGE
    if np.any(predicted + (lo - 1.0) * part <= 0) or signed(lo) * signed(hi) > 0:
        return float("nan")
    return float(brentq(signed, lo, hi))


def _pct(x: float, signed: bool = False) -> str:
    return "" if x != x else (f"{x:+.1%}" if signed else f"{x:.1%}")


def _num(x: float, fmt: str = ".2f") -> str:
    return "" if x != x else format(x, fmt)


def shares_lines(df: pd.DataFrame) -> list[str]:
    head = ["source", "rows", "signed", "MAPE", *[f"{p} share" for p in PARTS]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for source, g in df.groupby("source", sort=False):
        err = g.measured / g.predicted - 1
        shares = [(g[p] / g.predicted).mean() for p in PARTS]
        lines.append(f"| {source} | {len(g)} | {_pct(err.mean(), True)} | {_pct(err.abs().mean())} | "
                     + " | ".join(_pct(s) for s in shares) + " |")
    return lines


def factor_lines(df: pd.DataFrame) -> list[str]:
    groups = (("compute", COMPUTE_KINDS), ("gemm", ("gemm",)), ("attention", ("attention",)),
              ("bandwidth", ("bandwidth",)), ("tp", ("tp",)), ("bubble", ("bubble",)), ("dp", ("dp",)))
    head = ["source"] + [f"{name} x (MAPE)" for name, _ in groups]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for source, g in df.groupby("source", sort=False):
        m, p = g.measured.to_numpy(), g.predicted.to_numpy()
        cells = []
        for _, kinds in groups:
            part = g[list(kinds)].sum(axis=1).to_numpy()
            f = closing_factor(m, p, part)
            mape = float(np.mean(np.abs(m / (p + (f - 1.0) * part) - 1.0))) if f == f else float("nan")
            cells.append(f"{_num(f)} ({_pct(mape)})" if f == f else "—")
        lines.append(f"| {source} | " + " | ".join(cells) + " |")
    return lines


def dropout_lines(df: pd.DataFrame) -> list[str]:
    """Rows on the Megatron-Core stacks with fused attention, those that train with dropout
    and those without: the error against the fused-attention share of the predicted time, and
    its rank correlation with that share and with the bandwidth-bound share."""
    mc = df[df["stack"].fillna("").str.startswith("megatron-core") & (df.attention > 0)]
    lines = ["| rows | count | mean signed | error at zero attention share | slope | Spearman, attention share | "
             "Spearman, bandwidth-bound share |", "|---|---:|---:|---:|---:|---:|---:|"]

    def rho(x: np.ndarray, y: np.ndarray) -> float:
        return spearmanr(x, y).correlation if np.ptp(x) > 0 and np.ptp(y) > 0 else float("nan")

    for label, g in (("dropout 0.1", mc[mc.dropout > 0]), ("no dropout", mc[mc.dropout == 0])):
        if len(g) < 5:
            continue
        share = (g.attention / g.predicted).to_numpy()
        err = (g.measured / g.predicted - 1).to_numpy()
        slope, intercept = np.polyfit(share, err, 1)
        bandwidth = (g.bandwidth / g.predicted).to_numpy()
        lines.append(f"| {label} | {len(g)} | {_pct(err.mean(), True)} | {_pct(intercept, True)} | {slope:+.2f} | "
                     f"{_num(rho(share, err), '+.2f')} | {_num(rho(bandwidth, err), '+.2f')} |")
    return lines


def bandwidth_trend_lines(df: pd.DataFrame, min_rows: int = 5) -> list[str]:
    lines = ["| source | rows | error at zero bandwidth-bound share | slope | Spearman |",
             "|---|---:|---:|---:|---:|"]
    for source, g in df.groupby("source", sort=False):
        share = (g.bandwidth / g.predicted).to_numpy()
        if len(g) < min_rows or np.ptp(share) < 0.02:
            continue
        err = (g.measured / g.predicted - 1).to_numpy()
        slope, intercept = np.polyfit(share, err, 1)
        rho = spearmanr(share, err).correlation
        lines.append(f"| {source} | {len(g)} | {_pct(intercept, True)} | {slope:+.2f} | {rho:+.2f} |")
    return lines


def hagemann_fit_lines(df: pd.DataFrame) -> list[str]:
    """Relative non-negative least squares: measured ~ sum_k c_k part_k, every run weighted by
    1 / measured; c_k = 1 everywhere would mean the model is right."""
    cols = ("compute", "tp", "bubble", "dp")
    lines = ["| set | runs | " + " | ".join(f"c {c}" for c in cols) + " | MAPE before | MAPE with c |",
             "|---|---:|" + "---:|" * (len(cols) + 2)]
    for source, g in df[df.source.str.startswith("Hagemann")].groupby("source", sort=False):
        parts = np.column_stack([g[list(COMPUTE_KINDS)].sum(axis=1)] + [g[c] for c in cols[1:]])
        A = parts / g.measured.to_numpy()[:, None]
        coef, _ = nnls(A, np.ones(len(g)))
        fitted = parts @ coef
        before = np.mean(np.abs(g.measured / g.predicted - 1))
        after = np.mean(np.abs(g.measured / fitted - 1))
        lines.append(f"| {source} | {len(g)} | " + " | ".join(f"{c:.2f}" for c in coef)
                     + f" | {before:.1%} | {after:.1%} |")
    return lines


def hagemann_dp_lines(df: pd.DataFrame) -> list[str]:
    lines = ["| set | Spearman of measured/predicted with the data-parallel degree | "
             "... with the 'dp' share of the predicted time |", "|---|---:|---:|"]
    for source, g in df[df.source.str.startswith("Hagemann")].groupby("source", sort=False):
        ratio = g.measured / g.predicted
        lines.append(f"| {source} | {spearmanr(ratio, g.dp_degree).correlation:+.2f} | "
                     f"{spearmanr(ratio, g.dp / g.predicted).correlation:+.2f} |")
    return lines


def per_micro_batch_cost(measured: np.ndarray, predicted: np.ndarray, micro_batches: np.ndarray,
                         pipelined: np.ndarray) -> tuple[float, float]:
    """(a, c) of the least-squares fit measured ~ a * predicted + c * micro_batches * pipelined:
    a scale on the whole prediction and a fixed cost per micro-batch that only pipelined
    runs pay (the gap ``c / a`` would add to their predicted times)."""
    A = np.column_stack([predicted, micro_batches * pipelined])
    (a, c), *_ = np.linalg.lstsq(A, measured, rcond=None)
    return float(a), float(c)


def hagemann_overhead_lines(df: pd.DataFrame) -> list[str]:
    """Would a fixed cost per micro-batch of pipelined runs (pp > 1) explain why those rank
    badly in some Hagemann tables? Fitted on the fitting tables, checked per table."""
    H = df[df.source.str.startswith("Hagemann")]
    fit = H[H.source.str.contains("fitting")]

    def pipelined(g: pd.DataFrame) -> np.ndarray:
        return (g.pp_degree > 1).to_numpy(dtype=float)
    a, c = per_micro_batch_cost(fit.measured.to_numpy(), fit.predicted.to_numpy(),
                                fit.micro_batches.to_numpy(dtype=float), pipelined(fit))
    gap = c / a
    lines = [f"Fitted on the fitting tables: a = {a:.3f}, c = {c * 1e3:.1f} ms per micro-batch, so {gap * 1e3:.1f} ms "
             "per micro-batch added to every pipelined run's predicted time. Spearman of measured and predicted "
             "step time per table, without and with it:", "",
             "| table | set | runs | pipelined | Spearman | with the per-micro-batch cost |", "|---|---|---:|---:|---:|---:|"]
    for (source, table), g in H.groupby(["source", "ref"], sort=False):
        adjusted = g.predicted + gap * g.micro_batches * pipelined(g)
        lines.append(f"| {table} | {'fitting' if 'fitting' in source else 'checking'} | {len(g)} | "
                     f"{int(pipelined(g).sum())} | {spearmanr(g.measured, g.predicted).correlation:.2f} | "
                     f"{spearmanr(g.measured, adjusted).correlation:.2f} |")
    return lines


def kernel_batch_gaps(runs: pd.DataFrame, min_runs: int = 3) -> pd.DataFrame:
    """Per Hagemann table and kernel (each kernel's runs are one batch of trials): the mean
    measured / predicted of the pipelined runs (pp > 1) and of the others, and their gap.
    Only tables where at least two kernels have ``min_runs`` of each."""
    out = []
    for (source, table, kernel), g in runs.groupby(["source", "ref", "kernel"], sort=False):
        ratio = g.measured / g.predicted
        piped = g.pp_degree > 1
        if piped.sum() < min_runs or (~piped).sum() < min_runs:
            continue
        out.append(dict(source=source, table=table, kernel=kernel, fa2=bool(g.fa2.iloc[0]),
                        trials=f"{g.trial.min()}-{g.trial.max()}", piped=float(ratio[piped].mean()),
                        n_piped=int(piped.sum()), flat=float(ratio[~piped].mean()), n_flat=int((~piped).sum())))
    df = pd.DataFrame(out)
    if df.empty:
        return df
    df["gap"] = df.piped - df.flat
    return df[df.groupby("table").kernel.transform("size") >= 2].reset_index(drop=True)


def kernel_batch_lines(runs: pd.DataFrame) -> list[str]:
    gaps = kernel_batch_gaps(runs)
    if gaps.empty:
        return ["(no table has two kernels with pipelined and other runs)"]
    lines = ["| table | set | kernel | trial ids | pipelined: measured/predicted (runs) | others (runs) | gap |",
             "|---|---|---|---|---:|---:|---:|"]
    for r in gaps.itertuples():
        lines.append(f"| {r.table} | {'fitting' if 'fitting' in r.source else 'checking'} | {r.kernel} | "
                     f"{r.trials} | {r.piped:.2f} ({r.n_piped}) | {r.flat:.2f} ({r.n_flat}) | {r.gap:+.2f} |")
    spread = gaps.groupby("table", sort=False).gap.agg(lambda g: g.max() - g.min())
    lines += ["", "Spread of the gap between the kernels' trial batches, per table (small: the batches agree, "
                  "and the gap belongs to the table's configurations; large: it belongs to a batch): "
              + ", ".join(f"{t} {v:.2f}" for t, v in spread.items()) + "."]
    return lines


def report(df: pd.DataFrame, hagemann_all: pd.DataFrame, gbps: float, elapsed: float) -> str:
    """The report: ``df`` the rows sections 1-5 read (FlashAttention-2 runs only from Hagemann),
    ``hagemann_all`` every Hagemann run that ran, whatever its kernel (section 6)."""
    skipped = "; ".join(f"{k}: {v}" for k, v in SKIPPED_SOURCES.items())
    return "\n".join([
        "# Where the iteration-time error lives", "",
        f"Generated by `python benchmarks/published/decompose.py` ({elapsed:.0f} s) from the rows and plans of "
        "`benchmarks/published/validate.py` (the same choices where a source leaves one open; Hagemann et al. "
        f"2023: the FlashAttention-2 runs that ran, on the {gbps:g} GB/s per GPU network the report chooses). "
        "Error = measured / predicted - 1 (positive: the prediction is too fast). Diagnostics only: nothing "
        f"here is fitted into the model. Left out: {skipped}.", "",
        "## 1. Shares of the predicted time", "",
        "Mean share of each part of the predicted iteration time on the critical rank. Compute is split by the "
        "roofline's proportions over the model's layers (one forward and backward, no recompute): `gemm` "
        "(linear layers and an explicit attention's batched products), `attention` (fused-attention FLOPs), "
        "`bandwidth` (bandwidth-bound kernels), `launch`; `tp` tensor-parallel communication; `bubble` pipeline "
        "waiting, stage imbalance included; `dp` the exposed data-parallel reduction, post-step parameter "
        "gather and optimizer step.", "",
        *shares_lines(df), "",
        "## 2. What one part alone would have to be scaled by", "",
        "Per source and part, the factor that removes the source's mean signed error when only that part is "
        "scaled (first order: the others and the overlaps held), and the MAPE left at that factor. A "
        "mechanism behind a bias shared by several sources should need about the same factor in each; a "
        "blank means no factor in 0.05-50 does it.", "",
        *factor_lines(df), "",
        "## 3. Error against the bandwidth-bound share, within a source", "",
        "Least-squares line of the error against the `bandwidth` share of the predicted time (sources with at "
        "least 5 rows whose share varies). A negative slope with a positive intercept means the "
        "bandwidth-bound kernels are predicted too slow and the rest too fast, and that the two offset in "
        "the source's mean.", "",
        *bandwidth_trend_lines(df), "",
        "## 3b. Dropout on Megatron-Core", "",
        "The rows on the Megatron-Core stacks (fitting rows included) whose attention is a fused kernel, split by "
        "whether the run trained with dropout (GPT-3-style models: attention and hidden dropout 0.1) or not "
        "(Llama): least-squares line of the error against the fused-attention share of the predicted time, and "
        "the error's rank correlation with that share and with the bandwidth-bound share. The model charges a "
        "fused attention kernel no time for its dropout (it regenerates the mask from the random state and "
        "keeps none); if that dropout cost the time missing from the dropout rows, their error would grow with "
        "the attention share.", "",
        *dropout_lines(df), "",
        "## 4. Hagemann et al. 2023: which part the residual follows", "",
        "Non-negative least squares of the measured step time on the predicted parts (compute, tp, bubble, "
        "dp), each run weighted by 1 / its measured time, fitting and checking tables apart. A coefficient "
        "that agrees between the two sets points at a part the model gets wrong for every table; one that "
        "differs is not a property of the stack.", "",
        *hagemann_fit_lines(df), "",
        *hagemann_dp_lines(df), "",
        "## 5. Hagemann et al. 2023: a fixed cost per micro-batch of pipelined runs?", "",
        "In the fitting tables the pipelined runs are predicted too fast by more than the others, and the excess "
        "grows with the number of micro-batches (as a cost the sweep's pipeline engine paid per micro-batch "
        "would). If that were a property of the stack, the same cost fitted on the fitting tables would improve "
        "the ranking of the checking tables too; where it worsens them, it is not modelled.", "",
        *hagemann_overhead_lines(df), "",
        "## 6. Hagemann et al. 2023: the same configurations under other kernels", "",
        "The sweep ran each table's configurations once per attention/norm kernel, each kernel in its own batch "
        "of trials (the trial ids). Every run that ran, with its own kernel: the mean measured / predicted of "
        "the pipelined runs and of the others, per table and kernel. A cost of the stack's pipeline engine "
        "would show as a positive gap under every kernel; one that shows in one batch of trials only is a "
        "property of that batch (its code version or its machines' state), which no model of the stack "
        "predicts.", "",
        *kernel_batch_lines(hagemann_all), "",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Cluster.homogeneous restates the assumed networks per row
        rows = public_rows()
        print(f"  published rows: {len(rows)} ({time.perf_counter() - start:.0f} s)", flush=True)
        hag, gbps = hagemann_rows()
        print(f"  Hagemann runs: {len(hag)} ({time.perf_counter() - start:.0f} s)", flush=True)
    hag_all = pd.DataFrame(hag)
    df = pd.concat([pd.DataFrame(rows), hag_all[hag_all.fa2]], ignore_index=True)
    text = report(df, hag_all, gbps, time.perf_counter() - start)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
