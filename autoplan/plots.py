"""Figures of an estimate: the simulated pipeline timeline and the per-device memory.

    from autoplan.plots import plot_timeline, plot_memory
    est = autoplan.estimate(model, cluster, plan)
    plot_timeline(est, "timeline.png", "llama3-8b on 64 H100")
    plot_memory(est, cluster, "memory.png")

The timeline has one row per pipeline rank: forward (F), backward (B, or I and W when
zero-bubble splits it) and the optimizer on the upper lane; communication on a thin
lower lane (pipeline sends, data-parallel gradient reduction); the tensor-parallel
collectives inside each F/B are shaded dark over the end of the bar. Idle time before a
rank's last compute action is shaded: those are the pipeline bubbles.

matplotlib is imported lazily with the non-interactive Agg backend, so these work on
a headless machine and importing this module costs nothing.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from autoplan.units import GiB

if TYPE_CHECKING:
    from autoplan.cluster import Cluster
    from costmodel.estimate import Estimate

COLORS = {
    "F": "#4C72B0",          # forward
    "B": "#55A868",          # full backward
    "I": "#8FBF6A",          # backward, input gradient (zero-bubble)
    "W": "#DD8452",          # backward, weight gradient (zero-bubble)
    "optimizer": "#937860",
    "p2p": "#8172B2",        # pipeline send/recv
    "reduce": "#C44E52",     # data-parallel gradient reduction
    "idle": "#E8E8E8",       # bubble
    "host": "#B0B0B0",       # the step waiting on its host
}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)",
          "optimizer": "optimizer step", "p2p": "pipeline send", "reduce": "data-parallel grad reduce",
          "idle": "idle (bubble)", "tp": "tensor-parallel comm (inside F/B)",
          "host": "waiting on the host (spread over the step)"}
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "transient", "overhead")
MEMORY_COLORS = dict(zip(MEMORY_PARTS, ("#4C72B0", "#55A868", "#DD8452", "#C44E52", "#8172B2", "#B0B0B0")))


@dataclass
class TimelineData:
    """The intervals a timeline figure shows, per pipeline rank, in seconds."""

    ranks: int
    """Pipeline ranks (rows)."""
    compute: dict[int, list[tuple[str, int, int, float, float]]] = field(default_factory=dict)
    """rank -> (kind, stage, micro-batch, start, end) of F/B/I/W/optimizer actions."""
    tp_comm: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """rank -> tensor-parallel communication intervals (the tail of each F/B)."""
    comm: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)
    """rank -> ('p2p' | 'reduce', start, end) on the communication lane."""
    idle: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    """rank -> gaps before the rank's last compute action (pipeline bubbles)."""
    end: float = 0.0
    """End of the device's work (the iteration time, less any wait on the host)."""
    host_wait: float = 0.0
    """What the step adds waiting on a host slower than its device (``costmodel.host``);
    drawn after ``end``, though the waits fall throughout the step."""

    def idle_time(self, rank: int) -> float:
        return sum(b - a for a, b in self.idle.get(rank, []))


