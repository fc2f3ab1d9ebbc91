"""The runtime's single-process pieces: which plans it refuses and why, the mapping of
the zoo's tp_plan styles to DTensor styles, the data stream, the run record and its
comparison with an estimate, the `autoplan run` command line, and a one-rank training
run with a user dataset."""
from __future__ import annotations

import dataclasses
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel)

import autoplan
from autoplan.errors import ConfigError
from autoplan.models.presets import get_config
from autoplan.plan import DeviceGroup, Plan, Stage
from autoplan.data_parallel import data_parallel_choice
from autoplan.runtime.build import SumGradientOverRanks, materialize_units, meta_model, tensor_parallel_styles
from autoplan.runtime.data import DataSource, replica_slice, synthetic_batch
from autoplan.runtime.layout import check_plan_supported, mesh_tensor, rank_layout
from autoplan.runtime.record import RunRecord, compare_with_estimate, load_record
from autoplan.runtime.trainer import TrainOptions, resolve_model_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_runtime_parallel import make_plan  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ refused plans
def _mixed_tp() -> Plan:
    return Plan(groups=(DeviceGroup((0, 1), 2), DeviceGroup((2,), 1)),
                stages=(Stage(0, 2, 0), Stage(2, 4, 1)), micro_batch=1, num_micro_batches=2)


def _reversed_pipeline() -> Plan:
    return Plan(groups=(DeviceGroup((1,), 1), DeviceGroup((0,), 1)),
                stages=(Stage(0, 2, 0), Stage(2, 4, 1)), micro_batch=1, num_micro_batches=2)


REFUSED = {
    # name: (plan, model, field the error names)
    "tp-differs-across-groups": (_mixed_tp(), "gpt-tiny", "groups[1].tp"),
    "ranks-not-increasing-along-pp": (_reversed_pipeline(), "gpt-tiny", "groups"),
    "fp16-without-loss-scaling": (dataclasses.replace(make_plan(dp=2), dtype="fp16"), "gpt-tiny", "dtype"),
    "tp-does-not-divide-kv-heads": (make_plan(tp=4, m=1), "llama-tiny", "groups[0].tp"),
    "plan-for-another-depth": (make_plan(bounds=((0, 5),)), "gpt-tiny", "stages[0].end"),
    "interleaving-on-one-rank": (Plan(groups=(DeviceGroup((0,), 1),), stages=(Stage(0, 2, 0), Stage(2, 4, 0)),
                                      micro_batch=1, num_micro_batches=2, schedule="interleaved-1f1b",
                                      virtual_stages=2), "gpt-tiny", "virtual_stages"),
    "sequence-parallel-swin": (make_plan(tp=2, sp=True, bounds=((0, 10),)), "swin-tiny-test", "sequence_parallel"),
    "experts-on-a-dense-model": (make_plan(dp=2, ep=2), "gpt-tiny", "ep"),
    "ep-not-dividing-experts": (dataclasses.replace(make_plan(dp=3, m=1), ep=3), "moe-tiny", "ep"),
    "context-parallel-experts": (make_plan(cp=2, ep=2), "moe-tiny", "cp"),
}


@pytest.mark.parametrize("name", list(REFUSED), ids=list(REFUSED))
def test_unsupported_plans_are_refused_with_the_field_named(name):
    plan, model, field = REFUSED[name]
    cfg = resolve_model_config(model)
    units = meta_model(cfg).layers
    from autoplan.runtime.build import SEQUENCE_PARALLEL_UNITS
    with pytest.raises(ConfigError) as e:
        check_plan_supported(plan, len(units), kv_heads=getattr(cfg, "kv_heads", None),
                             sequence_parallel_ok=all(isinstance(u, SEQUENCE_PARALLEL_UNITS) for u in units),
                             num_experts=getattr(cfg, "num_experts", 0))
    assert e.value.field == field
    assert e.value.fix, "a refusal should say what to do instead"


