"""The profile store: lookup and interpolation, what the cost model makes of it, the
efficiency fit, and the file format's validation. Entries here are synthetic (times
from a known formula) so that every expected value is computed, not copied."""
from __future__ import annotations

import dataclasses
import json

import pytest

import autoplan
from autoplan import models
from autoplan.catalog import DeviceSpec, get_device
from autoplan.errors import ConfigError
from autoplan.profiler.environment import Environment
from autoplan.profiler.fit import MeasuredLayer, fit_efficiency, transfer_efficiency
from autoplan.profiler.shapes import shape_key, spec_to_dict
from autoplan.profiler.store import ProfileFile, ProfileStore, file_name
from costmodel.compute import roofline_timing
from costmodel.efficiency import Efficiency, default_efficiency

CPU = get_device("CPU")
SEQS = (32, 64)
MBS = (1, 2, 4)
TPS = (1, 2)


def synthetic_ms(kind: str, tp: int, mb: int, s: int) -> dict:
    """A made-up but shape-like cost: fixed overhead + linear in tokens + quadratic
    attention, divided by tp; linear in the micro-batch as real layers nearly are."""
    base = {"embedding": 0.02, "block": 0.3, "head": 0.1}[kind]
    lin = {"embedding": 1e-4, "block": 3e-3, "head": 1e-3}[kind]
    quad = 2e-5 if kind == "block" else 0.0
    fwd = base + mb * (lin * s + quad * s * s) / tp
    return {"forward_ms": fwd, "backward_ms": 2 * fwd, "backward_input_ms": 1.2 * fwd,
            "backward_weight_ms": 0.8 * fwd, "recompute_core_ms": 0.1 * fwd if kind == "block" else 0.0,
            "saved_bytes": 1000.0 * mb * s / tp}


def make_file(path, device="CPU", dtype="fp32", preset="gpt-tiny", seqs=SEQS, mbs=MBS, tps=TPS,
              torch_version=None) -> ProfileFile:
    import torch
    env = Environment(device=device, device_kind="cpu", hardware="test cpu",
                      torch_version=torch_version or torch.__version__, threads=1, command="synthetic")
    f = ProfileFile(path / file_name(device, dtype, env.torch_version), env, dtype)
    for s in seqs:
        spec = models.get(preset, dtype=dtype, seq_len=s)
        for layer in (spec.layers[0], spec.layers[1], spec.layers[-1]):
            k = shape_key(layer)
            shape = {"model": preset, "kind": layer.kind, "seq_len": s, "fingerprint": k.fingerprint,
                     "tokens": k.tokens, "config": {}, "spec": spec_to_dict(layer)}
            for tp in tps:
                for mb in mbs:
                    f.add(k.id, shape, {"tp": tp, "micro_batch": mb, **synthetic_ms(layer.kind, tp, mb, s)})
    return f


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    make_file(d).save()
    return ProfileStore.load(d)


# (id, (preset, seq), unit, micro-batch, tp, sequence parallel, expected forward in ms or None)
def _lin(a, b, t):
    return a + (b - a) * t


LOOKUP_CASES = [
    ("exact", ("gpt-tiny", 32), 1, 2, 1, False, synthetic_ms("block", 1, 2, 32)["forward_ms"]),
    ("exact-tp2", ("gpt-tiny", 64), 1, 4, 2, False, synthetic_ms("block", 2, 4, 64)["forward_ms"]),
    ("mb-interpolated", ("gpt-tiny", 32), 1, 3, 1, False, synthetic_ms("block", 1, 3, 32)["forward_ms"]),
    ("mb-extrapolated", ("gpt-tiny", 32), -1, 8, 1, False, synthetic_ms("head", 1, 8, 32)["forward_ms"]),
    ("mb-too-far", ("gpt-tiny", 32), 1, 9, 1, False, None),
    ("seq-interpolated", ("gpt-tiny", 48), 1, 2, 1, False,
     _lin(synthetic_ms("block", 1, 2, 32)["forward_ms"], synthetic_ms("block", 1, 2, 64)["forward_ms"], 0.5)),
    ("seq-embedding", ("gpt-tiny", 40), 0, 1, 2, False,
     _lin(synthetic_ms("embedding", 2, 1, 32)["forward_ms"], synthetic_ms("embedding", 2, 1, 64)["forward_ms"], 0.25)),
    ("seq-above-range", ("gpt-tiny", 96), 1, 1, 1, False, None),
    ("seq-below-range", ("gpt-tiny", 16), 1, 1, 1, False, None),
    ("tp-not-profiled", ("gpt-tiny", 32), 1, 1, 4, False, None),
    ("other-architecture", ("llama-tiny", 32), 1, 1, 1, False, None),
    ("sequence-parallel-uses-plain", ("gpt-tiny", 32), 1, 2, 2, True, synthetic_ms("block", 2, 2, 32)["forward_ms"]),
]