def timeline_data(estimate: "Estimate") -> TimelineData:
    """Intervals to draw, derived from the simulated events and the per-stage costs."""
    plan = estimate.plan
    costs = estimate.stage_costs
    stage_rank = [s.group for s in plan.stages]
    host = estimate.breakdown.get("host", 0.0)
    data = TimelineData(ranks=plan.pp, end=estimate.iteration_time_s - host, host_wait=host)
    for g in range(plan.pp):
        data.compute[g], data.tp_comm[g], data.comm[g], data.idle[g] = [], [], [], []
    finish: dict[tuple[str, int, int], float] = {}
    for e in estimate.timeline:
        if e.kind in ("F", "B", "I", "W", "optimizer"):
            data.compute[e.rank].append((e.kind, e.stage, e.micro_batch, e.start, e.end))
            finish[(e.kind, e.stage, e.micro_batch)] = e.end
            if costs and e.kind in ("F", "B", "I") and e.stage >= 0:
                c = costs[e.stage]
                tp = c.tp_comm_forward if e.kind == "F" else c.tp_comm_backward
                if tp > 0:
                    data.tp_comm[e.rank].append((max(e.start, e.end - tp), e.end))
        elif e.kind == "reduce":
            data.comm[e.rank].append(("reduce", e.start, e.end))
    # Pipeline transfers: drawn on the sending rank, from the producer's end for the
    # stage's send time (the simulation adds exactly this delay to the consumer).
    if costs:
        back_kind = "I" if any(k[0] == "I" for k in finish) else "B"
        for (kind, s, m), end in finish.items():
            if kind == "F" and s + 1 < len(stage_rank) and stage_rank[s + 1] != stage_rank[s]:
                t = costs[s].send_forward
            elif kind == back_kind and s > 0 and stage_rank[s - 1] != stage_rank[s]:
                t = costs[s].send_backward
            else:
                continue
            if t > 0:
                data.comm[stage_rank[s]].append(("p2p", end, end + t))
    for g in range(plan.pp):
        spans = sorted((a, b) for k, _, _, a, b in data.compute[g] if k != "optimizer")
        t, gaps = 0.0, []
        for a, b in spans:
            if a > t + 1e-12:
                gaps.append((t, a))
            t = max(t, b)
        data.idle[g] = gaps
    return data


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _time_unit(end: float) -> tuple[float, str]:
    if end >= 2.0:
        return 1.0, "s"
    if end >= 2e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _draw_timeline(ax, estimate: "Estimate", title: str | None, scale: float, unit: str) -> TimelineData:
    from matplotlib.patches import Patch

    data = timeline_data(estimate)
    plan = estimate.plan
    n_events = sum(len(v) for v in data.compute.values())
    label_mb = n_events <= 160
    for g in range(plan.pp):
        y = plan.pp - 1 - g  # rank 0 on top, as pipelines are usually drawn
        ax.broken_barh([(a * scale, (b - a) * scale) for a, b in data.idle[g]], (y + 0.35, 0.6),
                       facecolors=COLORS["idle"], edgecolor="none", hatch="..", zorder=1)
        for kind in ("F", "B", "I", "W", "optimizer"):
            spans = [(a * scale, (b - a) * scale) for k, _, _, a, b in data.compute[g] if k == kind]
            if spans:
                # Thin white separators help with a few actions and wash the colour out with many.
                ax.broken_barh(spans, (y + 0.35, 0.6), facecolors=COLORS[kind],
                               edgecolor="white" if label_mb else "none", linewidth=0.3, zorder=2)
        if data.tp_comm[g]:
            ax.broken_barh([(a * scale, (b - a) * scale) for a, b in data.tp_comm[g]], (y + 0.35, 0.6),
                           facecolors="black", edgecolor="none", alpha=0.3, zorder=3)
        for kind in ("p2p", "reduce"):
            spans = [(a * scale, (b - a) * scale) for k, a, b in data.comm[g] if k == kind]
            if spans:
                ax.broken_barh(spans, (y + 0.05, 0.25), facecolors=COLORS[kind], edgecolor="none", zorder=2)
        if data.host_wait > 0.005 * data.end:
            ax.broken_barh([(data.end * scale, data.host_wait * scale)], (y + 0.35, 0.6),
                           facecolors=COLORS["host"], edgecolor="none", hatch="//", zorder=1)
        if label_mb:
            for k, s, m, a, b in data.compute[g]:
                # Only where the number fits inside the bar.
                if k in ("F", "B", "I", "W") and m >= 0 and b - a >= 0.012 * data.end * (1 + (m >= 10)):
                    ax.text((a + b) / 2 * scale, y + 0.65, str(m), ha="center", va="center", fontsize=6,
                            color="white", zorder=4, clip_on=True)
    ax.set_yticks([plan.pp - 1 - g + 0.5 for g in range(plan.pp)])
    ax.set_yticklabels([f"pp {g}" for g in range(plan.pp)])
    ax.set_ylim(0, plan.pp)
    ax.set_xlim(0, (data.end + data.host_wait) * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    bubble = sum(data.idle_time(g) for g in range(plan.pp)) / max(plan.pp, 1)
    head = f"{title}\n" if title else ""
    ax.set_title(f"{head}{plan.describe()}\niteration {estimate.iteration_time_s * scale:.4g} {unit}, "
                 f"mean idle before last compute {bubble * scale:.3g} {unit}", fontsize=8)
    kinds = {k for v in data.compute.values() for k, *_ in v} | {k for v in data.comm.values() for k, *_ in v}
    handles = [Patch(facecolor=COLORS[k], label=LABELS[k]) for k in
               ("F", "B", "I", "W", "optimizer", "p2p", "reduce") if k in kinds]
    if any(data.tp_comm.values()):
        handles.append(Patch(facecolor="black", alpha=0.3, label=LABELS["tp"]))
    if any(data.idle.values()):
        handles.append(Patch(facecolor=COLORS["idle"], hatch="..", label=LABELS["idle"]))
    if data.host_wait > 0.005 * data.end:
        handles.append(Patch(facecolor=COLORS["host"], hatch="//", label=LABELS["host"]))
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return data


def plot_timeline(estimate: "Estimate", path: str | Path, title: str | None = None) -> TimelineData:
    """Write the simulated timeline of one iteration (PNG, or any format matplotlib infers
    from the suffix); returns the intervals drawn."""
    return plot_timelines([(estimate, title)], path)[0]


def plot_timelines(items: Sequence[tuple["Estimate", str | None]], path: str | Path) -> list[TimelineData]:
    """Several timelines stacked on one time axis (e.g. searched plan vs baseline), so
    that lengths and bubbles compare at a glance."""
    plt = _plt()
    end = max(e.iteration_time_s for e, _ in items)
    scale, unit = _time_unit(end)
    heights = [max(1.2, 0.45 * e.plan.pp + 0.9) for e, _ in items]
    fig, axes = plt.subplots(len(items), 1, figsize=(11, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, sharex=True)
    out = []
    for ax, (est, title) in zip(axes[:, 0], items):
        out.append(_draw_timeline(ax, est, title, scale, unit))
        ax.set_xlim(0, end * scale * 1.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return out


@dataclass
class MemoryBar:
    """One bar of a memory figure: the peak of one pipeline group's ranks."""

    label: str
    """'pp g' plus the device type(s) of the group."""
    parts: dict[str, float]
    """Bytes per component (weights, gradients, optimizer, activations, transient, overhead)."""
    capacity: float
    """Memory of the smallest device in the group, in bytes."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def memory_bars(estimate: "Estimate", cluster: "Cluster") -> list[MemoryBar]:
    plan = estimate.plan
    bars = []
    for g, (group, mem) in enumerate(zip(plan.groups, estimate.memory_by_group)):
        # The cluster's short node-group names ('a100', 'h100') keep the tick labels readable.
        devices = sorted({cluster.groups[cluster.slots[r].group].name for r in group.ranks})
        capacity = min(cluster.slots[r].device.memory_bytes for r in group.ranks)
        bars.append(MemoryBar(label=f"pp {g}\n{'+'.join(devices)}",
                              parts={p: float(getattr(mem, p)) for p in MEMORY_PARTS}, capacity=capacity))
    return bars


def _draw_memory(ax, estimate: "Estimate", cluster: "Cluster", title: str | None) -> list[MemoryBar]:
    bars = memory_bars(estimate, cluster)
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for part in MEMORY_PARTS:
        vals = [b.parts[part] / GiB for b in bars]
        ax.bar(x, vals, bottom=bottom, color=MEMORY_COLORS[part], label=part, width=0.7)
        bottom = [a + v for a, v in zip(bottom, vals)]
    for i, b in enumerate(bars):
        # Capacity drawn per bar: on a mixed cluster groups sit on different devices.
        ax.hlines(b.capacity / GiB, i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1.2,
                  label="device capacity" if i == 0 else None)
        if not b.fits:
            ax.text(i, b.total / GiB, "OOM", ha="center", va="bottom", color="#C44E52", fontsize=7,
                    fontweight="bold")
    ax.set_xticks(list(x))
    ax.set_xticklabels([b.label for b in bars], fontsize=6 if len(bars) > 8 else 7,
                       rotation=90 if len(bars) > 16 else 0)
    ax.set_ylabel("peak memory per GPU (GiB)")
    top = max(max(b.total, b.capacity) for b in bars) / GiB
    ax.set_ylim(0, top * 1.15)
    verdict = "fits" if estimate.fits else "DOES NOT FIT"
    head = f"{title}\n" if title else ""
    desc = textwrap.fill(estimate.plan.describe(), width=max(30, int(ax.get_position().width * 120)))
    ax.set_title(f"{head}{desc}\npeak {estimate.peak_memory_bytes / GiB:.1f} GiB/GPU, {verdict}", fontsize=7)
    return bars


def plot_memory(estimate: "Estimate", cluster: "Cluster", path: str | Path,
                title: str | None = None) -> list[MemoryBar]:
    """Write a bar per pipeline group (stacked by component) against the capacity of the
    group's devices; returns the bars drawn."""
    return plot_memory_grid([(estimate, title)], cluster, path)[0]


def plot_memory_grid(items: Sequence[tuple["Estimate", str | None]], cluster: "Cluster",
                     path: str | Path) -> list[list[MemoryBar]]:
    """Memory figures of several plans side by side (searched plan and baselines)."""
    plt = _plt()
    widths = [max(2.6, 0.4 * e.plan.pp + 1.6) for e, _ in items]
    legend_w = 1.6  # inches kept free on the right for the legend
    total = min(sum(widths), 24) + legend_w
    fig, axes = plt.subplots(1, len(items), figsize=(total, 4.6), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    out = [_draw_memory(ax, est, cluster, title) for ax, (est, title) in zip(axes[0], items)]
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center right", frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - legend_w / total, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return out
