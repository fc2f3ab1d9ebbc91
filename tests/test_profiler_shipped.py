"""The CPU profile shipped in autoplan/data/profiles: it loads, it still matches the
specs autoplan.models measures today (if not, regenerate it with the command in its
environment block, see docs/profiler.md), and the cost model takes the measured path
with it. Its timings describe the machine that made it, so nothing here depends on
this machine's speed."""
from __future__ import annotations

import pytest

import autoplan
from autoplan import models
from autoplan.catalog import get_device
from autoplan.profiler import ProfileStore
from autoplan.profiler.shapes import shape_key

CPU = get_device("CPU")
COVERED = [
    # (preset, sequence length, micro-batch, tp): profiled points and interpolated ones
    ("gpt-tiny", 32, 1, 1), ("gpt-tiny", 64, 4, 2), ("gpt-tiny", 48, 3, 4),
    ("llama-tiny", 32, 2, 1), ("llama-tiny", 64, 1, 4), ("llama-tiny", 40, 8, 2),
    ("gpt2-small", 32, 1, 1), ("gpt2-small", 64, 2, 4), ("gpt2-small", 50, 3, 2),
]
NOT_COVERED = [
    ("gpt2-small", 128, 1, 1, "sequence beyond the profiled 32..64"),
    ("gpt2-small", 64, 1, 8, "tp 8 does not divide 12 heads, never profiled"),
    ("gpt2-medium", 64, 1, 1, "another architecture"),
    ("gpt-tiny", 32, 16, 1, "micro-batch more than 2x the largest profiled"),
]


@pytest.fixture(scope="module")
def shipped():
    store = ProfileStore.shipped()
    assert store.files, "autoplan/data/profiles holds no profile"
    return store


def test_shipped_file_records_its_origin(shipped):
    f = shipped.files[0]
    env = f.environment
    assert env.device == "CPU" and env.device_kind == "cpu" and env.torch_version and env.hardware
    assert env.command.startswith("autoplan profile --model gpt-tiny,llama-tiny,gpt2-small")
    assert f.settings["clock"] == "thread" and f.settings["statistic"] == "p10"
    assert "intra_node" in f.links and f.links["intra_node"]["backend"] == "gloo"


@pytest.mark.parametrize("preset,seq,mb,tp", COVERED, ids=[f"{c[0]}-s{c[1]}-mb{c[2]}-tp{c[3]}" for c in COVERED])
def test_shipped_profile_covers(shipped, preset, seq, mb, tp):
    spec = models.get(preset, dtype="fp32", seq_len=seq)
    for layer in (spec.layers[0], spec.layers[1], spec.layers[-1]):
        t = shipped.layer_timing(CPU, layer, mb, tp, False, "fp32")
        assert t is not None, f"{layer.kind} {shape_key(layer)} not in the shipped profile (regenerate it?)"
        assert t.source == "measured" and 0 < t.forward < t.forward + t.backward < 60


@pytest.mark.parametrize("preset,seq,mb,tp,why", NOT_COVERED, ids=[c[4] for c in NOT_COVERED])
def test_shipped_profile_declines(shipped, preset, seq, mb, tp, why):
    block = models.get(preset, dtype="fp32", seq_len=seq).layers[1]
    assert shipped.layer_timing(CPU, block, mb, tp, False, "fp32") is None


def test_estimate_takes_the_measured_path(shipped):
    spec = models.get("gpt2-small", dtype="fp32", seq_len=64)
    cluster = autoplan.Cluster.homogeneous("CPU", 1, 4)
    plan = autoplan.Plan.uniform(spec, cluster, tp=2, pp=2, dp=1, micro_batch=2, global_batch=8, dtype="fp32")
    est = autoplan.estimate(spec, cluster, plan, profiles=shipped)
    assert est.sources == {"CPU": "measured"}
    roofline = autoplan.estimate(spec, cluster, plan)
    assert roofline.sources == {"CPU": "roofline"}
    assert est.iteration_time_s != roofline.iteration_time_s


def test_efficiency_fit_and_link(shipped):
    fit = shipped.efficiency_fit(CPU)
    assert fit.layers == len(shipped.files[0].layers)
    assert fit.error_fitted <= fit.error_default
    link = shipped.link(CPU)
    assert link.bandwidth > 0 and link.latency >= 0
