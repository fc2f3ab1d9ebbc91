"""Long-context training: the searched plan with context parallelism against the best plan
without it.

Searches Llama 3 8B (Grattafiori et al. 2024) at a long sequence on the 8-node DGX H100
example cluster, once free and once with cp = 1, for each training stack asked for
(default: autoplan's own runtime, which gathers the full-vocabulary logits for the loss,
and Megatron-Core, whose loss runs on vocabulary shards), and compares the best plans
(iteration time, throughput, MFU, per-GPU memory, where the time goes). Also reports the
best plan found for each context-parallel exchange. All figures are the cost model's
predictions (catalog roofline; no GPU is used).

Prints the comparison and writes ``context_parallel.md`` (and ``.json``) to ``--out``
(default ``benchmarks/results``).

    python benchmarks/context_parallel.py                         # 131,072 tokens, global batch 8
    python benchmarks/context_parallel.py --seq-len 65536 --global-batch 16 --stacks megatron-core
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoplan import Cluster, models  # noqa: E402
from autoplan.stacks import get_stack  # noqa: E402
from autoplan.errors import NoPlanFitsError  # noqa: E402
from autoplan.plan import CP_COMMS  # noqa: E402
from autoplan.units import GiB  # noqa: E402
from search import search  # noqa: E402

CLUSTER = ROOT / "examples" / "clusters" / "dgx-h100-8nodes.json"


def _row(label: str, rp, seconds: float) -> dict:
    e = rp.estimate
    return {"search": label, "plan": rp.plan.describe(), "cp": rp.plan.cp, "cp_comm": rp.plan.cp_comm,
            "iteration_time_s": e.iteration_time_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
            "peak_memory_GiB": e.peak_memory_bytes / GiB, "fits": e.fits,
            "breakdown_s": dict(e.breakdown), "search_s": seconds}


def run(model_name: str, seq_len: int, global_batch: int, stack: str) -> tuple[dict, list[dict]]:
    cluster = Cluster.load(CLUSTER)
    t0 = time.perf_counter()
    model = models.for_stack(model_name, stack, seq_len=seq_len)
    s = get_stack(stack)
    meta = {"model": model.describe(), "cluster": f"{cluster.name} ({cluster.num_gpus} GPUs)",
            "global_batch": global_batch, "stack": f"{s.name} ({s.version})",
            "model_build_s": time.perf_counter() - t0}
    print(f"stack {s.name}:")
    rows = []
    searches = [("free", {}), ("cp = 1", {"cp": 1})] + [(f"cp_comm = {c}", {"cp_comm": c}) for c in CP_COMMS]
    for label, kw in searches:
        t = time.perf_counter()
        try:
            result = search(model, cluster, global_batch, progress=False, stack=stack, **kw)
        except NoPlanFitsError as e:
            print(f"{label:>22}: nothing fits ({e})")
            rows.append({"search": label, "plan": None, "fits": False, "note": str(e)})
            continue
        row = _row(label, result.best, time.perf_counter() - t)
        rows.append(row)
        print(f"{label:>22}: {row['plan']}\n{'':>24}{row['iteration_time_s']:.3f} s, "
              f"{row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%}, {row['peak_memory_GiB']:.1f} GiB/GPU "
              f"(search {row['search_s']:.1f} s)")
    return meta, rows


def report(meta: dict, rows: list[dict]) -> str:
    free, base = rows[0], rows[1]
    lines = [f"## Stack {meta['stack']}", "",
             "| search | best plan | iteration s | tokens/s | MFU | peak GiB/GPU |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("plan") is None:
            lines.append(f"| {r['search']} | nothing fits: {_leanest(r['note'])} | | | | |")
            continue
        lines.append(f"| {r['search']} | `{r['plan']}` | {r['iteration_time_s']:.3f} | {r['tokens_per_s']:,.0f} "
                     f"| {r['mfu']:.1%} | {r['peak_memory_GiB']:.1f} |")
    if free.get("plan") and base.get("plan"):
        speedup = base["iteration_time_s"] / free["iteration_time_s"]
        lines += ["", f"The searched plan (cp = {free['cp']}) is {speedup:.2f}x as fast as the best plan "
                  f"without context parallelism.", "", "Where the time goes (seconds on the critical rank):", "",
                  "| term | " + " | ".join(r["search"] for r in (free, base)) + " |", "|---|---|---|"]
        for k in sorted(set(free["breakdown_s"]) | set(base["breakdown_s"])):
            lines.append(f"| {k} | " + " | ".join(f"{r['breakdown_s'].get(k, 0.0):.3f}" for r in (free, base)) + " |")
    elif free.get("plan"):
        lines += ["", f"Only context parallelism fits: the searched plan (cp = {free['cp']}) needs "
                  f"{free['peak_memory_GiB']:.1f} GiB per GPU."]
    return "\n".join(lines) + "\n"


def _leanest(note: str) -> str:
    """The 'leanest plan ... needs X' sentence of a no-fit message."""
    for sentence in note.split(". "):
        if sentence.startswith("The leanest plan"):
            return sentence
    return note


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--stacks", default="autoplan,megatron-core", help="training stacks, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    results = [run(args.model, args.seq_len, args.global_batch, stack) for stack in stacks]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/context_parallel.py" + (
        "" if (args.model, args.seq_len, args.global_batch, stacks) == ("llama3-8b", 131072, 8,
                                                                       ["autoplan", "megatron-core"])
        else f" --model {args.model} --seq-len {args.seq_len} --global-batch {args.global_batch} "
             f"--stacks {','.join(stacks)}")
    meta = results[0][0]
    text = ["# Context parallelism at long sequences (cost-model predictions)", "",
            f"{meta['model']}; {meta['cluster']}; global batch {meta['global_batch']}.", "",
            f"Command: `{command}`", ""]
    text += [report(m, rows) for m, rows in results]
    (out / "context_parallel.md").write_text("\n".join(text))
    (out / "context_parallel.json").write_text(json.dumps([{"meta": m, "rows": rows} for m, rows in results],
                                                          indent=2) + "\n")
    print(f"wrote {out / 'context_parallel.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
