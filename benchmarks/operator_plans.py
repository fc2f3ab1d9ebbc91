"""Operator-level plans against layer-level plans and the Megatron-LM / DeepSpeed rules.

Three models, each with something an operator-level plan can do that a layer-level one
cannot:

* Swin-B (the zoo's hierarchical vision transformer): co-shard, each rank running its
  blocks as k recomputed chunks (SuperScaler's plan for Swin);
* a ViT-L/16 with a 1M-class head, given only as an ``nn.Module`` written in this file
  (the layer-level planner cannot shard it at all; the operator search can);
* a GPT with a 256k vocabulary (embedding and head of 1.6B parameters each): interlaced
  embedding/head, sharded over every rank of the pipeline (SuperScaler's plan for GPT-3
  with a large vocabulary).

For each: the rules (``autoplan.baselines``), the best layer-level plan (``autoplan.search``),
the searched operator-level plans (``autoplan.search(..., layouts=True)``) and their co-shard
and interlaced variants, all estimated by the same cost model; plus how long the layout
search takes for a 100-layer transformer. Writes ``benchmarks/results/operator_plans.md``
and ``operator_plans.png`` (time and memory per plan) and ``operator_layouts.png`` (the
chosen layouts of each model's main block).

    python benchmarks/operator_plans.py                   # about half a minute on 2 CPU cores
    python benchmarks/operator_plans.py --only gpt        # one scenario
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import autoplan  # noqa: E402
from autoplan.models.config import TransformerConfig  # noqa: E402
from autoplan.units import GiB  # noqa: E402

OUT = REPO_ROOT / "benchmarks" / "results"


# --------------------------------------------------------------- a user's ViT
class PatchStem(nn.Module):
    """Flattened 16x16x3 patches [b, 196, 768] -> tokens [b, 196, d]."""

    def __init__(self, patch: int, dim: int, tokens: int):
        super().__init__()
        self.proj = nn.Linear(patch, dim)
        self.pos = nn.Parameter(torch.zeros(tokens, dim))

    def forward(self, x):
        return self.proj(x) + self.pos


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm2 = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ClassHead(nn.Module):
    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        return self.fc(self.norm(x).mean(dim=1))


class ViT(nn.Module):
    def __init__(self, layers=24, dim=1024, heads=16, classes=1_000_000, tokens=196, patch=768):
        super().__init__()
        self.layers = nn.ModuleList([PatchStem(patch, dim, tokens), *(ViTBlock(dim, heads) for _ in range(layers)),
                                     ClassHead(dim, classes)])

    def forward(self, x):
        for unit in self.layers:
            x = unit(x)
        return x


def class_loss(logits, target):
    return F.cross_entropy(logits, target)


# ---------------------------------------------------------------------- scenarios
@dataclass
class Scenario:
    key: str
    title: str
    why: str
    cluster: autoplan.Cluster
    global_batch: int
    tp: tuple[int, ...]
    coshard: tuple[int, ...] = ()
    constraints: dict = field(default_factory=dict)
    unit_word: str = "samples"


def scenarios() -> list[Scenario]:
    return [
        Scenario("swin", "Swin-B (224 px) on 8 x V100-16GB, global batch 1024",
                 "co-shard: each rank runs its blocks as k chunks recomputed one after another",
                 autoplan.Cluster.homogeneous("V100-SXM2-16GB", nodes=1, gpus_per_node=8), 1024, (1, 2, 4), (2, 4),
                 dict(max_micro_batch=128)),
        Scenario("vit", "ViT-L/16 with a 1M-class head (an nn.Module, not in the zoo) on 8 x A100-40GB, global batch 1024",
                 "a model the layer-level planner cannot shard, with a 1.0B-parameter output layer",
                 autoplan.Cluster.homogeneous("A100-SXM4-40GB", nodes=1, gpus_per_node=8), 1024, (1, 2, 4, 8), (2,),
                 dict(max_micro_batch=64)),
        Scenario("gpt", "GPT 21B with a 256k vocabulary (40 x 6144) on 4 nodes x 8 A100-40GB, global batch 512",
                 "interlaced embedding and head: 1.6B parameters each, sharded over every rank of the pipeline",
                 autoplan.Cluster.homogeneous("A100-SXM4-40GB", nodes=4, gpus_per_node=8), 512, (1, 2, 4), (),
                 {}, "tokens"),
    ]


def model_of(key: str):
    """(what the operator search captures, the layer-level ModelSpec, capture keyword arguments)."""
    if key == "swin":
        return "swin-b", autoplan.models.get("swin-b"), {}
    if key == "gpt":
        cfg = TransformerConfig(name="gpt-21b-256k", arch="gpt", layers=40, hidden=6144, heads=48, seq_len=2048,
                                vocab=256000)
        return cfg, autoplan.models.get(cfg), {}
    with torch.device("meta"):
        vit = ViT()
    x = torch.zeros(1, 196, 768)
    y = torch.zeros(1, dtype=torch.long)
    spec = autoplan.models.from_module(vit, x, name="vit-l16-1m", loss=lambda o: class_loss(
        o, torch.zeros(o.shape[0], dtype=torch.long, device=o.device)))
    return vit, spec, dict(example_inputs=x, loss_target=y, loss=class_loss)


@dataclass
class Row:
    label: str
    kind: str
    """'rule', 'layer', 'operator', 'coshard', 'interlaced', 'reference'."""
    plan: autoplan.Plan
    est: object

    def cells(self, unit_word: str, tokens_per_sample: int, best: float) -> list[str]:
        e = self.est
        rate = e.samples_per_s * (tokens_per_sample if unit_word == "tokens" else 1)
        fits = "yes" if e.fits else "**no**"
        return [self.label, f"`{self.plan.describe()}`", f"{e.iteration_time_s:.3f}", f"{rate:,.0f}",
                f"{e.peak_memory_bytes / GiB:.1f}", fits, f"{best / e.iteration_time_s:.2f}x" if e.fits else "-"]


def run(s: Scenario, log) -> dict:
    from search.operators import search_operator_plans
    source, spec, capture = model_of(s.key)
    c, gb = s.cluster, s.global_batch
    rows: list[Row] = []
    for label, fn in (("Megatron-LM rule", lambda: autoplan.baselines.megatron(spec, c, gb)),
                      ("DeepSpeed ZeRO-3 rule", lambda: autoplan.baselines.deepspeed(spec, c, gb, "zero3")),
                      ("DeepSpeed 3D rule", lambda: autoplan.baselines.deepspeed(spec, c, gb, "3d"))):
        plan = fn()
        rows.append(Row(label, "rule", plan, autoplan.estimate(spec, c, plan)))
    t0 = time.perf_counter()
    layer = autoplan.search(spec, c, gb, progress=False, **s.constraints)
    layer_s = time.perf_counter() - t0
    best_layer = layer.best
    rows.append(Row("best layer-level plan (autoplan.search)", "layer", best_layer.plan, best_layer.estimate))
    log(f"  layer-level search {layer_s:.1f} s: {best_layer.plan.describe()}")
    t0 = time.perf_counter()
    ops = search_operator_plans(source, c, gb, tp=s.tp, coshard=s.coshard, interlace=True, **capture,
                                **s.constraints)
    op_s = time.perf_counter() - t0
    graph = ops.model_graph
    best_op = ops.best
    rows.append(Row("best operator-level plan (autoplan.search(layouts=True))", "operator", best_op.plan,
                    best_op.estimate))
    log(f"  operator-level search {op_s:.1f} s (layouts {ops.layout_s:.1f} s): {best_op.plan.describe()}")
    # The same layer-level plan on the operator view, when it is tensor-parallel-free (the
    # replicated layout is then the same plan): separates measurement from layout effects.
    # from_module adds the work before and after a module's ``layers`` as units of their
    # own, which the operator graph folds into its first and last unit: one stage spans
    # either way, so only a single-stage plan carries over unit for unit.
    units_differ = graph.num_units != len(spec.layers)
    if best_layer.plan.tp == 1 and (not units_differ or best_layer.plan.pp == 1):
        from autoplan.layouts import Layouts
        from search.layouts import unit_layout
        from autoplan.models.opview import unit_strategies
        from search.layouts import UnitSolution
        units = []
        for gi, g in enumerate(graph.graphs):
            st = unit_strategies(g, None)
            sol = UnitSolution(gi, "R", "R", st, 0.0, {}, 0.0, 0.0, [], True)
            units.append(unit_layout(g, sol, graph.unit_indices(gi)))
        stages = best_layer.plan.stages
        if units_differ:
            stages = (dataclasses.replace(stages[0], end=graph.num_units),)
        same = dataclasses.replace(best_layer.plan, stages=stages,
                                   layouts=Layouts(units=tuple(units), source="manual"))
        rows.append(Row("best layer-level plan on the operator graph", "reference", same,
                        autoplan.estimate(graph, c, same)))
    # Best tensor-parallel operator plan (its layouts are the interesting figure).
    tp_rows = [rp for rp in ops.ranked if rp.plan.tp > 1 and rp.plan.layouts is not None
               and not rp.plan.layouts.interlaced and max(u.coshard for u in rp.plan.layouts.units) == 1]
    if tp_rows and tp_rows[0] is not best_op:
        rows.append(Row("best tensor-parallel operator-level plan", "operator", tp_rows[0].plan, tp_rows[0].estimate))
    for label, rp in ops.variants:
        kind = "coshard" if label.startswith("co-shard") else "interlaced"
        rows.append(Row(label, kind, rp.plan, rp.estimate))
        if kind == "interlaced":
            # The same pipeline without interlacing, for comparison.
            base = [r for r in ops.ranked if r.plan.pp == rp.plan.pp and r.plan.tp == rp.plan.tp
                    and r.plan.dp == rp.plan.dp and r.plan.micro_batch == rp.plan.micro_batch
                    and r.plan.schedule == rp.plan.schedule and r.plan.zero == rp.plan.zero
                    and not r.plan.layouts.interlaced]
            if base and not any(x.plan == base[0].plan for x in rows):
                rows.append(Row(f"(same pipeline, not interlaced)", "reference", base[0].plan, base[0].estimate))
    tokens = spec.tokens_per_sample or spec.seq_len
    layout_plan = tp_rows[0].plan if tp_rows else best_op.plan
    ref = [r for r in rows if r.label == "best layer-level plan on the operator graph"]
    # Speed-ups are against the best layer-level plan measured the way the operator plans are
    # (when that plan can be expressed on the operator graph), so they show layouts, not measurement.
    baseline = ref[0].est.iteration_time_s if ref else best_layer.estimate.iteration_time_s
    return dict(scenario=s, rows=rows, layer_s=layer_s, op_s=op_s, layout_s=ops.layout_s, graph=graph,
                tokens=tokens, best_layer=baseline, layer_measured=best_layer.estimate.iteration_time_s,
                same_measurement=bool(ref), layout_plan=layout_plan, chains=ops.chains)


def deep_search_time() -> dict:
    """Layout search for a 100-layer transformer: capture + CP-SAT, against 2 layers."""
    from autoplan.models.graph import capture_model
    from search.layouts import LayoutSettings, solve_chain
    cluster = autoplan.Cluster.homogeneous("A100-SXM4-80GB", nodes=1, gpus_per_node=8)
    import autoplan.models.graph as graph_mod
    import autoplan.models.opmeasure as measure_mod
    import autoplan.models.strategies as strategy_mod
    out = {}
    for layers in (2, 100):
        # Cold start each time: no strategies or measurements reused from earlier runs.
        strategy_mod._ROWS_CACHE.clear()
        measure_mod._CACHE.clear()
        graph_mod._capture_config_cached.cache_clear()
        cfg = TransformerConfig(name=f"gpt-{layers}x8192", arch="gpt", layers=layers, hidden=8192, heads=64,
                                seq_len=2048, vocab=51200)
        t0 = time.perf_counter()
        graph = capture_model(cfg)
        cap = time.perf_counter() - t0
        sol = solve_chain(graph, cluster, [tuple(range(8))], LayoutSettings(degree=8))
        out[layers] = dict(capture_s=cap, solve_s=sol.solve_s, solves=sol.solves, units=graph.num_units,
                           distinct=len(graph.graphs))
    return out


# ------------------------------------------------------------------------ report
def _placement_color(p: str | None) -> str:
    if p is None:
        return "#ffffff"
    if p == "R":
        return "#d9d9d9"
    if p == "P":
        return "#f4a261"
    return {"S0": "#2a9d8f", "S1": "#457b9d", "S2": "#1d3557", "S3": "#8ecae6"}.get(p, "#264653")


def layout_figure(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    fig, axes = plt.subplots(len(results), 1, figsize=(14, 2.6 * len(results)))
    axes = axes if len(results) > 1 else [axes]
    for ax, res in zip(axes, results):
        plan, graph = res["layout_plan"], res["graph"]
        lay = plan.layouts
        # The unit shared by the most units (the repeated block).
        u = max(lay.units, key=lambda x: len(x.units))
        g = graph.graph_of(u.units[0])
        params = dict(u.params)
        ops = [o for o in u.ops if any(k in o.op for k in ("linear", "attention", "norm", "embedding", "conv",
                                                             "cross_entropy", "add.Tensor", "gelu", "mul"))]
        for i, o in enumerate(ops):
            node = g.node(o.node)
            ins = list(o.inputs)
            ax.add_patch(Rectangle((i, 1), 0.9, 0.9, color=_placement_color(o.outputs[0] if o.outputs else None)))
            for j, p in enumerate(ins[:3]):
                src = g.node(node.args[j][0]) if j < len(node.args) else None
                label = src.param.split(".")[-2] if src is not None and src.kind == "param" else ""
                ax.add_patch(Rectangle((i + j * 0.3, 0), 0.28, 0.9, color=_placement_color(p)))
                if label and p:
                    ax.text(i + j * 0.3 + 0.14, 0.45, p, ha="center", va="center", fontsize=5, color="white")
            ax.text(i + 0.45, 1.45, o.outputs[0] if o.outputs and o.outputs[0] else "", ha="center", va="center",
                    fontsize=6, color="white")
            name = o.op.replace("aten.", "").split(".")[0]
            owner = next((g.node(a).param.rsplit(".", 1)[0] for a, _ in node.args if g.node(a).kind == "param"), "")
            ax.text(i + 0.45, -0.15, f"{name}\n{owner}", ha="center", va="top", fontsize=5, rotation=90)
        ax.set_xlim(-0.2, max(len(ops), 1) + 0.2)
        ax.set_ylim(-2.2, 2.1)
        ax.axis("off")
        ax.set_title(f"{res['scenario'].key}: {plan.describe()} — block units {u.units[0]}..{u.units[-1]}, "
                     f"input {u.input}, output {u.output} (top: output placement; bottom: what each input is read as)",
                     fontsize=8)
    handles = [Patch(color=_placement_color(p), label=lbl) for p, lbl in
               (("R", "Replicate"), ("P", "Partial (sum)"), ("S0", "Shard(0)"), ("S1", "Shard(1)"), ("S2", "Shard(2)"),
                ("S3", "Shard(3)"))]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def time_figure(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"rule": "#8d99ae", "layer": "#2b2d42", "operator": "#2a9d8f", "coshard": "#e9c46a",
              "interlaced": "#e76f51", "reference": "#bcbcbc"}
    fig, axes = plt.subplots(2, len(results), figsize=(5.5 * len(results), 7), squeeze=False)
    for k, res in enumerate(results):
        rows = res["rows"]
        names = [r.label.replace(" (autoplan.search(layouts=True))", "").replace(" (autoplan.search)", "")
                 for r in rows]
        t = [r.est.iteration_time_s for r in rows]
        m = [r.est.peak_memory_bytes / GiB for r in rows]
        col = [colors[r.kind] for r in rows]
        ax = axes[0][k]
        ax.barh(range(len(rows)), t, color=col)
        ax.set_yticks(range(len(rows)), names, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("iteration time (s)", fontsize=8)
        ax.set_title(res["scenario"].key, fontsize=9)
        ax = axes[1][k]
        ax.barh(range(len(rows)), m, color=col)
        cap = res["scenario"].cluster.groups[0].device.memory_bytes / GiB
        ax.axvline(cap, color="red", lw=1)
        ax.set_yticks(range(len(rows)), names, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("peak memory per GPU (GiB); red: device memory", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(results: list[dict], deep: dict | None, out: Path, command: str) -> None:
    lines = ["# Operator-level plans (SuperScaler's transformations) against layer-level plans and rules", "",
             f"Regenerate with `{command}` (CPU only; every figure is the cost model's estimate, "
             "the same model for every row).", "",
             "Rows: the Megatron-LM and DeepSpeed rules (`autoplan.baselines`), the best layer-level plan "
             "(`autoplan.search`), the best operator-level plan (`autoplan.search(..., layouts=True)`: "
             "CP-SAT chooses every operator's layout from DTensor's strategies, the layer-level search "
             "runs on top), and the co-shard and interlaced variants the operator search tried on its best "
             "plans, each estimated (fitting or not); '(same pipeline, not interlaced)' rows are the plan an "
             "interlaced variant was made from.", "",
             "The best layer-level plan is also estimated on the operator graph with every operator "
             "replicated (it has no tensor parallelism in all three scenarios): the same plan, so the gap "
             "between those two rows is measurement, not layout. The layer-level measurement charges a "
             "synthetic loss's traffic to each unit and, for a module outside the zoo (the ViT), measures "
             "attention as the unfused math path; the operator graph measures each operator alone, as the "
             "fused kernel a GPU runs, and adds gradient sums. 'speed-up' is therefore against that row "
             "(same measurement), so it shows what the layouts and transformations change.", ""]
    for res in results:
        s = res["scenario"]
        lines += [f"## {s.title}", "", f"What operator-level plans can add here: {s.why}.", "",
                  f"Layer-level search {res['layer_s']:.1f} s; operator-level search {res['op_s']:.1f} s "
                  f"(of which capture, measurement and CP-SAT layouts {res['layout_s']:.1f} s).", "",
                  "| plan | description | iteration s | " + s.unit_word + "/s | peak GiB/GPU | fits | speed-up vs best layer-level (same measurement) |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append("| " + " | ".join(r.cells(s.unit_word, res["tokens"], res["best_layer"])) + " |")
        lines += ["", _verdict(res), ""]
        lp = res["layout_plan"]
        lines += [f"Layouts shown in the figure ({lp.describe()}): {lp.layouts.describe()}", ""]
    if deep:
        lines += ["## Layout search time against depth", "",
                  "GPT (hidden 8192, 64 heads, sequence 2048), tensor-parallel degree 8 on one DGX A100 node: "
                  "identical blocks share one CP-SAT model per boundary pair, so depth costs nothing.", "",
                  "| layers | units | distinct units | capture s | layouts (strategies, measurement, CP-SAT) s | CP-SAT solves |",
                  "|---|---|---|---|---|---|"]
        for layers, d in deep.items():
            lines.append(f"| {layers} | {d['units']} | {d['distinct']} | {d['capture_s']:.1f} | {d['solve_s']:.1f} | {d['solves']} |")
        lines += ["", "Times on this machine (2 shared CPU cores), each from cold caches (capture after "
                  "torch's first-use warm-up); most of the layout time is DTensor's decomposition propagation "
                  "and the meta-device measurement, done once per distinct operator shape.", ""]
    lines += ["![time and memory](operator_plans.png)", "", "![layouts](operator_layouts.png)", ""]
    (out / "operator_plans.md").write_text("\n".join(lines))


def _verdict(res: dict) -> str:
    rows = res["rows"]
    best = res["best_layer"]
    parts = []
    op = [r for r in rows if r.kind == "operator"][0]
    gain = best / op.est.iteration_time_s
    if res["same_measurement"]:
        parts.append(f"The best operator-level plan runs at {gain:.2f}x the speed of the best layer-level plan "
                     f"measured the same way ({res['layer_measured'] / op.est.iteration_time_s:.2f}x against "
                     "the layer-level measurement).")
    else:
        parts.append(f"The best operator-level plan runs at {gain:.2f}x the best layer-level plan's speed (that "
                     "plan is tensor-parallel, so it has no replicated twin on the operator graph: the two "
                     "are measured differently, see above).")
    for kind, name in (("coshard", "Co-shard"), ("interlaced", "Interlacing")):
        vs = [r for r in rows if r.kind == kind]
        if not vs:
            continue
        fit = [r for r in vs if r.est.fits]
        if not fit:
            parts.append(f"{name} variants did not fit.")
            continue
        b = min(fit, key=lambda r: r.est.iteration_time_s)
        wins = b.est.iteration_time_s < op.est.iteration_time_s
        parts.append(f"{name}: best variant {b.est.iteration_time_s:.3f} s at {b.est.peak_memory_bytes / GiB:.1f} "
                     f"GiB/GPU — {'it wins' if wins else 'it does not win here'} "
                     f"(best operator-level plan {op.est.iteration_time_s:.3f} s, "
                     f"{op.est.peak_memory_bytes / GiB:.1f} GiB/GPU).")
    return " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("swin", "vit", "gpt"), action="append", help="run only these scenarios")
    ap.add_argument("--no-depth", action="store_true", help="skip the 100-layer search-time measurement")
    ap.add_argument("--out", default=str(OUT), help="directory for the report and figures")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = []
    for s in scenarios():
        if args.only and s.key not in args.only:
            continue
        print(f"{s.title}", flush=True)
        results.append(run(s, lambda m: print(m, flush=True)))
    deep = None if args.no_depth else deep_search_time()
    if deep:
        for k, v in deep.items():
            print(f"  {k} layers: capture {v['capture_s']:.1f} s, layouts {v['solve_s']:.1f} s, {v['solves']} solves")
    command = "python benchmarks/operator_plans.py" + "".join(f" --only {o}" for o in (args.only or []))
    write_report(results, deep, out, command)
    time_figure(results, out / "operator_plans.png")
    layout_figure(results, out / "operator_layouts.png")
    print(f"wrote {out / 'operator_plans.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
