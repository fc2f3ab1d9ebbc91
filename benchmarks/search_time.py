"""Search time against cluster size, side by side with an earlier release's search.

Sweeps clusters from 8 to 16,384 GPUs for GPT-3 175B (Brown et al. 2020; global batch
1536, as in Narayanan et al. SC21, Table 1) on two families of clusters:

* homogeneous: DGX-class nodes of 8 A100-80GB, 25 GB/s per GPU between nodes;
* mixed: three device types in the proportions of ``examples/clusters/mixed-three-types.json``
  (half H100 in 8-GPU nodes, a quarter A100-40GB in 8-GPU nodes, a quarter L4 in 4-GPU
  nodes, each group with the links that file gives it), scaled by node count; below 32
  GPUs the three groups are single smaller nodes.

Every search runs in its own process, once with this checkout's search and once with the
baseline's (``--baseline``, a git revision checked out into a temporary worktree), one
after the other so they never compete for the processor. Each process builds the model
first (not timed) and then times the search alone: CPU seconds (``time.process_time``,
all threads of the process) and wall seconds. Prints one line per search and writes
``search_time.md`` (table with both versions and their ratio) and ``search_time.png``
(log-log plot of CPU time) to ``--out`` (default ``benchmarks/results``); the raw rows go
to ``search_time.jsonl`` as they come, so ``--report-only`` can redraw an interrupted run.
The baseline is a fixed revision, so its rows are kept in ``search_time_baseline.jsonl``
and reused by later runs with the same model, batch and revision (``--rerun-baseline``
times it again; ``--baseline-only`` fills the file without timing this version).

    python benchmarks/search_time.py                       # full sweep, both versions
    python benchmarks/search_time.py --sizes 8,64,1024 --series homogeneous --no-baseline
    python benchmarks/search_time.py --baseline-only --timeout 900   # the baseline's rows alone
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MIXED_FILE = ROOT / "examples" / "clusters" / "mixed-three-types.json"
BASELINE = "83d87da"
"""The release before the search was reworked for speed and its optimality guarantee."""

# Runs in a fresh interpreter whose import path starts at the version's checkout.
RUNNER = r"""
import json, sys, time
root, cluster_file, model_name, global_batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, root)
from autoplan import Cluster, models
from autoplan.errors import NoPlanFitsError
from search import search
model = models.get(model_name)
cluster = Cluster.load(cluster_file)
cpu0, wall0 = time.process_time(), time.perf_counter()
row = {}
try:
    result = search(model, cluster, global_batch, progress=False)
    best, stats = result.best, result.stats
    row = dict(fits=True, plan=best.plan.describe(), gpus_used=best.gpus_used,
               iteration_s=best.estimate.iteration_time_s, tokens_per_s=best.estimate.tokens_per_s,
               mfu=best.estimate.mfu, candidates=stats.candidates, skeletons=stats.skeletons,
               splits=stats.splits, estimates=stats.estimates, phases=dict(stats.phase_s))
except NoPlanFitsError:
    row = dict(fits=False, plan="no plan fits")