def test_supported_plan_passes_and_mesh_follows_the_plans_ranks():
    plan = make_plan(pp=2, dp=2, tp=2, bounds=((0, 2), (2, 4)))
    check_plan_supported(plan, 4, kv_heads=2)
    grid = mesh_tensor(plan)
    assert grid.shape == (2, 2, 1, 2)
    assert grid[1, 0, 0, 1] == plan.groups[1].ranks[1]
    lay = rank_layout(plan, 6)
    assert (lay.pp_rank, lay.dp_rank, lay.cp_rank, lay.tp_rank, lay.stage_ids) == (1, 1, 0, 0, (1,))
    with_cp = make_plan(dp=2, cp=2, tp=2)
    grid = mesh_tensor(with_cp)
    assert grid.shape == (1, 2, 2, 2) and grid[0, 1, 0, 1] == 5   # ranks[(d * cp + c) * tp + t]
    lay = rank_layout(with_cp, 6)
    assert (lay.dp_rank, lay.cp_rank, lay.tp_rank) == (1, 1, 0)


def test_expert_coordinates_split_the_data_parallel_axis():
    """Replica d is expert shard d % ep of expert replica d // ep (runs of ep consecutive
    replicas share out the experts, as DeviceGroup.ep_groups lays them out)."""
    plan = make_plan(dp=4, tp=2, ep=2, m=1)
    for rank in range(8):
        lay = rank_layout(plan, rank)
        d = lay.dp_rank
        assert (lay.coordinate("ep"), lay.coordinate("edp")) == (d % 2, d // 2)
        group = next(g for g in plan.groups[0].ep_groups(2) if rank in g)
        assert group.index(rank) == lay.coordinate("ep")


# ------------------------------------------------------- DTensor styles from the zoo
def _block(model: str):
    return meta_model(get_config(model)).layers[1]


STYLE_CASES = {
    # name: (model, unit index, sequence parallel, {fqn: expected style type or None})
    "gpt-block-tp": ("gpt-tiny", 1, False, {"attention.wq": ColwiseParallel, "attention.wo": RowwiseParallel,
                                             "mlp.w2": RowwiseParallel, "attention_norm": None, "attention": None}),
    "gpt-block-sp": ("gpt-tiny", 1, True, {"attention_norm": SequenceParallel, "attention": PrepareModuleInput,
                                            "mlp": PrepareModuleInput, "mlp.w1": ColwiseParallel}),
    # Routed experts are sharded by ExpertParallel over the expert mesh, not by a TP style.
    "moe-block-sp": ("moe-tiny", 1, True, {"moe": PrepareModuleInputOutput, "moe.experts": None,
                                            "moe.gate": None}),
    "deepseek-moe-block-sp": ("deepseek-tiny", 2, True, {"moe": PrepareModuleInputOutput, "moe.experts": None,
                                                         "moe.shared.w2": RowwiseParallel,
                                                         "attention.q_b": ColwiseParallel,
                                                         "attention.q_a": None, "attention.kv_a": None,
                                                         "attention.shared_key": SumGradientOverRanks}),
    "embedding-sp": ("gpt-tiny", 0, True, {"tok_embeddings": RowwiseParallel, "pos_embeddings": None}),
    "head-sp": ("gpt-tiny", 3, True, {"norm": SequenceParallel, "output": ColwiseParallel}),
    "bert-head-sp": ("bert-tiny", 3, True, {"dense": SequenceParallel, "output": ColwiseParallel}),
}


@pytest.mark.parametrize("name", list(STYLE_CASES), ids=list(STYLE_CASES))
def test_zoo_styles_map_to_dtensor_styles(name):
    model, index, sp, expected = STYLE_CASES[name]
    unit = meta_model(get_config(model)).layers[index]
    plan, own = tensor_parallel_styles(unit, sp)
    for fqn, style in expected.items():
        if style is None:
            assert fqn not in plan, f"{fqn} should stay replicated"
        else:
            assert isinstance(plan.get(fqn), style), f"{fqn}: {plan.get(fqn)!r}"
    if name == "gpt-block-sp":   # rowwise linears scatter back to sequence shards
        assert plan["attention.wo"].output_layouts[0].is_shard(1)
    if name == "embedding-sp":   # positions are added to the full sequence, then it is split
        assert isinstance(own, PrepareModuleOutput)
    elif name != "embedding-sp":
        assert own is None


DP_CASES = {
    # name: (dp, zero, pp[, tp, schedule, ep]) -> (wrapper, reshard_after_forward, reduce_every_micro_batch)
    "dp1": ((1, 3, 1), ("none", False, False)),
    "zero0": ((2, 0, 1), ("ddp", False, False)),
    "zero0-under-pp": ((2, 0, 2), ("replicate", False, False)),
    "zero0-with-tp": ((2, 0, 1, 2), ("replicate", False, False)),
    "zero0-with-ep": ((2, 0, 1, 1, "1f1b", 2), ("replicate", False, False)),
    "zero1": ((2, 1, 1), ("fully_shard", False, False)),
    "zero2": ((2, 2, 1), ("fully_shard", False, True)),
    "zero3": ((2, 3, 1), ("fully_shard", True, True)),
    "zero2-under-pp": ((2, 2, 2), ("fully_shard", False, False)),
    "zero3-under-pp": ((2, 3, 2), ("fully_shard", False, False)),
}


@pytest.mark.parametrize("name", list(DP_CASES), ids=list(DP_CASES))
def test_data_parallel_choice(name):
    args, expected = DP_CASES[name]
    choice = data_parallel_choice(*args)
    assert (choice.wrapper, choice.reshard_after_forward, choice.reduce_every_micro_batch) == expected
    assert choice.note


# -------------------------------------------------------------------------- data
def test_units_initialise_identically_however_the_model_is_split():
    cfg = get_config("gpt-tiny")
    whole = materialize_units(cfg, range(4), seed=1)
    head_only = materialize_units(cfg, [3], seed=1)
    for (n, a), (_, b) in zip(whole[3].named_parameters(), head_only[3].named_parameters()):
        assert torch.equal(a, b), n
    # tied embeddings: the head's copy starts equal to the table, but is its own tensor
    assert torch.equal(head_only[3].output.weight, whole[0].tok_embeddings.weight)
    assert whole[3].output.weight is not whole[0].tok_embeddings.weight
    other_seed = materialize_units(cfg, [1], seed=2)
    assert not torch.equal(other_seed[1].mlp.w1.weight, whole[1].mlp.w1.weight)


SHARD_CASES = {
    # name: (global shape, local block as (start, stop) per sharded dim)
    "rows": ((10, 7), ((3, 8), (0, 7))),
    "columns": ((10, 7), ((0, 10), (2, 5))),
    "block-across-tiles": ((10, 7), ((1, 9), (2, 7))),
    "vector": ((23,), ((5, 17),)),
    "conv-like": ((6, 4, 3, 3), ((2, 6), (1, 3))),
    "empty": ((10, 7), ((4, 4), (0, 7))),
}


@pytest.mark.parametrize("name", list(SHARD_CASES), ids=list(SHARD_CASES))
def test_a_shard_is_initialised_to_its_slice_of_the_whole(name, monkeypatch):
    """Shard-local initialisation gives every block exactly its values in the whole tensor
    (tiles of 4 here, so blocks cross tile boundaries), for any block."""
    from autoplan.runtime import build as B
    monkeypatch.setattr(B, "INIT_TILE", 4)
    shape, block = SHARD_CASES[name]
    whole = torch.empty(shape)
    B.fill_shard(whole, shape, (0,) * len(shape), ("normal", 0.02), seed=7, key="w")
    sl = tuple(slice(a, b) for a, b in block)
    local = torch.empty(whole[sl].shape)
    B.fill_shard(local, shape, tuple(a for a, _ in block) + (0,) * (len(shape) - len(block)),
                 ("normal", 0.02), seed=7, key="w")
    assert torch.equal(local, whole[sl])
    assert whole.std() > 0.005 or whole.numel() < 2
    other = torch.empty(shape)
    B.fill_shard(other, shape, (0,) * len(shape), ("normal", 0.02), seed=7, key="v")
    assert not torch.equal(other, whole)


def test_synthetic_stream_is_seeded_and_plan_independent():
    cfg = get_config("gpt-tiny")
    a = synthetic_batch(cfg, 8, 3, seed=0)
    b = synthetic_batch(cfg, 8, 3, seed=0)
    c = synthetic_batch(cfg, 8, 4, seed=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == (8, cfg.seq_len) and int(a[0].max()) < cfg.vocab
    # the target is a fixed function of the token (learnable), the same in every batch
    table = {}
    for x, y in zip(torch.cat([a[0], c[0]]).flatten().tolist(), torch.cat([a[1], c[1]]).flatten().tolist()):
        assert table.setdefault(x, y) == y
    halves = [replica_slice(a, d, 2) for d in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), a[0])


def test_user_dataset_hooks_and_their_errors():
    cfg = get_config("gpt-tiny")
    batches = [synthetic_batch(cfg, 4, i, seed=9) for i in range(3)]
    by_index = DataSource(cfg, 4, 0, data=lambda i: batches[i])
    from_list = DataSource(cfg, 4, 0, data=batches)
    assert by_index.kind == "callable" and from_list.kind == "iterable"
    for expected in batches[:2]:
        for src in (by_index, from_list):
            got = src.next_batch()
            assert torch.equal(got[0], expected[0])
    resumed = DataSource(cfg, 4, 0, data=batches)
    resumed.load_state_dict(from_list.state_dict())
    assert torch.equal(resumed.next_batch()[0], batches[2][0])   # skipped what was consumed
    with pytest.raises(ConfigError, match="ran out"):
        resumed.next_batch()
    with pytest.raises(ConfigError, match="global"):
        DataSource(cfg, 8, 0, data=batches).next_batch()
    with pytest.raises(ConfigError, match="pair"):
        DataSource(cfg, 4, 0, data=lambda i: batches[0][0]).next_batch()


OPTION_ERRORS = {
    "steps-zero": ({"steps": 0}, "steps"),
    "unknown-optimizer": ({"optimizer": "lamb"}, "optimizer"),
    "negative-lr": ({"lr": -1.0}, "lr"),
    "nan-clip": ({"max_grad_norm": float("nan")}, "max_grad_norm"),
    "bad-betas": ({"betas": (0.9, 1.5)}, "betas"),
    "unknown-load-balancing": ({"load_balancing": "batch"}, "load_balancing"),
}


@pytest.mark.parametrize("name", list(OPTION_ERRORS), ids=list(OPTION_ERRORS))
def test_training_options_are_validated(name):
    kwargs, field = OPTION_ERRORS[name]
    with pytest.raises(ConfigError) as e:
        TrainOptions(**kwargs).validate()
    assert e.value.field == field


def test_model_resolution():
    assert resolve_model_config("gpt-tiny").seq_len == 32
    longer = resolve_model_config("gpt-tiny", seq_len=48)
    assert longer.seq_len == 48 and longer.max_positions >= 48
    assert resolve_model_config(autoplan.models.get("llama-tiny")).kv_heads == 2
    with pytest.raises(ConfigError):
        resolve_model_config(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="unknown model"):
        resolve_model_config("gpt-tinyy")


# ------------------------------------------------------------------------ record
def _record(**over) -> dict:
    from autoplan.runtime.record import MEMORY_SOURCE_CPU
    d = {"schema_version": 1, "kind": "autoplan-run", "plan": make_plan(dp=2).to_dict(),
         "model": {"name": "gpt-tiny", "num_units": 4},
         "environment": {"torch_version": torch.__version__, "python_version": "3", "backend": "gloo",
                         "device_type": "cpu", "device_names": ["cpu (x86_64)"] * 2, "world_size": 2},
         "run": {"tokens_per_step": 128},
         "steps": [{"step": i, "loss": 5.0 - i / 10, "step_time_s": t, "tokens_per_s": 128 / t, "grad_norm": 1.0}
                   for i, t in ((1, 0.5), (2, 0.1), (3, 0.3))],
         "memory": [{"rank": r, "peak_memory_bytes": 2**20 * (r + 1), "memory_source": MEMORY_SOURCE_CPU,
                     "model_state_bytes": 2**20 * (r + 1), "max_rss_bytes": 2**28} for r in (1, 0)]}
    d.update(over)
    return d


def test_record_round_trip_and_summary(tmp_path):
    rec = RunRecord.from_dict(_record())
    assert rec.step_time_s == pytest.approx(0.2)          # median of steps 2.. (first left out)
    assert rec.tokens_per_s == pytest.approx(640)
    assert rec.peak_memory_bytes == 2 * 2**20
    assert [m.rank for m in rec.memory] == [0, 1]
    rec.save(tmp_path / "run.json")
    again = load_record(tmp_path / "run.json")
    assert again.to_dict() == rec.to_dict()
    assert json.loads((tmp_path / "run.json").read_text())["summary"]["step_time_s"] == pytest.approx(0.2)


RECORD_ERRORS = {
    "not-a-run-record": ({"kind": "plan"}, "kind"),
    "negative-step-time": ({"steps": [{"step": 1, "loss": 1.0, "step_time_s": -1.0, "tokens_per_s": 1.0,
                                       "grad_norm": 0.0}]}, "step_time_s"),
    "unknown-field": ({"extra": 1}, "extra"),
    "memory-not-bytes": ({"steps": [{"step": 1, "loss": 1.0, "step_time_s": 1.0, "tokens_per_s": 1.0,
                                     "grad_norm": 0.0, "peak_memory_bytes_by_rank": [1.5]}]},
                         "peak_memory_bytes_by_rank"),
    "newer-schema": ({"schema_version": 99}, "schema_version"),
}


@pytest.mark.parametrize("name", list(RECORD_ERRORS), ids=list(RECORD_ERRORS))
def test_bad_records_are_rejected(name):
    over, field = RECORD_ERRORS[name]
    with pytest.raises(ConfigError) as e:
        RunRecord.from_dict(_record(**over))
    assert field in e.value.field


def test_missing_record_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_record(tmp_path / "nope.json")


def test_compare_with_a_real_estimate():
    rec = RunRecord.from_dict(_record())
    cluster = autoplan.Cluster.load(REPO / "examples" / "clusters" / "cpu-4ranks.json")
    est = autoplan.estimate("gpt-tiny", cluster, rec.plan)
    text = compare_with_estimate(rec, est)
    lines = text.splitlines()
    assert lines[0].split() == ["predicted", "measured", "measured/predicted"]
    time_row = next(l for l in lines if l.startswith("step time"))
    assert f"{est.iteration_time_s:.4g}" in time_row and "0.2" in time_row
    assert f"{0.2 / est.iteration_time_s:.2f}x" in time_row
    for r in (0, 1):
        row = next(l for l in lines if l.startswith(f"peak memory rank {r}"))
        assert f"{est.memory_by_rank[r] / 2**20:,.1f}" in row and f"{(r + 1):,.1f}" in row
    assert "warning" not in text
    other = dataclasses.replace(rec.plan, num_micro_batches=4)
    assert "different plan" in compare_with_estimate(rec, autoplan.estimate("gpt-tiny", cluster, other))
    # the dict form of an estimate works too (peak memory only)
    assert "tokens/s" in compare_with_estimate(rec, est.to_dict())


# ---------------------------------------------------------------------- the CLI
def _args(*extra):
    from autoplan.cli import build_parser
    return build_parser().parse_args(["run", "plan.json", "--model", "gpt-tiny", *extra])


CLI_CASES = {
    # name: (extra args, plan ranks, expected fragments, unexpected fragments). One node:
    # autoplan's own loopback launcher, no torchrun; several nodes: torchrun.
    "one-node": ((), 2, ["-m", "autoplan.runtime.worker", "--model", "gpt-tiny"],
                 ["torch.distributed.run", "--standalone", "--nnodes", "--nproc-per-node"]),
    "two-nodes": (("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h0:29500"), 8,
                  ["torch.distributed.run", "--nproc-per-node=4", "--nnodes=2", "--node-rank=1",
                   "--rdzv-endpoint=h0:29500", "--rdzv-backend=c10d", "autoplan.runtime.worker"], ["--standalone"]),
    "checkpointing": (("--checkpoint-dir", "ck", "--checkpoint-every", "5", "--no-resume"), 1,
                      ["--checkpoint-dir", "ck", "--no-resume"], ["torch.distributed.run"]),
}


@pytest.mark.parametrize("name", list(CLI_CASES), ids=list(CLI_CASES))
def test_launch_command(name, tmp_path, capsys):
    from autoplan.cli import main
    extra, ranks, want, unwanted = CLI_CASES[name]
    make_plan(dp=ranks, m=1).save(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), "--model", "gpt-tiny", "--dry-run",
                 "--out", str(tmp_path / "run.json"), *extra]) == 0
    cmd = capsys.readouterr().out.strip().splitlines()[-1].split()
    for w in want:
        assert w in cmd, (w, cmd)
    for u in unwanted:
        assert not any(c.startswith(u) for c in cmd), (u, cmd)


