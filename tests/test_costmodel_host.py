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
from costmodel.host import (HOST_OVERLAP_NORM, NO_HOST, HostCosts, host_costs, layer_host_kernels,
                            runs_asynchronously, with_host)
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
    assert runs_asynchronously(name) is asynchronous


def test_host_costs_come_from_a_calibration_else_the_stack_and_never_on_a_cpu():
    stack = dataclasses.replace(get_stack("autoplan"), host_s_per_kernel=2e-5, host_s_per_step=0.1)
    cal = Calibration(stack="autoplan", devices={"H100-SXM5-80GB": DeviceCalibration(1.0, 5e-6, 0.01)})
    keep = Calibration(stack="autoplan", devices={"H100-SXM5-80GB": DeviceCalibration(1.0, None, 0.01)})
    cases = {
        "stack": (host_costs("H100-SXM5-80GB", stack), HostCosts(2e-5, 0.1)),
        "calibrated": (host_costs("H100-SXM5-80GB", stack, cal), HostCosts(5e-6, 0.01)),
        "calibrated-keeps-stack-per-kernel": (host_costs("H100-SXM5-80GB", stack, keep), HostCosts(2e-5, 0.01)),
        "other-device-uses-stack": (host_costs("A100-SXM4-80GB", stack, cal), HostCosts(2e-5, 0.1)),
        "cpu": (host_costs("CPU", stack, cal), NO_HOST),
    }
    for name, (got, want) in cases.items():
        assert got == want, name
    assert NO_HOST.time(1e6) == 0.0 and HostCosts(1e-5, 0.1).time(1000) == pytest.approx(0.11)


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
