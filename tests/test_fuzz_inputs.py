"""Hostile input files, generated: every format autoplan reads, mutated by hypothesis
(values replaced by huge, negative, fractional, non-finite, wrong-typed, multi-line or
path-like ones; keys dropped or added; the text truncated, bit-flipped, made invalid
UTF-8, nested thousands deep, given NaN literals, 5000-digit integers or repeated keys).

For every generated file the reader and what the tool does next with the result must
either succeed with sensible values or raise one ConfigError: never another exception
(a traceback), never run past a time limit (a hang), never accept nonsense (the
invariants below, e.g. no negative layer time in a profile). Each format runs a fixed,
derandomized set of examples; the totals are checked (>= 500 files) at the end.

A new file format joins by adding a row to FORMATS: a valid base document, how to read
it, and the invariants a successful read guarantees.
"""
from __future__ import annotations

import copy
import io
import json
import math
import pickle
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoplan.errors import AutoplanError, ConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES_PER_FORMAT = 50
TIME_LIMIT_S = 60
"""A read (and what follows it) taking longer than this counts as a hang (generous: the
suite shares two cores with other work; a real hang never ends)."""
TOTALS: dict[str, dict[str, int]] = {}

# ------------------------------------------------------------------------ base documents


def _plan_doc() -> dict:
    from autoplan.plan import DeviceGroup, Plan, Stage
    plan = Plan(groups=(DeviceGroup((0, 1), 1), DeviceGroup((2, 3), 1)),
                stages=(Stage(0, 2, 0), Stage(2, 4, 1, "full")), micro_batch=2, num_micro_batches=4,
                schedule="1f1b", dtype="fp32", model="gpt-tiny", seq_len=32)
    return plan.to_dict()


def _layouts_plan_doc() -> dict:
    """A plan with a per-operator layout section (issue 16's operator-level plans)."""
    from autoplan.layouts import Layouts, OpLayout, UnitLayout
    doc = _plan_doc()
    unit = UnitLayout(units=(1, 2), signature="0123abcd", input="R", output="R",
                      params=(("fc1.weight", "S0"), ("fc2.weight", "S1")),
                      ops=(OpLayout("linear", "aten.linear.default", ("R", "S0", None), ("S2",)),
                           OpLayout("linear_1", "aten.linear.default", ("S2", "S1", None), ("P",))),
                      coshard=2)
    doc["layouts"] = Layouts(units=(unit,), interlaced=(3,), objective_s=0.01).to_dict()
    return doc


def _operator_profile_doc() -> dict:
    entry = {"micro_batch": 1, "forward_ms": 0.12, "backward_ms": 0.3, "saved_bytes": 4096.0, "repeats": 5,
             "wall_s": 0.01}
    return {"format_version": 1, "device": "CPU", "dtype": "fp32", "statistic": "median", "torch": "2.13.0",
            "entries": {"aten.mm.default(8x16:R,16x32:S1)|mb=1": entry,
                        "aten.gelu.default(8x32:S1)|mb=1": dict(entry, forward_ms=0.01)}}


def _profile_doc() -> dict:
    data = json.loads((REPO / "autoplan" / "data" / "profiles" / "CPU_fp32_torch-2.13.0-cpu.json").read_text())
    layers = data["layers"][:12]
    keep = {e["shape"] for e in layers}
    data["layers"] = layers
    data["shapes"] = {k: v for k, v in data["shapes"].items() if k in keep}
    data["links"]["intra_node"]["samples"] = data["links"]["intra_node"]["samples"][:6]
    return data