row.update(cpu_s=time.process_time() - cpu0, wall_s=time.perf_counter() - wall0)
print("ROW " + json.dumps(row))
"""


def homogeneous(gpus: int) -> dict:
    from autoplan import Cluster
    return Cluster.homogeneous("A100-80GB", gpus // 8, 8, inter_node_GBps=25, name=f"a100-{gpus}").to_dict()


def mixed(gpus: int) -> dict:
    """The mixed-three-types cluster scaled to ``gpus`` GPUs (half H100, a quarter each of
    A100-40GB and L4)."""
    data = copy.deepcopy(json.loads(MIXED_FILE.read_text()))
    data["name"] = f"mixed-{gpus}"
    data.pop("description", None)
    h100, a100, l4 = data["node_groups"]
    if gpus >= 32:
        h100["nodes"], a100["nodes"], l4["nodes"] = gpus // 16, gpus // 32, gpus // 16
    else:
        h100.update(nodes=1, gpus_per_node=gpus // 2)
        a100.update(nodes=1, gpus_per_node=gpus // 4)
        l4.update(nodes=1, gpus_per_node=gpus // 4)
    return data


def time_search(root: Path, cluster: dict, model: str, global_batch: int, timeout_s: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cluster, f)
        path = f.name
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(root), path, model, str(global_batch)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=str(root), env=env)
    except subprocess.TimeoutExpired:
        return dict(fits=False, plan=f"stopped after {timeout_s:.0f} s", cpu_s=float("nan"), wall_s=float("nan"),
                    timed_out=True)
    finally:
        os.unlink(path)
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    raise RuntimeError(f"search in {root} failed:\n{proc.stderr[-2000:]}")


def checkout(revision: str) -> Path:
    """A temporary worktree of ``revision`` (removed by remove_checkout)."""
    where = Path(tempfile.mkdtemp(prefix="autoplan-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(where), revision],
                   check=True, capture_output=True)
    return where


def remove_checkout(where: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], capture_output=True)


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:,.{digits}f}"


def write_markdown(rows: list[dict], path: Path, model: str, global_batch: int, baseline: str) -> None:
    lines = [f"# Search time vs cluster size ({model}, global batch {global_batch})", "",
             f"Each search ran in its own process; the baseline's ({baseline}) rows were timed the same way on "
             "the same machine and are kept in `search_time_baseline.jsonl` (the baseline does not change), "
             "so only this version is timed on a new run. The model is built before the clock starts. CPU seconds are "
             "`time.process_time()` of the process around the search (all its threads), wall seconds "
             "`time.perf_counter()`; the machine was shared with other work, which inflates both (the "
             "ratio compares like with like). Each version's search ranks by its own cost model, so "
             "iteration times differ where the cost model changed since the baseline. Rows missing "
             "from a size sweep were not reached before the run was stopped. Produced by "
             "`python benchmarks/search_time.py`.", "",
             f"| cluster | GPUs | CPU s {baseline} | CPU s now | CPU ratio | wall s {baseline} | wall s now "
             f"| best plan now | iteration s {baseline} | iteration s now | candidates now | DP splits now |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        new, old = r["now"], r.get("baseline") or {}
        ratio = old.get("cpu_s", float("nan")) / new["cpu_s"] if new.get("cpu_s") else float("nan")
        plan = f"`{new['plan']}`" if new.get("fits") else new["plan"]
        lines.append(f"| {r['series']} | {r['gpus']:,} | {_fmt(old.get('cpu_s', float('nan')))} | {_fmt(new['cpu_s'])} "
                     f"| {_fmt(ratio, 1)}x | {_fmt(old.get('wall_s', float('nan')))} | {_fmt(new['wall_s'])} | {plan} "
                     f"| {_fmt(old.get('iteration_s', float('nan')), 3)} | {_fmt(new.get('iteration_s', float('nan')), 3)} "
                     f"| {new.get('candidates', 0):,} | {new.get('splits', 0):,} |")
    lines += phase_table(rows)
    path.write_text("\n".join(lines) + "\n")


PHASES = ("placement", "bounds", "split", "estimate")
"""The search's phases (``SearchStats.phase_s``), in the order they run."""


def phase_table(rows: list[dict]) -> list[str]:
    """Markdown lines: this version's wall seconds per search phase, for the rows that
    found a plan (what a speed-up has to attack)."""
    timed = [r for r in rows if (r["now"].get("phases") or {})]
    if not timed:
        return []
    lines = ["", "Where this version's time goes (wall seconds per phase of the search, "
             "`SearchStats.phase_s`; *other* is what no phase covers, the search's setup):", "",
             "| cluster | GPUs | " + " | ".join(PHASES) + " | other |",
             "|---|---:|" + "---:|" * (len(PHASES) + 1)]
    for r in timed:
        ph = r["now"]["phases"]
        other = r["now"]["wall_s"] - sum(ph.get(k, 0.0) for k in PHASES)
        cells = [_fmt(ph.get(k, float("nan"))) for k in PHASES] + [_fmt(max(other, 0.0))]
        lines.append(f"| {r['series']} | {r['gpus']:,} | " + " | ".join(cells) + " |")
    return lines


