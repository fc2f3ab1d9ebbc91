"""Link benchmarks: the alpha-beta fit, its agreement with the cost model's collective
formulas, and a real gloo run between two local processes."""
from __future__ import annotations

import pytest

from autoplan.catalog import Link
from autoplan.cluster import Cluster
from autoplan.errors import ConfigError
from autoplan.profiler.fit import fit_alpha_beta
from autoplan.profiler.links import LinkSettings, benchmark_links, fit_samples, steps_and_bytes
from costmodel.comm import collective_time, p2p_time

SIZES = [2 ** k for k in range(10, 25, 2)]

FIT_CASES = [
    # (id, latency s, bandwidth B/s, steps factor, relative noise pattern)
    ("nvlink-like", 8e-6, 150e9, 1.0, 0.0),
    ("gloo-like", 60e-6, 2e9, 2.0, 0.0),
    ("noisy", 30e-6, 10e9, 1.0, 0.05),
]


@pytest.mark.parametrize("alpha,beta,steps,noise", [c[1:] for c in FIT_CASES], ids=[c[0] for c in FIT_CASES])
def test_alpha_beta_fit_recovers_the_link(alpha, beta, steps, noise):
    wiggle = [1 + noise * (-1) ** i for i in range(len(SIZES))]
    times = [(steps * alpha + n / beta) * w for n, w in zip(SIZES, wiggle)]
    fit = fit_alpha_beta([steps] * len(SIZES), SIZES, times)
    tol = 1e-6 if noise == 0 else 3 * noise
    assert fit.latency_s == pytest.approx(alpha, rel=tol)
    assert fit.bandwidth == pytest.approx(beta, rel=tol)
    assert fit.rms_rel_error <= noise + 1e-9


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_formula_is_the_cost_model_formula(op, n):
    """With the fitted (alpha, beta) the cost model must give back the time it was fitted
    to, so the step and byte counts must be exactly those of costmodel.comm."""
    link = Link(bandwidth=5e9, latency=20e-6)
    cluster = Cluster.homogeneous("CPU", 1, n, intra_node_GBps=5, intra_node_latency_us=20)
    from costmodel.efficiency import default_efficiency
    eff = default_efficiency("CPU").network
    nbytes = 3 * 2 ** 20
    steps, moved = steps_and_bytes(op, n, nbytes)
    ours = steps * link.latency + moved / (link.bandwidth * eff)
    if op == "p2p":
        theirs = p2p_time(cluster, [(0,)], [(1,)], nbytes)
    else:
        theirs = collective_time(cluster, list(range(n)), nbytes, op)
    assert ours == pytest.approx(theirs, rel=1e-12)


def test_fit_samples_per_operation():
    samples = [{"op": op, "bytes": n, "time_us": 1e6 * (s * 50e-6 + m / 3e9)}
               for op in ("all_reduce", "p2p") for n in SIZES for s, m in [steps_and_bytes(op, 4, n)]]
    overall, per = fit_samples(samples, 4)
    assert overall.bandwidth == pytest.approx(3e9, rel=1e-6) and overall.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert set(per) == {"all_reduce", "p2p"}


SETTINGS_ERRORS = [
    ("one-rank", dict(world_size=1), "needs >= 2 ranks"),
    ("unknown-op", dict(ops=("broadcast",)), "unknown"),
    ("tiny-size", dict(sizes=(4,)), "sizes must be"),
    ("backend", dict(backend="mpi"), "not 'gloo' or 'nccl'"),
]


@pytest.mark.parametrize("kw,message", [c[1:] for c in SETTINGS_ERRORS], ids=[c[0] for c in SETTINGS_ERRORS])
def test_settings_validation(kw, message):
    with pytest.raises(ConfigError, match=message):
        LinkSettings(**kw).validate()


UNRESOLVED_CASES = [
    # (id, times in s for SIZES): the time does not grow with the size, or barely.
    ("flat", [100e-6] * len(SIZES)),
    ("shrinking", [200e-6 - 5e-6 * i for i in range(len(SIZES))]),
    ("noise-only", [100e-6 * (1 + 0.01 * (-1) ** i) for i in range(len(SIZES))]),
]


@pytest.mark.parametrize("times", [c[1] for c in UNRESOLVED_CASES], ids=[c[0] for c in UNRESOLVED_CASES])
def test_alpha_beta_fit_never_reports_an_infinite_bandwidth(times):
    """A sweep whose time does not grow with the message size (sizes too small, or a
    loaded machine) says so instead of reporting an infinite or absurd bandwidth."""
    fit = fit_alpha_beta([1.0] * len(SIZES), SIZES, times)
    assert fit.bandwidth is None and not fit.resolved
    d = fit.to_dict()
    assert d["bandwidth_GBps"] is None and "not resolvable" in d["note"]
    assert fit.latency_s >= 0


@pytest.mark.slow
def test_gloo_benchmark_between_two_processes():
    # Sizes 4 KiB and 16 MiB: three orders of magnitude apart, so the transfer time
    # dominates the large one on any loopback. The minimum of the repeats is what a
    # loaded machine cannot inflate (other work only ever adds time).
    rec = benchmark_links(LinkSettings(world_size=2, sizes=(4096, 16 << 20), ops=("all_reduce", "p2p"),
                                       warmup=1, repeats=5, min_time_s=0.0, statistic="min", timeout_s=300))
    assert rec["backend"] == "gloo" and rec["world_size"] == 2
    assert {s["op"] for s in rec["samples"]} == {"all_reduce", "p2p"}
    for s in rec["samples"]:
        assert s["min_us"] <= s["median_us"] and s["time_us"] > 0
    big = {s["op"]: s["min_us"] for s in rec["samples"] if s["bytes"] > 1 << 20}
    small = {s["op"]: s["min_us"] for s in rec["samples"] if s["bytes"] < 1 << 20}
    assert all(big[op] > small[op] for op in big), (small, big)
    # Loopback between two processes: microseconds to milliseconds, MB/s to tens of GB/s.
    assert 0 <= rec["latency_us"] < 1e5 and 0.01 < rec["bandwidth_GBps"] < 1e3
    assert set(rec["by_op"]) == {"all_reduce", "p2p"}