def _record_doc() -> dict:
    plan = _plan_doc()
    return {"schema_version": 1, "kind": "autoplan-run", "plan": plan,
            "model": {"name": "gpt-tiny", "num_units": 4, "num_params": 120000, "config": {}},
            "environment": {"torch_version": "2.13.0", "python_version": "3.11", "backend": "gloo",
                            "device_type": "cpu", "device_names": ["cpu"] * 4, "world_size": 4, "num_nodes": 1},
            "run": {"steps_requested": 2, "tokens_per_step": 512, "seed": 0},
            "steps": [{"step": 1, "loss": 5.5, "step_time_s": 0.5, "tokens_per_s": 1024.0, "grad_norm": 1.2,
                       "peak_memory_bytes_by_rank": [100, 100, 90, 90]},
                      {"step": 2, "loss": 5.4, "step_time_s": 0.4, "tokens_per_s": 1280.0, "grad_norm": 1.1,
                       "peak_memory_bytes_by_rank": [100, 100, 90, 90]}],
            "memory": [{"rank": r, "peak_memory_bytes": 100, "memory_source": "cpu", "model_state_bytes": 100,
                        "max_rss_bytes": 10**8} for r in range(4)]}


def _scenario_doc() -> dict:
    return json.loads((REPO / "benchmarks" / "scenarios" / "02-gpt3-13b-a100x32.json").read_text())


def _hf_doc() -> dict:
    return {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
            "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "_name_or_path": "org/tiny"}


# ------------------------------------------------------------------------- consumers
def _read_cluster(path: Path):
    from autoplan.cluster import Cluster
    c = Cluster.load(path)
    c.summary()
    c.link(0, c.num_gpus - 1)
    return c


def _read_plan(path: Path):
    from autoplan.plan import Plan
    from autoplan.schedule import build_program
    plan = Plan.load(path)
    build_program(plan)
    plan.describe()
    return plan


def _read_operator_profile(path: Path):
    from autoplan.catalog import get_device
    from autoplan.profiler.operators import OperatorProfile
    prof = OperatorProfile.load(path)
    cpu = get_device("CPU")
    return [prof.op_timing(cpu, key.rsplit("|mb=", 1)[0], e["micro_batch"]) for key, e in prof.entries.items()]


def _ok_operator_profile(timings) -> None:
    for t in timings:
        assert t is None or all(math.isfinite(x) and x >= 0 for x in (t.forward, t.backward_input)), t


def _read_hf(path: Path):
    from autoplan.models.hf import config_from_hf
    return config_from_hf(path)


def _read_profile(path: Path):
    from autoplan.catalog import get_device
    from autoplan.models import get
    from autoplan.profiler import ProfileStore
    store = ProfileStore.load(path)
    store.summary()
    cpu = get_device("CPU")
    for layer in get("gpt-tiny", dtype="fp32").layers:
        store.layer_timing(cpu, layer, 2, 1, False, "fp32")
    store.link(cpu)
    return store


def _read_record(path: Path):
    from autoplan.runtime.record import compare_with_estimate, load_record
    rec = load_record(path)
    rec.summary()
    compare_with_estimate(rec, {"iteration_time_s": 1.0, "tokens_per_s": 100.0, "peak_memory_bytes": 1e6})
    return rec


def _read_scenario(path: Path):
    import sys
    sys.path.insert(0, str(REPO))
    from benchmarks.bench import Scenario
    return Scenario.load(path)


def _read_stack(path: Path):
    from autoplan.stacks import get_stack
    return get_stack(str(path))


def _read_calibration(path: Path):
    from costmodel.calibration import Calibration
    cal = Calibration.load(path)
    cal.check(list(cal.devices), cal.stack)
    return cal


def _calibration_doc() -> dict:
    from costmodel.calibration import KIND, SCHEMA_VERSION
    return {"schema_version": SCHEMA_VERSION, "kind": KIND, "stack": "autoplan",
            "devices": {"A100-SXM4-80GB": {"compute_scale": 1.1, "step_overhead_ms": 2.0, "launch_us": 4.0}},
            "activation_scale": 1.05, "memory_overhead_GiB": 0.5, "time_error": [-0.1, 0.1],
            "memory_error": [-0.05, 0.05], "runs": 5, "loo_time_mape": 0.08, "loo_memory_mape": 0.04,
            "source": {"command": "autoplan calibrate --runs a.json b.json"}}


def _read_pointer(path: Path):
    from autoplan.runtime.checkpoint import latest_checkpoint
    directory = path.parent
    (directory / "step_00000020").mkdir(exist_ok=True)
    (directory / "step_00000020" / ".metadata").write_bytes(b"")
    path.rename(directory / "latest.json")
    return latest_checkpoint(directory)


def _read_train_state(path: Path):
    from autoplan.runtime.checkpoint import read_train_state
    path.rename(path.parent / "train_state.json")
    return read_train_state(path.parent)


# ------------------------------------------------------------------------ invariants
def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _ok_cluster(c) -> None:
    from autoplan.limits import MAX_GPUS
    assert 1 <= c.num_gpus <= MAX_GPUS
    for g in c.groups:
        d = g.device
        assert g.nodes >= 1 and g.gpus_per_node >= 1
        assert _finite_positive(d.memory_bytes) and all(_finite_positive(v) for v in d.peak_flops.values())
        for link in (g.intra_node, c.nic(c.groups.index(g))):
            assert _finite_positive(link.bandwidth) and math.isfinite(link.latency) and link.latency >= 0
        assert "\n" not in g.name


def _ok_plan(p) -> None:
    p.validate()
    assert p.global_batch >= 1 and "\n" not in p.model


def _ok_hf(cfg) -> None:
    for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "head_dim"):
        assert isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 1, name
    assert "\n" not in cfg.name


