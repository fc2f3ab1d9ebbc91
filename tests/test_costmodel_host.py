"""The host's share of a step (costmodel.host): how device and host time combine, what the
host is charged and where it applies. (That the search's fast model charges it as the
estimate does is test_search_internals' plan-by-plan check.)"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import autoplan
from autoplan.stacks import get_stack
from autoplan.catalog import is_accelerator
from costmodel.host import (HOST_OVERLAP_NORM, NO_HOST, HostCosts, device_budget, host_costs,
                            layer_host_kernels, with_host)
from costmodel.calibration import Calibration, DeviceCalibration

H100 = autoplan.Cluster.homogeneous("H100", 1, 1)
CPU = autoplan.Cluster.load("examples/clusters/cpu-4ranks.json")


@pytest.mark.parametrize("device,host,low,high", [
    (1.0, 0.0, 1.0, 1.0),                                   # no host: the device's time exactly
    (1.0, 0.5, 1.0, 1.0 + 0.01),                            # host under half: within 1% of the device
    (0.5, 1.0, 1.0, 1.0 + 0.01),                            # device under half: the host's
    (1.0, 1.0, 2 ** (1 / HOST_OVERLAP_NORM), 2 ** (1 / HOST_OVERLAP_NORM)),   # equal: the most above either
    (0.0, 0.3, 0.3, 0.3),                                   # nothing on the device: the host's
], ids=["no-host", "device-bound", "host-bound", "equal", "host-only"])
def test_step_is_the_larger_smoothed(device, host, low, high):
    assert low - 1e-12 <= with_host(device, host) <= high + 1e-12
    assert with_host(device, host) >= max(device, host) - 1e-12


SECONDS = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(SECONDS, SECONDS)
def test_device_budget_inverts_the_step(device, host):
    """What prunes device-only floors: a device time reaches the budget exactly when the
    step reaches the bound."""
    step = with_host(device, host)
    budget = device_budget(step, host)
    assert with_host(budget, host) == pytest.approx(step, rel=1e-9)
    if device >= host / 4:   # (where the host dwarfs the device, its share is below rounding)
        assert budget == pytest.approx(device, rel=1e-6, abs=1e-12)
    assert device_budget(float("inf"), host) == float("inf")
    if host > 0:
        assert device_budget(host, host) == 0.0


@given(SECONDS, SECONDS, SECONDS)
def test_step_grows_with_either_side_and_stays_near_the_larger(device, host, more):
    step = with_host(device, host)
    top = max(device, host)
    assert top - 1e-9 * top <= step <= top * 2 ** (1 / HOST_OVERLAP_NORM) * (1 + 1e-12)
    assert with_host(device + more, host) >= step * (1 - 1e-12)
    assert with_host(device, host + more) >= step * (1 - 1e-12)


@pytest.mark.parametrize("name,asynchronous", [
    ("H100-SXM5-80GB", True), ("A100-SXM4-80GB", True), ("T4", True), ("CPU", False), ("cpu-gloo", False),
], ids=["h100", "a100", "t4", "cpu", "cpu-lowercase"])
def test_which_devices_run_beside_their_host(name, asynchronous):
    assert is_accelerator(name) is asynchronous


def test_host_costs_come_from_a_calibration_else_the_stack_and_never_on_a_cpu():
    stack = dataclasses.replace(get_stack("autoplan"), host_s_per_kernel=2e-5, host_s_per_step=0.1)
    cal = Calibration(stack="autoplan", devices={"H100-SXM5-80GB": DeviceCalibration(1.0, 5e-6, 0.01)})
    keep = Calibration(stack="autoplan", devices={"H100-SXM5-80GB": DeviceCalibration(1.0, None, 0.01)})
    scale_only = Calibration(stack="autoplan", devices={"H100-SXM5-80GB": DeviceCalibration(1.2)})
    cases = {
        "stack": (host_costs("H100-SXM5-80GB", stack), HostCosts(2e-5, 0.1)),
        "calibrated": (host_costs("H100-SXM5-80GB", stack, cal), HostCosts(5e-6, 0.01)),
        "calibrated-keeps-stack-per-kernel": (host_costs("H100-SXM5-80GB", stack, keep), HostCosts(2e-5, 0.01)),
        "compute-scale-only-keeps-the-stack's-host": (host_costs("H100-SXM5-80GB", stack, scale_only),
                                                      HostCosts(2e-5, 0.1)),
        "other-device-uses-stack": (host_costs("A100-SXM4-80GB", stack, cal), HostCosts(2e-5, 0.1)),
        "cpu": (host_costs("CPU", stack, cal), NO_HOST),
    }
    for name, (got, want) in cases.items():
        assert got == want, name


def test_kernels_per_micro_batch_by_recompute():
    model = autoplan.models.get("gpt-tiny")
    block = next(l for l in model.layers if l.kind == "block")
    early, eager = get_stack("autoplan"), get_stack("torchtitan")   # early-stopping checkpoint or not
    base = block.kernels_fwd + block.kernels_bwd
    pre = block.recompute_prefix
    assert layer_host_kernels(block, "none", early) == base
    assert layer_host_kernels(block, "selective", early) == base
    assert layer_host_kernels(block, "full", eager) == base + block.kernels_fwd
    assert layer_host_kernels(block, "full", early) == base + pre.kernels + 2 * pre.saved_tensors


def _estimate(name, cluster, stack="autoplan", **plan):
    model = autoplan.models.get(name, seq_len=plan.pop("seq_len", 128))
    p = autoplan.Plan.uniform(model, cluster, **{"tp": 1, "pp": 1, "dp": 1, **plan})
    return autoplan.estimate(model, cluster, p, stack=stack)


@pytest.mark.parametrize("name,cluster,stack,plan,waits", [
    ("gpt2-small", H100, "autoplan", dict(micro_batch=1, global_batch=2), True),
    ("gpt2-small", H100, "megatron-core", dict(micro_batch=1, global_batch=2), False),
    ("gpt-tiny", CPU, "autoplan", dict(dp=4, micro_batch=1, global_batch=8, dtype="fp32"), False),
], ids=["small-steps-wait-on-the-host", "stack-without-host-figures", "cpu-is-its-own-host"])
def test_estimate_charges_the_host_where_it_applies(name, cluster, stack, plan, waits):
    est = _estimate(name, cluster, stack, **plan)
    assert ("host" in est.breakdown) is waits and ("host" in est.inputs) is waits
    assert sum(est.breakdown.values()) == pytest.approx(est.iteration_time_s, rel=1e-9)
    if waits:
        assert est.breakdown["host"] > 0


def test_host_matters_less_the_larger_the_step():
    small = _estimate("gpt2-small", H100, micro_batch=1, global_batch=2)
    large = _estimate("gpt2-small", H100, micro_batch=32, global_batch=64, seq_len=1024)
    share = lambda e: e.breakdown.get("host", 0.0) / e.iteration_time_s  # noqa: E731
    assert share(small) > 0.3 > 0.01 > share(large)


@pytest.mark.parametrize("per_micro_batch,per_step,m,want", [
    ([0.0], [0.0], 4, 0.0),                          # no host costs
    ([0.01], [0.1], 4, 4 * 0.01 + 0.1),              # one stage: m micro-batches, then the step
    ([0.01, 0.01], [0.1, 0.1], 1, 0.02 + 0.1),       # one micro-batch: through every host in turn
    ([0.01, 0.03], [0.1, 0.2], 4, 3 * 0.03 + 0.04 + 0.2),   # m - 1 periods of the busiest, one pass
], ids=["none", "one-stage", "one-micro-batch", "uneven-pipeline"])
def test_host_work_follows_the_pipeline(per_micro_batch, per_step, m, want):
    from costmodel.host import pipeline_host_time
    assert pipeline_host_time(per_micro_batch, per_step, m) == pytest.approx(want)


def test_a_deep_pipeline_of_one_micro_batch_gains_nothing_on_the_host():
    from costmodel.estimate import EstimateOptions, host_time
    model = autoplan.models.get("gpt2-small", seq_len=128)
    a100 = autoplan.Cluster.homogeneous("A100", 1, 8)
    options = EstimateOptions()
    one = host_time(model, a100, autoplan.Plan.uniform(model, a100, tp=1, pp=1, dp=1, micro_batch=16,
                                                       global_batch=16), options)
    deep = host_time(model, a100, autoplan.Plan.uniform(model, a100, tp=1, pp=8, dp=1, micro_batch=16,
                                                        global_batch=16), options)
    many = host_time(model, a100, autoplan.Plan.uniform(model, a100, tp=1, pp=8, dp=1, micro_batch=1,
                                                        global_batch=16), options)
    assert deep == pytest.approx(one, rel=1e-9)
    assert many < 16 * one   # (with many micro-batches the hosts do work side by side)


def test_search_host_figures_agree_and_the_floor_bounds_every_split():
    """split_host_time (tables only) equals the host time from stage figures; the bounds'
    host floor is below, and the ceiling above, every split's host time."""
    import itertools
    from search.bounds import Bounds
    from search.evaluate import Setting, Skeleton, host_time, split_host_time, stage_figures
    from search.tables import Kind, Tables
    from autoplan.plan import DeviceGroup
    model = autoplan.models.transformer(layers=6, hidden=512, heads=8, seq_len=256, vocab=8000)
    cluster = autoplan.Cluster.homogeneous("A100", 1, 4)
    tables = Tables(model, cluster)
    bounds = Bounds(tables, ("none", "full"), global_batch=8)
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=(2 * g, 2 * g + 1), tp=1) for g in range(2)),
                  kinds=(Kind(0, 1), Kind(0, 1)))
    st = Setting(1, 8, "1f1b", 1, 0, False)
    seen = []
    for cut in range(1, model.num_layers):
        split = [(0, cut), (cut, model.num_layers)]
        for modes in itertools.product(("none", "full"), repeat=2):
            figs = stage_figures(tables, sk, st, split, modes)
            h = host_time(tables, sk, st, figs)
            assert split_host_time(tables, sk, st, split, modes) == pytest.approx(h, rel=1e-12)
            seen.append(h)
    assert 0 < bounds.host_floor(sk, 8) <= min(seen) and max(seen) <= bounds.host_ceiling(sk, 8)


