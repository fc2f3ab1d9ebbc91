"""What a search returns: the ranked plans with their full estimates, the statistics of
the search, a table for people and an explanation of why the best plan wins."""
from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.cluster import Cluster
from autoplan.plan import Plan
from autoplan.units import GiB
from costmodel import Estimate
from search.placement import PlacementStats

BREAKDOWN_WORDS = {
    "compute": "compute on the critical rank",
    "tp_communication": "tensor-parallel communication",
    "ep_communication": "expert-parallel all-to-all",
    "cp_communication": "exposed context-parallel key/value exchange",
    "bubble": "pipeline bubble (idle time waiting on other stages)",
    "dp_communication": "exposed data-parallel gradient communication",
    "optimizer": "optimizer step and ZeRO parameter gathers",
    "host": "waiting on the host (it issues kernels slower than the device runs them)",
}


@dataclass
class RankedPlan:
    """One plan of the ranking, with the cost model's verdict on it."""

    rank: int
    """1 = best."""
    plan: Plan
    """The plan (``plan.save(path, extra={"estimate": estimate.to_dict()})`` writes it)."""
    estimate: Estimate
    """Full cost-model estimate (``costmodel.estimate``): the ranking key."""
    predicted_s: float
    """The search's closed-form iteration time that put it on the shortlist."""
    gpus_used: int
    """GPUs the plan uses (may be fewer than the cluster has: a choice, reported)."""

    @property
    def iteration_time_s(self) -> float:
        return self.estimate.iteration_time_s


@dataclass
class SearchStats:
    """How the search went: sizes of the space, what pruned what, time per phase."""

    candidates: int = 0
    """(device groups x setting) combinations enumerated."""
    skeletons: int = 0
    """Distinct pipelines of device groups (meshes) considered."""
    pruned_memory_bound: int = 0
    """Candidates dropped because a lower bound on their memory exceeds the devices'."""
    pruned_time_bound: int = 0
    """Candidates never split because a lower bound on their time could not beat the shortlist."""
    pruned_no_split: int = 0
    """Candidates for which the DP found no layer split that fits in memory."""
    pruned_split_bound: int = 0
    """Splits not simulated because their busiest rank alone could not beat the shortlist."""
    skipped_chunk_dps: int = 0
    """Interleaved candidates whose layer-split DPs were skipped: no split within the DPs'
    per-chunk memory budgets could beat the shortlist (``Bounds.share_period``), so only
    the even and the leanest splits were tried."""
    unexplored: int = 0
    """Candidates neither examined nor pruned when the time limit stopped the search."""
    stopped_at_time_limit: bool = False
    """The search stopped at its ``time_limit`` before it could prove its best plan optimal."""
    lower_bound_s: float = 0.0
    """No plan in the space is faster than this under the search's fast model (seconds per
    iteration): the best found when the search completed, else the least lower bound of
    what was left unexplored."""
    optimality_gap: float = 0.0
    """How much slower the best plan found may be than the best in the space, under the
    search's fast model: best / lower_bound_s - 1 (0 when the search completed)."""
    splits: int = 0
    """Layer-split DP runs."""
    shortlisted: int = 0
    """Candidates kept for the full cost model."""
    estimates: int = 0
    """Full ``costmodel.estimate`` calls."""
    estimate_fit_mismatch: int = 0
    """Shortlisted plans the full estimate found over memory (should stay 0)."""
    tight_fallback: bool = False
    """No plan fit with the memory margin free; the search then took plans that fit at all."""
    excluded_by_target: int = 0
    """Candidates dropped because the target engine cannot run them (``target=``)."""
    placement: PlacementStats | None = None
    """CP-SAT placement statistics (heterogeneous clusters only)."""
    phase_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase: tables, placement, enumerate, split, estimate."""
    total_s: float = 0.0
    """Wall time of the whole search."""

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in self.phase_s.items())
        lines = [f"searched {self.candidates:,} candidates on {self.skeletons:,} device-group pipelines "
                 f"in {self.total_s:.2f} s ({phases})",
                 f"  pruned: {self.pruned_memory_bound:,} by memory bound, {self.pruned_time_bound:,} by time "
                 f"bound, {self.pruned_no_split:,} with no fitting split; {self.splits:,} DP splits, "
                 f"{self.estimates} full estimates"
                 + (f"; {self.excluded_by_target:,} the target engine cannot run" if self.excluded_by_target else "")]
        if self.tight_fallback:
            lines.append("  no plan leaves the memory margin free: the plans below fit, but tightly")
        if self.stopped_at_time_limit:
            lines.append(f"  stopped at the time limit: {self.unexplored:,} candidates unexplored; the best plan is "
                         f"within {self.optimality_gap:.1%} of the best the space holds "
                         f"(no plan below {self.lower_bound_s:.4g} s per iteration)")
        if self.placement is not None:
            p = self.placement
            if p.enumerated:
                lines.append(f"  placement: all {p.enumerated:,} device-group sequences enumerated")
            else:
                lines.append(f"  placement: {p.solves} CP-SAT solves ({p.optimal} optimal, {p.infeasible} infeasible), "
                             f"{p.skeletons} device-group sequences, {p.wall_s:.2f} s"
                             + (f"; {p.floored} models left unsolved (their floor cannot come within "
                                "placement_alternatives_within of the best)" if p.floored else ""))
        return "\n".join(lines)


def memory_by_device(est: Estimate, cluster: Cluster) -> dict[str, tuple[float, float]]:
    """Device type -> (largest per-GPU peak bytes of the plan on it, device capacity)."""
    out: dict[str, tuple[float, float]] = {}
    for r, mem in est.memory_by_rank.items():
        dev = cluster.slots[r].device
        prev = out.get(dev.name, (0.0, dev.memory_bytes))
        out[dev.name] = (max(prev[0], mem), dev.memory_bytes)
    return out


def describe_degrees(plan: Plan) -> tuple[str, str, str]:
    """(dp, tp, pp) as strings; tp lists each group's degree when they differ."""
    tps = [g.tp for g in plan.groups]
    tp = str(tps[0]) if len(set(tps)) == 1 else "/".join(map(str, tps))
    pp = f"{plan.pp}x{plan.virtual_stages}" if plan.virtual_stages > 1 else str(plan.pp)
    return str(plan.dp), tp, pp