def _ok_profile(store) -> None:
    for f in store.files:
        for e in f.layers:
            assert _finite_positive(e["forward_ms"]) and _finite_positive(e["backward_ms"])
            for k, v in e.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    assert math.isfinite(v) and v >= 0, k
        for rec in f.links.values():
            bw = rec.get("bandwidth_GBps")
            assert bw is None or _finite_positive(bw)


def _ok_record(rec) -> None:
    assert all(_finite_positive(s.step_time_s) and _finite_positive(s.tokens_per_s) for s in rec.steps)
    assert all(m.peak_memory_bytes >= 0 and 0 <= m.rank < rec.plan.num_gpus for m in rec.memory)
    assert rec.environment["world_size"] == rec.plan.num_gpus


def _ok_scenario(sc) -> None:
    assert "/" not in sc.name and not sc.name.startswith(".") and sc.global_batch >= 1


def _numbers_finite(obj) -> None:
    import dataclasses
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            assert math.isfinite(v), f.name


def _ok_stack(stack) -> None:
    from autoplan.stacks import ATTENTION_KERNELS, GRAD_COLLECTIVES
    _numbers_finite(stack)
    assert stack.attention in ATTENTION_KERNELS and stack.sharded_grad_collective in GRAD_COLLECTIVES


def _ok_calibration(cal) -> None:
    _numbers_finite(cal)
    for d in cal.devices.values():
        assert _finite_positive(d.compute_scale)
        assert d.step_overhead_s is None or (math.isfinite(d.step_overhead_s) and d.step_overhead_s >= 0)
    assert _finite_positive(cal.activation_scale)


def _ok_pointer(found) -> None:
    step, path = found
    assert step >= 0 and path.name == f"step_{step:08d}"


def _ok_train_state(state) -> None:
    assert isinstance(state["step"], int) and state["step"] >= 0


@dataclass(frozen=True)
class Format:
    base: Callable[[], Any]
    read: Callable[[Path], Any]
    check: Callable[[Any], None]