@pytest.mark.parametrize("model,unit,mb,tp,sp,want", [c[1:] for c in LOOKUP_CASES], ids=[c[0] for c in LOOKUP_CASES])
def test_lookup(store, model, unit, mb, tp, sp, want):
    layer = models.get(model[0], dtype="fp32", seq_len=model[1]).layers[unit]
    t = store.layer_timing(CPU, layer, mb, tp, sp, "fp32")
    if want is None:
        assert t is None
        return
    assert t.source == "measured"
    assert t.forward == pytest.approx(want / 1e3, rel=1e-9)
    assert t.backward == pytest.approx(2 * t.forward, rel=1e-9)
    assert t.backward_input + t.backward_weight == pytest.approx(t.backward, rel=1e-9)


DEVICE_CASES = [
    ("alias", "cpu-ci", "fp32", True),
    ("other-dtype", "CPU", "bf16", False),
    ("other-device", "A100", "fp32", False),
]


@pytest.mark.parametrize("device,dtype,found", [c[1:] for c in DEVICE_CASES], ids=[c[0] for c in DEVICE_CASES])
def test_lookup_by_device_and_dtype(store, device, dtype, found):
    layer = models.get("gpt-tiny", dtype="fp32").layers[1]
    assert (store.layer_timing(get_device(device), layer, 1, 1, False, dtype) is not None) == found


def test_saved_bytes_lookup(store):
    layer = models.get("gpt-tiny", dtype="fp32", seq_len=48).layers[1]
    want = _lin(synthetic_ms("block", 2, 3, 32)["saved_bytes"], synthetic_ms("block", 2, 3, 64)["saved_bytes"], 0.5)
    assert store.saved_bytes(CPU, layer, 3, 2, "fp32") == pytest.approx(want)
    assert store.saved_bytes(CPU, layer, 3, 2, "fp32", recompute="full") is None


def _one_device_estimate(store, preset="gpt-tiny", mb=2, tp=1):
    spec = models.get(preset, dtype="fp32")
    cluster = autoplan.Cluster.homogeneous("CPU", 1, tp)
    plan = autoplan.Plan.uniform(spec, cluster, tp=tp, pp=1, dp=1, micro_batch=mb, global_batch=mb, dtype="fp32")
    return spec, autoplan.estimate(spec, cluster, plan, profiles=store)


def test_estimate_uses_measured_layers(store):
    spec, est = _one_device_estimate(store)
    assert est.sources == {"CPU": "measured"}
    # forward + backward (= 2 x forward in the synthetic entries) of every unit, in seconds
    want = sum(3 * synthetic_ms(layer.kind, 1, 2, 32)["forward_ms"] for layer in spec.layers) / 1e3
    assert est.breakdown["compute"] == pytest.approx(want, rel=1e-9)


def test_estimate_falls_back_to_roofline_when_not_covered(store):
    _spec, est = _one_device_estimate(store, preset="llama-tiny")
    assert est.sources == {"CPU": "roofline"}


# ----------------------------------------------------------------- efficiency fit
TRUE = Efficiency(matmul=0.37, attention_fwd=0.21, attention_bwd=0.13, memory=0.6, launch_s=7e-6, tile=1)


def measurements(device: DeviceSpec, eff: Efficiency, with_ops: bool) -> list[MeasuredLayer]:
    """What a device whose kernels run at ``eff`` would measure, from the cost model's own roofline."""
    out = []
    big = 1e12
    only_mm = dataclasses.replace(eff, attention_fwd=big, attention_bwd=big, memory=big, launch_s=0.0)
    only_att = dataclasses.replace(eff, matmul=big, memory=big, launch_s=0.0)
    for preset, seq in (("gpt-tiny", 32), ("llama-tiny", 64), ("gpt2-small", 64)):
        spec = models.get(preset, dtype="fp32", seq_len=seq)
        for layer in (spec.layers[0], spec.layers[1], spec.layers[-1]):
            for mb in (1, 4):
                for tp in (1, 2):
                    t = roofline_timing(device, eff, layer, mb, tp, False, "fp32")
                    ops = ({}, {})
                    if with_ops:
                        mm = roofline_timing(device, only_mm, layer, mb, tp, False, "fp32")
                        at = roofline_timing(device, only_att, layer, mb, tp, False, "fp32")
                        ops = ({"gemm_ms": mm.forward * 1e3, "attention_ms": at.forward * 1e3},
                               {"gemm_ms": mm.backward * 1e3, "attention_ms": at.backward * 1e3})
                    out.append(MeasuredLayer(spec=layer, tp=tp, micro_batch=mb, dtype="fp32", forward_s=t.forward,
                                             backward_s=t.backward, ops_forward=ops[0], ops_backward=ops[1]))
    return out