@dataclass
class SearchResult:
    """Plans ranked by the full cost model, best first."""

    ranked: list[RankedPlan]
    """Every fully estimated plan that fits, best (shortest iteration) first."""
    stats: SearchStats
    """Search statistics."""
    cluster: Cluster
    """The cluster searched."""
    model_name: str
    """Model searched."""
    global_batch: int
    """Samples per iteration."""
    target: str = "autoplan"
    """Engine the plans were searched for (see autoplan.engines)."""
    stack: str = "autoplan"
    """Training stack the cost model assumed."""
    notes: tuple[str, ...] = ()
    """Where the plans differ from the space asked for, one line each (a ZeRO stage the stack
    runs as a lower one under pipelining)."""

    @property
    def best(self) -> RankedPlan:
        return self.ranked[0]

    def table(self, top_k: int = 5) -> str:
        """The top plans as a plain-text table."""
        rows = []
        total = self.cluster.num_gpus
        # The context- and expert-parallel columns appear when a listed plan uses them.
        show_cp = any(rp.plan.cp > 1 for rp in self.ranked[:top_k])
        show_ep = any(rp.plan.ep > 1 for rp in self.ranked[:top_k])
        for rp in self.ranked[:top_k]:
            p, e = rp.plan, rp.estimate
            dp, tp, pp = describe_degrees(p)
            mem = " ".join(f"{name} {used / GiB:.1f}/{cap / GiB:.0f}"
                           for name, (used, cap) in memory_by_device(e, self.cluster).items())
            gpus = f"{rp.gpus_used}" if rp.gpus_used == total else f"{rp.gpus_used}/{total}"
            lo, hi = e.time_interval_s
            band = f"{lo:.3g}-{hi:.3g}" if hi > lo else "-"
            rows.append([str(rp.rank), gpus, dp, tp, pp,
                         p.schedule, f"{p.micro_batch}x{p.num_micro_batches}",
                         str(p.zero), p.recompute + (" sp" if p.sequence_parallel else ""),
                         f"{e.iteration_time_s:.3f}", band, f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}", mem,
                         e.status])
            if show_ep:
                rows[-1].insert(5, str(p.ep))
            if show_cp:
                rows[-1].insert(5, f"{p.cp} {p.cp_comm}" if p.cp > 1 else "1")
        header = ["#", "GPUs", "dp", "tp", "pp", "schedule", "mb x n", "zero", "recompute",
                  "iter s", "80% range", "tokens/s", "MFU", "peak GiB/device", "memory"]
        if show_ep:
            header.insert(5, "ep")
        if show_cp:
            header.insert(5, "cp")
        return _format_table(rows, header)

    def explain(self) -> str:
        """Why the best plan beats the runner-up: the breakdown term that differs most."""
        best = self.best
        lines = [f"best: {best.plan.describe()}", f"  {best.estimate.iteration_time_s:.4g} s per iteration, "
                 f"{best.estimate.tokens_per_s:,.0f} tokens/s, MFU {best.estimate.mfu:.1%}"]
        if best.gpus_used < self.cluster.num_gpus:
            lines.append(f"  it uses {best.gpus_used} of the cluster's {self.cluster.num_gpus} GPUs: adding the "
                         "rest gave no faster plan under the global batch")
        if len(self.ranked) < 2:
            lines.append("no runner-up fits, so there is nothing to compare against")
            return "\n".join(lines)
        second = self.ranked[1]
        b1, b2 = best.estimate.breakdown, second.estimate.breakdown
        diffs = sorted(((b2.get(k, 0.0) - b1.get(k, 0.0), k) for k in set(b1) | set(b2)), reverse=True)
        gap = second.estimate.iteration_time_s - best.estimate.iteration_time_s
        lines.append(f"runner-up: {second.plan.describe()}")
        lines.append(f"  {second.estimate.iteration_time_s:.4g} s per iteration ({gap:.3g} s, "
                     f"{gap / best.estimate.iteration_time_s:.1%} slower)")
        d, k = diffs[0]
        if d > 0:
            lines.append(f"the biggest difference is {BREAKDOWN_WORDS.get(k, k)}: {b2.get(k, 0.0):.4g} s for the "
                         f"runner-up against {b1.get(k, 0.0):.4g} s for the best ({d:.3g} s more)")
        against = [f"{BREAKDOWN_WORDS.get(k, k).split(' (')[0]} {-d:.3g} s" for d, k in diffs if d < 0]
        if against:
            lines.append("the runner-up is ahead on " + ", ".join(against) + ", which does not make up for it")
        keys = list(b1) + [k for k in b2 if k not in b1]
        lines.append("breakdown (s)      " + "  ".join(f"{k:>16}" for k in keys))
        lines.append("  best             " + "  ".join(f"{b1.get(k, 0.0):>16.4g}" for k in keys))
        lines.append("  runner-up        " + "  ".join(f"{b2.get(k, 0.0):>16.4g}" for k in keys))
        return "\n".join(lines)


def _format_table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