FORMATS = {
    "cluster": Format(lambda: json.loads((REPO / "examples/clusters/mixed-v100-t4.json").read_text()),
                      _read_cluster, _ok_cluster),
    "plan": Format(_plan_doc, _read_plan, _ok_plan),
    "plan-layouts": Format(_layouts_plan_doc, _read_plan, _ok_plan),
    "operator-profile": Format(_operator_profile_doc, _read_operator_profile, _ok_operator_profile),
    "hf-config": Format(_hf_doc, _read_hf, _ok_hf),
    "profile": Format(_profile_doc, _read_profile, _ok_profile),
    "run-record": Format(_record_doc, _read_record, _ok_record),
    "scenario": Format(_scenario_doc, _read_scenario, _ok_scenario),
    "stack": Format(lambda: json.loads((REPO / "autoplan/data/stacks/megatron-core.json").read_text()),
                    _read_stack, _ok_stack),
    "calibration": Format(_calibration_doc, _read_calibration, _ok_calibration),
    "checkpoint-pointer": Format(lambda: {"step": 20, "path": "step_00000020"}, _read_pointer, _ok_pointer),
    "checkpoint-train-state": Format(lambda: {"step": 20, "world_size": 2, "seed": 0, "plan": _plan_doc(),
                                              "model": {"name": "gpt-tiny", "num_params": 100},
                                              "data": {"position": 20, "kind": "synthetic"}},
                                     _read_train_state, _ok_train_state),
}

# ------------------------------------------------------------------------- mutations
HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, -(2**63), 2**63, 2**53 + 1, 10**18, 1e308, -1e308, 1e-320, 0.5, -0.0, 7.0,
                     True, False, None, "", "x", "../../etc/passwd", "a/b", "\n[checkpoint]\nfolder = '/tmp'",
                     "name\n--save /tmp/x", "\u2028", "NaN", "Infinity", "\udcff", [], {}, [1, 2, 3],
                     {"a": 1}, "9" * 5000, [[[[[[]]]]]], "gpt-tiny", "A100", "fp16", "zero-bubble"]),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.lists(st.integers(min_value=-5, max_value=10**6), max_size=6),
)
TEXT_MUTATIONS = ("truncate", "flip-byte", "bad-utf8", "nan-literal", "huge-int", "deep-nesting", "repeat-key",
                  "bom")