FIT_CASES = [
    # The roofline takes max(compute, memory) per GEMM; the fit adds them, hence a few % slack.
    ("with-operator-breakdown", True, ("matmul", "attention_fwd", "attention_bwd", "memory", "launch_s"), 0.1),
    ("totals-only", False, ("matmul", "launch_s"), 0.15),
]


@pytest.mark.parametrize("with_ops,fields,tol", [c[1:] for c in FIT_CASES], ids=[c[0] for c in FIT_CASES])
def test_fit_recovers_efficiency(with_ops, fields, tol):
    fit = fit_efficiency(CPU, measurements(CPU, TRUE, with_ops))
    for name in fields:
        assert getattr(fit.efficiency, name) == pytest.approx(getattr(TRUE, name), rel=tol), name
    assert fit.error_fitted < 0.05 < fit.error_default


def test_efficiency_transfers_within_vendor_and_class():
    fit = fit_efficiency(CPU, measurements(CPU, TRUE, True))
    other_cpu = dataclasses.replace(CPU, name="CPU-other", aliases=(), memory_bytes=CPU.memory_bytes * 2)
    moved = transfer_efficiency(other_cpu, [(CPU, fit)])
    default = default_efficiency("CPU-other")
    assert moved.matmul == pytest.approx(default.matmul * fit.efficiency.matmul / default_efficiency("CPU").matmul)
    assert transfer_efficiency(get_device("A100"), [(CPU, fit)]) is None


def test_store_efficiency_for_profiled_and_unprofiled(store):
    fitted = store.efficiency(CPU)
    assert isinstance(fitted, Efficiency) and fitted != default_efficiency("CPU")
    assert store.efficiency(get_device("H100")) is None


# ------------------------------------------------------------------ file format
def _edit(data, path, value):
    *head, last = path
    for k in head:
        data = data[k]
    if value is KeyError:
        del data[last]
    else:
        data[last] = value


FORMAT_CASES = [
    ("wrong-format", ("format",), "something-else", "not an autoplan profile"),
    ("newer-schema", ("schema_version",), 99, "not supported"),
    ("missing-layers", ("layers",), KeyError, "layers: is required"),
    ("unknown-shape", ("layers", 0, "shape"), "nope-s1", "is not in shapes"),
    ("missing-forward", ("layers", 0, "forward_ms"), KeyError, "forward_ms: is required"),
    ("environment-mismatch", ("device",), "A100-SXM4-80GB", "disagrees"),
]


@pytest.mark.parametrize("path,value,message", [c[1:] for c in FORMAT_CASES], ids=[c[0] for c in FORMAT_CASES])
def test_file_validation(tmp_path, path, value, message):
    f = make_file(tmp_path, seqs=(32,), mbs=(1,), tps=(1,))
    data = f.to_dict()
    _edit(data, path, value)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        ProfileFile.load(p)


def test_invalid_json_and_missing_path(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ProfileStore.load(p)
    with pytest.raises(ConfigError, match="no such profile"):
        ProfileStore.load(tmp_path / "missing")


def test_round_trip_and_current_torch_preferred(tmp_path):
    make_file(tmp_path, seqs=(32,), mbs=(1,), tps=(1,)).save()
    old = make_file(tmp_path, seqs=(32,), mbs=(1,), tps=(1,), torch_version="0.0.1")
    for e in old.layers:
        e["forward_ms"] *= 10
    old.save()
    store = ProfileStore.load(tmp_path)
    assert len(store.files) == 1
    layer = models.get("gpt-tiny", dtype="fp32").layers[1]
    assert store.layer_timing(CPU, layer, 1, 1, False, "fp32").forward == pytest.approx(
        synthetic_ms("block", 1, 1, 32)["forward_ms"] / 1e3)
