"""The security findings, one test each: files are written without following planted
links, names from input files cannot escape their directory or another tool's config,
presets cannot be shadowed by files in the working directory, checkpoints are of this
model and plain data (see also test_fuzz_inputs for planted pickles), and single-node
runs open nothing on the network (see test_runtime_units.test_local_ranks_listen_on_loopback_only)."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.errors import ConfigError
from autoplan.plan import DeviceGroup, Plan, Stage

INJECTED = "gpt-tiny\n[checkpoint]\nfolder = '/tmp/x'\n--save /tmp/x"


def _plan(model: str = "gpt-tiny") -> Plan:
    return Plan(groups=(DeviceGroup((0, 1), 1),), stages=(Stage(0, 4, 0),), micro_batch=1, num_micro_batches=2,
                dtype="bf16", model=model, seq_len=32)


# ------------------------------------------------------------ atomic, link-safe writes
WRITERS = {
    "plan": lambda path: _plan().save(path),
    "cluster": lambda path: autoplan.Cluster.load("examples/clusters/cpu-4ranks.json").save(path),
    "text": lambda path: __import__("autoplan.files", fromlist=["write_text"]).write_text(path, "x\n"),
}


@pytest.mark.parametrize("name", list(WRITERS), ids=list(WRITERS))
def test_writes_replace_a_planted_link_instead_of_following_it(name, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    WRITERS[name](target)
    assert victim.read_text() == "precious\n"
    assert target.is_file() and not target.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_run_records_and_checkpoint_pointers_have_no_predictable_temporary_name(tmp_path):
    """The old code wrote run.json.tmp / latest.json.tmp: a link planted under that name
    redirected the write. Now nothing is written under a name known in advance."""
    from autoplan.files import write_text
    planted = tmp_path / "run.json.tmp"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted.symlink_to(victim)
    write_text(tmp_path / "run.json", "{}\n")
    assert victim.read_text() == "precious" and (tmp_path / "run.json").read_text() == "{}\n"


# --------------------------------------------------------------- names stay names
def test_a_multi_line_model_name_is_refused_in_a_plan_file(tmp_path):
    d = _plan().to_dict()
    d["model"] = INJECTED
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="control character"):
        Plan.load(tmp_path / "plan.json")


def test_a_multi_line_name_in_an_hf_config_is_refused(tmp_path):
    from autoplan.models.hf import config_from_hf
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
           "_name_or_path": INJECTED}
    with pytest.raises(ConfigError, match="_name_or_path"):
        config_from_hf(cfg)


@pytest.mark.parametrize("target", ["megatron", "torchtitan", "deepspeed"])
def test_exports_cannot_be_given_extra_lines(target):
    """Even a plan built in Python with a hostile name yields no injected flag or section."""
    from autoplan.export import export
    text = export(_plan(model=INJECTED), target).text
    lines = text.splitlines()
    assert not any(line.startswith(("[checkpoint]", "--save", "folder")) for line in lines), text
    if target == "deepspeed":
        assert json.loads(text)["comment"]


def test_a_scenario_name_cannot_leave_the_report_directory(tmp_path):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench import Scenario
    doc = json.loads(Path("benchmarks/scenarios/01-gpt3-1.3b-a100x8.json").read_text())
    for bad in ("../x", "a/b", ".hidden", "x\ny"):
        doc["name"] = bad
        with pytest.raises(ConfigError):
            Scenario.from_dict(doc, "s.json", Path("benchmarks/scenarios"))


def test_dry_run_prints_a_quoted_command(tmp_path, capsys):
    from autoplan.cli import main
    plan_path = tmp_path / "my plan; rm -rf x.json"
    autoplan.Plan.uniform(autoplan.models.get("gpt-tiny", dtype="fp32"),
                          autoplan.Cluster.load("examples/clusters/cpu-4ranks.json"), tp=1, pp=1, dp=2,
                          micro_batch=1, global_batch=2, dtype="fp32").save(plan_path)
    assert main(["run", str(plan_path), "--model", "gpt-tiny", "--dry-run", "--out", str(tmp_path / "r.json")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"'{plan_path}'" in line


# ------------------------------------------------------------- presets come first
def test_a_file_named_like_a_preset_does_not_replace_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt-tiny").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 1,
                                                   "vocab_size": 10, "n_positions": 8}))
    assert autoplan.models.get("gpt-tiny").config.hidden == 64          # the preset
    assert autoplan.models.get("./gpt-tiny").config.hidden == 8         # an explicit path is read
    from autoplan.runtime.trainer import resolve_model_config
    assert resolve_model_config("gpt-tiny").hidden == 64


# ------------------------------------------------------------------ checkpoints
def test_a_checkpoint_pointer_cannot_point_outside_its_directory(tmp_path):
    from autoplan.runtime.checkpoint import latest_checkpoint
    outside = tmp_path / "outside"
    (outside / "step_00000002").mkdir(parents=True)
    (outside / "step_00000002" / ".metadata").write_bytes(b"")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for path in ("../outside/step_00000002", str(outside / "step_00000002")):
        (ckpt / "latest.json").write_text(json.dumps({"step": 2, "path": path}))
        with pytest.raises(ConfigError, match="step directory"):
            latest_checkpoint(ckpt)
    # a step directory that is a link to elsewhere is refused too
    (ckpt / "step_00000002").symlink_to(outside / "step_00000002")
    (ckpt / "latest.json").write_text(json.dumps({"step": 2, "path": "step_00000002"}))
    with pytest.raises(ConfigError, match="outside"):
        latest_checkpoint(ckpt)


def test_a_checkpoint_of_another_model_is_named_as_such(tmp_path):
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)
    from autoplan.runtime.checkpoint import check_compatible

    def entry(shape):
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                     [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])
    md = Metadata(state_dict_metadata={"model.layers.0.tok_embeddings.weight": entry([256, 64])})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    check_compatible(tmp_path, {"layers.0.tok_embeddings.weight": torch.empty(256, 64)}, "gpt-tiny")
    with pytest.raises(ConfigError, match="shape .* another model"):
        check_compatible(tmp_path, {"layers.0.tok_embeddings.weight": torch.empty(128256, 4096, device="meta")},
                         "llama3-8b")
    with pytest.raises(ConfigError, match="has no parameter"):
        check_compatible(tmp_path, {"layers.1.attention.wq.weight": torch.empty(4, 4)}, "llama-tiny")


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_byte_entries_are_read_as_plain_data(tmp_path):
    """DCP's default planner unpickles byte entries with weights_only=False; ours refuses
    objects (and still reads plain values)."""
    import io
    from types import SimpleNamespace
    from autoplan.runtime.checkpoint import SafeLoadPlanner
    planner = SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.state.x"))
    plain = io.BytesIO()
    torch.save({"lr": 0.1, "step": torch.tensor(3)}, plain)
    plain.seek(0)
    planner.load_bytes(item, plain)
    assert planner.state_dict["optim.state.x"]["lr"] == 0.1
    marker = tmp_path / "pwned"
    evil = io.BytesIO()
    torch.save(_Payload(str(marker)), evil)
    evil.seek(0)
    with pytest.raises(ConfigError, match="not plain data"):
        planner.load_bytes(item, evil)
    assert not marker.exists()