def _paths(doc, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc, path, value):
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _mutate(data, doc: Any) -> bytes:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        kind = data.draw(st.sampled_from(["value", "value", "value", "delete", "unknown-key"]), label="edit")
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if kind == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif kind == "unknown-key" and isinstance(parent, dict):
            parent[data.draw(st.sampled_from(["extra", "ranks ", "Name", "node_groups2"]))] = 1
        else:
            _set(doc, path, data.draw(HOSTILE, label="value"))
    text = json.dumps(doc, ensure_ascii=data.draw(st.booleans(), label="ascii"))
    raw = text.encode("utf-8", "surrogatepass")
    if data.draw(st.integers(0, 3), label="text?") == 0:
        how = data.draw(st.sampled_from(TEXT_MUTATIONS), label="text mutation")
        at = data.draw(st.integers(0, max(len(raw) - 1, 0)), label="at")
        if how == "truncate":
            raw = raw[:at]
        elif how == "flip-byte" and raw:
            raw = raw[:at] + bytes([raw[at] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[at + 1:]
        elif how == "bad-utf8":
            raw = raw[:at] + b"\xff\xfe\xc3" + raw[at:]
        elif how == "nan-literal":
            raw = raw.replace(b": 1", b": NaN", 1).replace(b": 2", b": -Infinity", 1)
        elif how == "huge-int":
            raw = raw.replace(b": 1", b": 1" + b"7" * 5000, 1)
        elif how == "deep-nesting":
            raw = b"[" * 100_000 + raw + b"]" * 100_000
        elif how == "repeat-key":
            raw = raw.replace(b"{", b'{"name": "a", "name": "b", ', 1)
        elif how == "bom":
            raw = b"\xef\xbb\xbf" + raw
    return raw


class _Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Hang()


def _judge(name: str, raw: bytes) -> str:
    """Read ``raw`` as format ``name``: 'ok', 'refused' (a ConfigError), or fail."""
    fmt = FORMATS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.json"
        path.write_bytes(raw)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(TIME_LIMIT_S)
        try:
            result = fmt.read(path)
        except _Hang:
            TOTALS[name]["hangs"] += 1
            pytest.fail(f"{name}: reading took more than {TIME_LIMIT_S} s:\n{raw[:400]!r}")
        except AutoplanError as e:
            assert "\n" not in str(e), f"{name}: a ConfigError must be one line: {str(e)[:300]!r}"
            return "refused"
        except Exception as e:   # noqa: BLE001 - the point of the test
            TOTALS[name]["tracebacks"] += 1
            raise AssertionError(f"{name}: {type(e).__name__} instead of a ConfigError on:\n{raw[:400]!r}") from e
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        try:
            fmt.check(result)
        except AssertionError:
            TOTALS[name]["nonsense"] += 1
            raise
        return "ok"


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    """One-off work (imports, the measured gpt-tiny spec the profile reads use) done before
    the clock of any read starts, so only the read itself is timed."""
    import sys
    sys.path.insert(0, str(REPO))
    import importlib
    for module in ("benchmarks.bench", "costmodel.calibration", "autoplan.profiler"):
        importlib.import_module(module)
    from autoplan.models import get
    get("gpt-tiny", dtype="fp32")


@pytest.mark.parametrize("name", list(FORMATS))
def test_base_documents_are_valid(name):
    assert _judge_fresh(name, json.dumps(FORMATS[name].base()).encode()) == "ok"


def _judge_fresh(name: str, raw: bytes) -> str:
    TOTALS.setdefault(name, {"files": 0, "ok": 0, "refused": 0, "tracebacks": 0, "hangs": 0, "nonsense": 0})
    return _judge(name, raw)


@pytest.mark.parametrize("name", list(FORMATS))
def test_generated_files_are_read_or_refused_in_one_line(name):
    base = FORMATS[name].base()
    TOTALS[name] = {"files": 0, "ok": 0, "refused": 0, "tracebacks": 0, "hangs": 0, "nonsense": 0}

    @settings(max_examples=EXAMPLES_PER_FORMAT, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        raw = _mutate(data, base)
        TOTALS[name]["files"] += 1
        TOTALS[name][_judge(name, raw)] += 1

    run()
    assert TOTALS[name]["files"] >= EXAMPLES_PER_FORMAT


# ------------------------------------------------------------ nonsense, by name
NONSENSE = {
    # name: (format, edit of the base document as (path, value), words in the error)
    "negative-layer-time": ("profile", (("layers", 0, "forward_ms"), -0.5), "forward_ms"),
    "nan-in-statistics": ("profile", (("layers", 0, "statistics", "median", "backward_ms"), -1.0), "backward_ms"),
    "infinite-link": ("profile", (("links", "intra_node", "bandwidth_GBps"), -3.0), "bandwidth_GBps"),
    "zero-gpus-per-node": ("cluster", (("node_groups", 0, "gpus_per_node"), 0), "gpus_per_node"),
    "astronomic-gpus": ("cluster", (("node_groups", 0, "gpus_per_node"), 1e308), "gpus_per_node"),
    "negative-bandwidth": ("cluster", (("inter_node", "bandwidth_GBps"), -1), "bandwidth_GBps"),
    "ten-million-micro-batches": ("plan", (("num_micro_batches",), 10**7), "num_micro_batches"),
    "fractional-micro-batch": ("plan", (("micro_batch",), 1.5), "micro_batch"),
    "multi-line-model-name": ("plan", (("model",), "x\n[checkpoint]"), "control character"),
    "ten-thousand-layers": ("hf-config", (("num_hidden_layers",), 10_000), "num_hidden_layers"),
    "negative-vocab": ("hf-config", (("vocab_size",), -5), "vocab_size"),
    "negative-step-time": ("run-record", (("steps", 0, "step_time_s"), -0.1), "step_time_s"),
    "rank-outside-the-run": ("run-record", (("memory", 0, "rank"), 7), "memory"),
    "scenario-escaping-out": ("scenario", (("name",), "../x"), "file name"),
    "global-batch-2-63": ("scenario", (("global_batch",), 2**63), "global_batch"),
    "pointer-outside-the-directory": ("checkpoint-pointer", (("path",), "../../elsewhere"), "step directory"),
    "negative-step": ("checkpoint-train-state", (("step",), -1), "step"),
}


@pytest.mark.parametrize("case", list(NONSENSE), ids=list(NONSENSE))
def test_named_nonsense_is_refused(case):
    name, (path, value), words = NONSENSE[case]
    doc = FORMATS[name].base()
    _set(doc, path, value)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "input.json"
            p.write_text(json.dumps(doc))
            FORMATS[name].read(p)


# ------------------------------------------------------------ checkpoint metadata
def _metadata_bytes() -> bytes:
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)
    md = Metadata(state_dict_metadata={"model.w": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([4, 4]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))])})
    return pickle.dumps(md)


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_metadata_is_unpickled_as_data_only(tmp_path):
    """DCP's .metadata is a pickle: a planted one must not run code, and garbage is one
    ConfigError line. Fuzzed bytes of a real metadata pickle, plus planted payloads."""
    from autoplan.runtime.checkpoint import read_metadata
    good = _metadata_bytes()
    (tmp_path / ".metadata").write_bytes(good)
    assert "model.w" in read_metadata(tmp_path).state_dict_metadata
    marker = tmp_path / "pwned"
    planted = [pickle.dumps(_Payload(str(marker))), pickle.dumps({"a": _Payload(str(marker))}),
               good.replace(b"Metadata", b"Metadatx"), b"", b"\x80\x05garbage"]
    TOTALS["checkpoint-metadata"] = {"files": 0, "ok": 0, "refused": 0, "tracebacks": 0, "hangs": 0, "nonsense": 0}

    @settings(max_examples=EXAMPLES_PER_FORMAT, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(good) - 1), st.integers(0, 255), st.sampled_from(["flip", "truncate", "insert"]))
    def fuzz(at, byte, how):
        raw = {"flip": good[:at] + bytes([byte]) + good[at + 1:], "truncate": good[:at],
               "insert": good[:at] + bytes([byte]) + good[at:]}[how]
        planted.append(raw)

    fuzz()
    for raw in planted:
        (tmp_path / ".metadata").write_bytes(raw)
        TOTALS["checkpoint-metadata"]["files"] += 1
        try:
            read_metadata(tmp_path)
            TOTALS["checkpoint-metadata"]["ok"] += 1
        except ConfigError as e:
            assert "\n" not in str(e)
            TOTALS["checkpoint-metadata"]["refused"] += 1
        except Exception as e:   # noqa: BLE001
            TOTALS["checkpoint-metadata"]["tracebacks"] += 1
            raise AssertionError(f"{type(e).__name__} instead of a ConfigError") from e
    assert not marker.exists(), "a planted pickle ran code"


def test_plain_data_files_of_a_checkpoint_refuse_pickled_objects(tmp_path):
    """rng_rank<r>.pt and data_state.pt are read with weights_only: objects are refused."""
    import torch
    from autoplan.runtime.checkpoint import _load_plain
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"cpu": _Payload(str(marker))}, buf)
    (tmp_path / "data_state.pt").write_bytes(buf.getvalue())
    with pytest.raises(ConfigError, match="not plain checkpoint data"):
        _load_plain(tmp_path / "data_state.pt")
    assert not marker.exists()


@pytest.fixture(scope="module", autouse=True)
def _report_totals():
    """The fuzz totals over every format, printed once the module has run (shown with -s):
    a report; the tests above check each file as it is read."""
    yield
    for name, t in sorted(TOTALS.items()):
        print(f"fuzz {name:24} files {t['files']:4}  read {t['ok']:4}  refused {t['refused']:4}  "
              f"tracebacks {t['tracebacks']}  hangs {t['hangs']}  nonsense {t['nonsense']}")
    print(f"fuzz total: {sum(t['files'] for t in TOTALS.values())} files")