def test_host_aware_split_balances_what_the_hosts_issue():
    """Where the device-balanced split leaves one group issuing more kernels, the host-aware
    splitter's split has no group issuing more than it."""
    from search.evaluate import Setting, Skeleton, split_host_time
    from search.split import HostAwareSplitter, Splitter
    from search.tables import Kind, Tables
    from autoplan.plan import DeviceGroup
    model = autoplan.models.transformer(layers=4, hidden=1024, heads=16, seq_len=1024, vocab=32000)
    cluster = autoplan.Cluster.homogeneous("A100", 1, 4)
    tables = Tables(model, cluster)
    sk = Skeleton(groups=tuple(DeviceGroup(ranks=(g,), tp=1) for g in range(4)), kinds=(Kind(0, 1),) * 4)
    st = Setting(2, 2, "1f1b", 1, 0, False)
    device = Splitter(tables).split(sk, st, ("none",))
    host = HostAwareSplitter(tables).split(sk, st, ("none",))
    ck = tables.table(Kind(0, 1), 2, False).cum_kernels[0]
    most = lambda split: max(ck[b] - ck[a] for a, b in split.bounds)  # noqa: E731
    assert most(host) < most(device)   # (the device split gives one stage two blocks; this one pairs the head with a block)
    assert split_host_time(tables, sk, st, host.bounds, host.recompute) < split_host_time(
        tables, sk, st, device.bounds, device.recompute)