def write_plot(rows: list[dict], path: Path, model: str, baseline: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for series, color in (("homogeneous", "tab:blue"), ("mixed", "tab:orange")):
        pts = [r for r in rows if r["series"] == series]
        if not pts:
            continue
        for key, style, label in (("now", "-o", "now"), ("baseline", "--s", baseline)):
            xs = [r["gpus"] for r in pts if r.get(key) and r[key].get("cpu_s") == r[key].get("cpu_s")]
            ys = [r[key]["cpu_s"] for r in pts if r.get(key) and r[key].get("cpu_s") == r[key].get("cpu_s")]
            if xs:
                ax.plot(xs, ys, style, color=color, label=f"{series}, {label}", alpha=1.0 if key == "now" else 0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs in the cluster")
    ax.set_ylabel("search CPU time (s)")
    ax.set_title(f"autoplan search time, {model}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _baseline_key(series: str, gpus: int, model: str, global_batch: int, revision: str) -> tuple:
    return (series, gpus, model, global_batch, revision)


def _read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (none where it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_baseline_rows(path: Path) -> dict[tuple, dict]:
    """The baseline's recorded rows by (series, GPUs, model, global batch, revision)."""
    return {_baseline_key(r["series"], r["gpus"], r["model"], r["global_batch"], r["revision"]): r["row"]
            for r in _read_jsonl(path)}


def _previous_iterations(raw: Path) -> dict[tuple, float]:
    """Best predicted iteration seconds per (series, GPUs) in an earlier run's raw rows."""
    return {(r["series"], r["gpus"]): r["now"]["iteration_s"] for r in _read_jsonl(raw)
            if (r.get("now") or {}).get("iteration_s") is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated GPU counts")
    p.add_argument("--series", default="homogeneous,mixed", help="homogeneous, mixed, or both")
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--global-batch", type=int, default=1536)
    p.add_argument("--baseline", default=BASELINE, help=f"git revision to compare with (default {BASELINE})")
    p.add_argument("--no-baseline", action="store_true", help="time this version only")
    p.add_argument("--baseline-only", action="store_true",
                   help="time the baseline alone (into search_time_baseline.jsonl), not this version")
    p.add_argument("--rerun-baseline", action="store_true",
                   help="time the baseline again even where search_time_baseline.jsonl has its row")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one search may take before it is stopped")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--report-only", action="store_true", help="redraw the report from search_time.jsonl")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "search_time.jsonl"
    kept = out / "search_time_baseline.jsonl"
    if not args.report_only:
        sys.path.insert(0, str(ROOT))
        sizes = [int(x) for x in args.sizes.split(",") if x]
        recorded = {} if args.rerun_baseline else load_baseline_rows(kept)
        base = None
        if not args.no_baseline:
            base = checkout(args.baseline)
        # The previous run's best plans: a search change that loses a plan shows as a row
        # whose best predicted iteration is slower than before (a cost-model change can
        # also move them, so this warns rather than fails).
        previous = _previous_iterations(raw)
        slower = []
        if not args.baseline_only:
            raw.write_text("")
        try:
            # Size by size (both series at each), in the order given: an interrupted run
            # still has the sizes asked for first.
            for n in sizes:
                for series in [s.strip() for s in args.series.split(",") if s.strip()]:
                    cluster = homogeneous(n) if series == "homogeneous" else mixed(n)
                    row = dict(series=series, gpus=n)
                    if not args.baseline_only:
                        row["now"] = time_search(ROOT, cluster, args.model, args.global_batch, args.timeout)
                    if base is not None:
                        key = _baseline_key(series, n, args.model, args.global_batch, args.baseline)
                        if key not in recorded:
                            recorded[key] = time_search(base, cluster, args.model, args.global_batch,
                                                        args.timeout)
                            with kept.open("a") as f:
                                f.write(json.dumps(dict(series=series, gpus=n, model=args.model,
                                                        global_batch=args.global_batch,
                                                        revision=args.baseline, row=recorded[key])) + "\n")
                        row["baseline"] = recorded[key]
                    old = row.get("baseline", {})
                    new = row.get("now", {})
                    if not args.baseline_only:
                        with raw.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                    was = previous.get((series, n))
                    if was is not None and new.get("iteration_s", 0.0) > was * (1 + 1e-9):
                        slower.append(f"{series} {n} GPUs: {new['iteration_s']:.4g} s, was {was:.4g} s")
                    print(f"{series:12s} {n:6d} GPUs  CPU {new.get('cpu_s', float('nan')):8.2f} s (baseline "
                          f"{old.get('cpu_s', float('nan')):8.2f} s)  wall {new.get('wall_s', float('nan')):8.2f} s "
                          f"(baseline {old.get('wall_s', float('nan')):8.2f} s)  "
                          f"{(new or old).get('plan', '')[:70]}", flush=True)
        finally:
            if base is not None:
                remove_checkout(base)
        if args.baseline_only:
            print(f"wrote {kept}")
            return 0
        for line in slower:
            print(f"WARNING: best plan slower than in the previous run: {line}")
    rows = sorted(_read_jsonl(raw), key=lambda r: (r["series"], r["gpus"]))
    write_markdown(rows, out / "search_time.md", args.model, args.global_batch, args.baseline)
    write_plot(rows, out / "search_time.png", args.model, args.baseline)
    print(f"wrote {out / 'search_time.md'} and {out / 'search_time.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
