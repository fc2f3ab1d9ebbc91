"""Search time against cluster size.

Sweeps clusters from 8 to 4096 GPUs for GPT-3 175B (Brown et al. 2020; global batch
1536, as in Narayanan et al. SC21, Table 1) on two families of clusters:

* homogeneous: DGX-class nodes of 8 A100-80GB, 25 GB/s per GPU between nodes;
* mixed: three device types in the proportions of ``examples/clusters/mixed-three-types.json``
  (half H100 in 8-GPU nodes, a quarter A100-40GB in 8-GPU nodes, a quarter L4 in 4-GPU
  nodes, each group with the links that file gives it), scaled by node count; below 32
  GPUs the three groups are single smaller nodes.

Prints one line per search and writes ``search_time.md`` (table) and ``search_time.png``
(log-log plot) to ``--out`` (default ``benchmarks/results``). The model is built once
(measured on the meta device); its time is reported separately from the searches.

    python benchmarks/search_time.py                 # full sweep (a few minutes)
    python benchmarks/search_time.py --sizes 8,64,512 --series homogeneous
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoplan import Cluster, models  # noqa: E402
from autoplan.errors import NoPlanFitsError  # noqa: E402
from search import search  # noqa: E402

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MIXED_FILE = ROOT / "examples" / "clusters" / "mixed-three-types.json"


def homogeneous(gpus: int) -> Cluster:
    return Cluster.homogeneous("A100-80GB", gpus // 8, 8, inter_node_GBps=25, name=f"a100-{gpus}")


def mixed(gpus: int) -> Cluster:
    """The mixed-three-types cluster scaled to ``gpus`` GPUs (half H100, a quarter each of
    A100-40GB and L4)."""
    base = json.loads(MIXED_FILE.read_text())
    data = copy.deepcopy(base)
    data["name"] = f"mixed-{gpus}"
    data.pop("description", None)
    h100, a100, l4 = data["node_groups"]
    if gpus >= 32:
        h100["nodes"], a100["nodes"], l4["nodes"] = gpus // 16, gpus // 32, gpus // 16
    else:
        h100.update(nodes=1, gpus_per_node=gpus // 2)
        a100.update(nodes=1, gpus_per_node=gpus // 4)
        l4.update(nodes=1, gpus_per_node=gpus // 4)
    cluster = Cluster.from_dict(data, where=f"mixed-{gpus}")
    assert cluster.num_gpus == gpus, (gpus, cluster.num_gpus)
    return cluster


def run(series: str, sizes: list[int], model, global_batch: int) -> list[dict]:
    rows = []
    for n in sizes:
        cluster = homogeneous(n) if series == "homogeneous" else mixed(n)
        t0 = time.perf_counter()
        try:
            result = search(model, cluster, global_batch, progress=False)
            wall = time.perf_counter() - t0
            best, stats = result.best, result.stats
            row = dict(series=series, gpus=n, search_s=wall, fits=True, plan=best.plan.describe(),
                       gpus_used=best.gpus_used, iteration_s=best.estimate.iteration_time_s,
                       tokens_per_s=best.estimate.tokens_per_s, mfu=best.estimate.mfu,
                       candidates=stats.candidates, skeletons=stats.skeletons, splits=stats.splits,
                       estimates=stats.estimates, solves=stats.placement.solves if stats.placement else 0,
                       phases=dict(stats.phase_s))
        except NoPlanFitsError:
            wall = time.perf_counter() - t0
            row = dict(series=series, gpus=n, search_s=wall, fits=False, plan="no plan fits", gpus_used=0,
                       iteration_s=float("nan"), tokens_per_s=float("nan"), mfu=float("nan"), candidates=0,
                       skeletons=0, splits=0, estimates=0, solves=0, phases={})
        rows.append(row)
        print(f"{series:12s} {n:5d} GPUs  search {row['search_s']:7.2f} s  "
              + (f"{row['plan']}  {row['iteration_s']:.3f} s/iter" if row["fits"] else "no plan fits"), flush=True)
    return rows


def write_markdown(rows: list[dict], path: Path, model_s: float, model_name: str, global_batch: int) -> None:
    lines = [f"# Search time vs cluster size ({model_name}, global batch {global_batch})", "",
             f"Model built once in {model_s:.1f} s (not included below). One process, one core busy; "
             "times are wall-clock on the machine that ran `benchmarks/search_time.py`.", "",
             "Phases: CP-SAT placement of device groups (mixed clusters only), bounds, layer-split DP "
             "(with its exact refinement), full cost-model estimates of the shortlist.", "",
             "| cluster | GPUs | search s | placement / bounds / split / estimate s | candidates | pipelines "
             "| DP splits | CP-SAT solves | estimates | best plan | GPUs used | iteration s | tokens/s | MFU |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["fits"]:
            ph = r["phases"]
            phases = " / ".join(f"{ph.get(k, 0.0):.1f}" for k in ("placement", "bounds", "split", "estimate"))
            lines.append(f"| {r['series']} | {r['gpus']} | {r['search_s']:.2f} | {phases} | {r['candidates']:,} | "
                         f"{r['skeletons']:,} | {r['splits']:,} | {r['solves']} | {r['estimates']} | "
                         f"`{r['plan']}` | {r['gpus_used']} | {r['iteration_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} |")
        else:
            lines.append(f"| {r['series']} | {r['gpus']} | {r['search_s']:.2f} | | | | | | | no plan fits "
                         "(the message says how much memory is missing) | | | | |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict], path: Path, model_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for series, marker in (("homogeneous", "o"), ("mixed", "s")):
        pts = [r for r in rows if r["series"] == series]
        if not pts:
            continue
        ax.plot([r["gpus"] for r in pts], [r["search_s"] for r in pts], marker=marker, label=series)
        for r in pts:
            if not r["fits"]:
                ax.scatter([r["gpus"]], [r["search_s"]], facecolors="none", edgecolors="red", s=90, zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs in the cluster")
    ax.set_ylabel("search time (s)")
    ax.set_title(f"autoplan search time, {model_name} (red ring: no plan fits)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated GPU counts")
    p.add_argument("--series", default="homogeneous,mixed", help="homogeneous, mixed, or both")
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--global-batch", type=int, default=1536)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    t0 = time.perf_counter()
    model = models.get(args.model)
    model_s = time.perf_counter() - t0
    print(f"{model.describe()} (built in {model_s:.1f} s)")
    rows = []
    for series in args.series.split(","):
        rows += run(series.strip(), sizes, model, args.global_batch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_markdown(rows, out / "search_time.md", model_s, model.name, args.global_batch)
    write_plot(rows, out / "search_time.png", model.name)
    print(f"wrote {out / 'search_time.md'} and {out / 'search_time.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