def test_local_ranks_listen_on_loopback_only():
    """A single-node run opens no rendezvous port: its ranks meet through a file in a
    private directory, and gloo/NCCL are pointed at the loopback interface."""
    from autoplan.runtime.launch import INIT_METHOD_ENV, loopback_interface, rank_env
    env = rank_env({}, 1, 4, "file:///tmp/x/store")
    assert env[INIT_METHOD_ENV].startswith("file://") and env["RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "127.0.0.1"
    if loopback_interface():
        assert env["GLOO_SOCKET_IFNAME"] == loopback_interface()
    assert rank_env({"GLOO_SOCKET_IFNAME": "eth9"}, 0, 2, "file:///x")["GLOO_SOCKET_IFNAME"] == "eth9"


def test_torchrun_command_refuses_a_wrong_process_count():
    from autoplan.commands.run import torchrun_command
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        torchrun_command(_args("--nproc-per-node", "3"), make_plan(dp=2, m=1))
    with pytest.raises(ConfigError):
        torchrun_command(_args("--nnodes", "2"), make_plan(dp=3, m=1))


def test_cli_reports_a_bad_plan_in_one_line(tmp_path, capsys):
    from autoplan.cli import main
    _mixed_tp().save(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), "--model", "gpt-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "groups[1].tp" in err


# ----------------------------------------------------- one rank, a user's data
@pytest.fixture
def one_rank_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_train_refuses_without_a_process_group():
    from autoplan.runtime import train
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="not initialized"):
        train(make_plan(m=1), "gpt-tiny", steps=1)


def test_one_rank_training_with_a_user_dataset(one_rank_group, tmp_path):
    from autoplan.runtime import train
    cfg = get_config("llama-tiny")
    plan = make_plan(m=2, schedule="zero-bubble", recompute="full")
    batch = synthetic_batch(cfg, plan.global_batch, 0, seed=4)
    calls = []

    def data(index):            # the same batch every step: the loss must fall
        calls.append(index)
        return batch

    rec = train(plan, "llama-tiny", steps=4, data=data, lr=1e-2, out=tmp_path / "run.json", log=None)
    assert calls == [0, 1, 2, 3]
    assert rec.losses[-1] < rec.losses[0] - 0.1
    assert rec.run["data"] == "callable" and rec.environment["world_size"] == 1
    assert load_record(tmp_path / "run.json").losses == rec.losses
