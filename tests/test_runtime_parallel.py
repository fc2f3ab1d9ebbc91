"""The runtime computes what one process computes: for every way of splitting a small
GPT/Llama (data, ZeRO, tensor + sequence, pipeline with each schedule, and their
products) and a small mixture of experts (expert parallelism with each of those), the
gradients after one step equal a single-process reference on the whole global batch, and
the losses (and load-balancing losses) over a few optimizer steps match.

Cases run in one spawned process group per world size (process start-up dominates on
a small machine); each rank writes its results to a file and the checks read those.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autoplan.models.presets import get_config
from autoplan.plan import DeviceGroup, Plan, Stage

STEPS = 3
LR = 0.1
MOMENTUM = 0.9
MAX_GRAD_NORM = 1.0
"""The grads of these models are ~2 in norm at init, so clipping is active in every step."""
SEED = 3
GRAD_ATOL = 1e-5
LOSS_ATOL = 1e-5


def make_plan(pp=1, dp=1, tp=1, bounds=((0, 4),), mb=1, m=2, schedule="1f1b", v=1, zero=0, sp=False,
              recompute="none", cp=1, cp_comm="p2p", ep=1) -> Plan:
    """Ranks pipeline-major, then data, then context, tensor fastest (Plan's layout)."""
    per = dp * cp * tp
    groups = tuple(DeviceGroup(tuple(range(p * per, (p + 1) * per)), tp, cp) for p in range(pp))
    modes = recompute if isinstance(recompute, (list, tuple)) else [recompute] * len(bounds)
    stages = tuple(Stage(a, b, i % pp, modes[i]) for i, (a, b) in enumerate(bounds))
    return Plan(groups=groups, stages=stages, micro_batch=mb, num_micro_batches=m, schedule=schedule,
                virtual_stages=v, zero=zero, sequence_parallel=sp, dtype="fp32", cp_comm=cp_comm,
                ep=ep).validate()


# name -> (model preset, plan). gpt-tiny: tied embeddings, learned positions, biases,
# LayerNorm, GELU; llama-tiny: untied, RoPE, RMSNorm, SwiGLU, grouped-query attention.
# Both have 4 units: embedding, 2 blocks, head.
CASES_2 = {
    "dp-ddp": ("gpt-tiny", make_plan(dp=2, m=2)),
    "dp-ddp-gpipe-order": ("llama-tiny", make_plan(dp=2, m=3, schedule="gpipe")),
    "zero1": ("llama-tiny", make_plan(dp=2, m=2, zero=1)),
    "zero2": ("llama-tiny", make_plan(dp=2, m=2, zero=2)),       # gradients reduce-scattered every micro-batch
    "zero3": ("gpt-tiny", make_plan(dp=2, m=2, zero=3, recompute="full")),
    "tp": ("llama-tiny", make_plan(tp=2, m=2)),
    "tp-sp": ("gpt-tiny", make_plan(tp=2, m=2, sp=True, recompute="selective")),
    "tp-sp-llama": ("llama-tiny", make_plan(tp=2, m=1, mb=2, sp=True)),
    "pp-gpipe": ("gpt-tiny", make_plan(pp=2, bounds=((0, 2), (2, 4)), m=4, schedule="gpipe")),
    "pp-1f1b-uneven": ("llama-tiny", make_plan(pp=2, bounds=((0, 1), (1, 4)), m=4, schedule="1f1b",
                                               recompute=("none", "full"))),
    "pp-interleaved": ("gpt-tiny", make_plan(pp=2, v=2, bounds=((0, 1), (1, 2), (2, 3), (3, 4)), m=4,
                                             schedule="interleaved-1f1b")),
    "pp-zero-bubble": ("llama-tiny", make_plan(pp=2, bounds=((0, 2), (2, 4)), m=4, schedule="zero-bubble",
                                               recompute=("selective", "full"))),
    # Other zoo families: MoE experts under SP (all-reduce inside the region, then split),
    # BERT's replicated MLM dense layer under SP, Swin's head-sharded position-bias table.
    "moe-tp-sp": ("moe-tiny", make_plan(tp=2, m=2, sp=True)),
    "bert-tp-sp": ("bert-tiny", make_plan(tp=2, m=2, sp=True)),
    "swin-tp": ("swin-tiny-test", make_plan(tp=2, m=2, bounds=((0, 10),))),
    # Mixtures of experts: experts split over the data-parallel ranks (EP x DP), and DeepSeek's
    # latent attention (its shared rotary key) with experts under TP + SP.
    "ep-x-dp": ("moe-tiny", make_plan(dp=2, m=2, ep=2)),
    "ep-x-dp-zero3": ("moe-tiny", make_plan(dp=2, m=2, ep=2, zero=3, recompute="full")),
    "deepseek-tp-sp": ("deepseek-tiny", make_plan(tp=2, m=2, sp=True, bounds=((0, 5),))),
    # The same plan under both load-balancing losses; GPipe runs every forward before the
    # first backward, so the global batch's expert counts are complete when backward reads them.
    "lbl-micro": ("moe-tiny", make_plan(dp=2, m=2, ep=2, schedule="gpipe"), {"load_balancing": "micro"}),
    "lbl-global": ("moe-tiny", make_plan(dp=2, m=2, ep=2, schedule="gpipe"), {"load_balancing": "global"}),
    # Current families: Qwen3's per-head q/k norm under TP (a replicated weight over sharded
    # heads), Gemma 2's windows, soft-caps, sandwich norms and scaled tied table under TP + SP,
    # OLMo 2's norm layout under ZeRO.
    "qwen3-tp": ("qwen3-tiny", make_plan(tp=2, m=2)),
    "gemma2-tp-sp": ("gemma2-tiny", make_plan(tp=2, m=2, sp=True)),
    "olmo2-zero1": ("olmo2-tiny", make_plan(dp=2, m=2, zero=1)),
    # Context parallelism: the zig-zag ring with a permutation (RoPE, GQA), the all-gather
    # ring (learned positions, tied table, recomputed attention), and the head scatter
    # (Gemma 2's windows and soft-caps run unchanged on whole sequences).
    "cp-ring-p2p": ("llama-tiny", make_plan(cp=2, m=2)),
    "cp-ring-all-gather": ("gpt-tiny", make_plan(cp=2, m=2, cp_comm="all_gather", recompute="selective")),
    "cp-a2a-gemma2": ("gemma2-tiny", make_plan(cp=2, m=2, cp_comm="a2a")),
}
CASES_4 = {
    "dp-x-tp-zero3-sp": ("llama-tiny", make_plan(dp=2, tp=2, m=2, zero=3, sp=True)),
    "dp-x-tp-replicate": ("gpt-tiny", make_plan(dp=2, tp=2, m=2, zero=0)),
    "pp-x-dp-zero-bubble-zero3": ("gpt-tiny", make_plan(pp=2, dp=2, bounds=((0, 2), (2, 4)), m=2,
                                                         schedule="zero-bubble", zero=3)),
    "pp-x-dp-1f1b-replicate": ("llama-tiny", make_plan(pp=2, dp=2, bounds=((0, 3), (3, 4)), m=2,
                                                        schedule="1f1b", zero=0)),
    "cp-x-dp-zero1": ("llama-tiny", make_plan(dp=2, cp=2, m=2, zero=1)),
    "cp-x-tp-sp": ("llama-tiny", make_plan(cp=2, tp=2, m=2, sp=True)),
    "cp-a2a-x-dp-ddp": ("qwen3-tiny", make_plan(dp=2, cp=2, m=1, mb=2, cp_comm="a2a")),
    "pp-x-tp-interleaved-sp": ("gpt-tiny", make_plan(pp=2, tp=2, v=2, bounds=((0, 1), (1, 2), (2, 3), (3, 4)),
                                                     m=2, schedule="interleaved-1f1b", sp=True)),
    "ep4-x-dp4": ("moe-tiny", make_plan(dp=4, m=1, ep=4)),                      # one expert per rank
    "ep2-x-dp4-zero1": ("moe-tiny", make_plan(dp=4, m=1, ep=2, zero=1)),         # experts on 2 ranks each
    "ep-x-pp-1f1b": ("moe-tiny", make_plan(pp=2, dp=2, ep=2, bounds=((0, 2), (2, 4)), m=2, zero=1)),
    "ep-x-pp-gpipe-global": ("moe-tiny", make_plan(pp=2, dp=2, ep=2, bounds=((0, 2), (2, 4)), m=2,
                                                   schedule="gpipe", recompute="full"), {"load_balancing": "global"}),
    "ep-x-tp-sp-deepseek": ("deepseek-tiny", make_plan(dp=2, tp=2, ep=2, m=2, sp=True, bounds=((0, 5),),
                                                       recompute="selective")),
    "ep-x-pp-zero-bubble-deepseek": ("deepseek-tiny", make_plan(pp=2, dp=2, ep=2, bounds=((0, 2), (2, 5)), m=2,
                                                                schedule="zero-bubble", zero=1,
                                                                recompute=("none", "full"))),
}
CASES_8 = {
    "pp-x-tp-x-dp-1f1b-zero1-sp": ("llama-tiny", make_plan(pp=2, dp=2, tp=2, bounds=((0, 2), (2, 4)), m=2,
                                                          schedule="1f1b", zero=1, sp=True)),
    # Pipeline sends carry each context rank's part of the sequence; the tied table's two
    # copies meet across stages per (replica, sequence shard).
    "pp-x-cp-x-dp-1f1b": ("gpt-tiny", make_plan(pp=2, dp=2, cp=2, bounds=((0, 2), (2, 4)), m=2,
                                                schedule="1f1b", cp_comm="all_gather")),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _equivalence(rank: int, model: str, plan: Plan, options: dict | None = None) -> dict:
    """STEPS steps of clipped SGD with momentum; grads of step 1 gathered in full."""
    from autoplan.runtime.trainer import Trainer, TrainOptions

    trainer = Trainer(plan, model, TrainOptions(steps=STEPS, optimizer="sgd", lr=LR, momentum=MOMENTUM,
                                                max_grad_norm=MAX_GRAD_NORM, seed=SEED, **(options or {})),
                      log=None)
    grads: dict = {}
    records = [trainer.train_step(inspect=lambda t: grads.update(t.gradients()))]
    records += [trainer.train_step() for _ in range(STEPS - 1)]
    lay = trainer.layout
    local_experts = {n: tuple(p.to_local().shape) for n, p in trainer.params.items()
                     if n.endswith("experts.w1") and hasattr(p, "to_local")}
    return {"losses": [r.loss for r in records], "grad_norms": [r.grad_norm for r in records],
            "load_balancing": [r.load_balancing_loss for r in records], "local_experts": local_experts,
            "model_state_bytes": trainer.memory().model_state_bytes,
            "grads": grads if lay.dp_rank == 0 and lay.cp_rank == 0 and lay.tp_rank == 0 else {}}


# ---------------------------------------------- checkpoints across plans (2 ranks)
SAVE_PLAN = make_plan(dp=2, m=2, zero=3)                          # FSDP-sharded weights and Adam states
LOAD_PLANS = {
    "tp2-sp": make_plan(tp=2, mb=2, m=2, sp=True),                 # DTensor TP shards instead
    "pp2-uneven-zero-bubble": make_plan(pp=2, bounds=((0, 3), (3, 4)), m=4, schedule="zero-bubble"),
}
RESHARD_STEPS = 4
assert all(p.global_batch == SAVE_PLAN.global_batch for p in LOAD_PLANS.values()), "same samples per step"


def _reshard(rank: int, ckpt: str, save_plan=None, load_plans=None, model: str = "gpt-tiny") -> dict:
    """Train ``save_plan`` (SAVE_PLAN), checkpoint after 2 steps, finish; then load that
    checkpoint under each of ``load_plans`` (LOAD_PLANS) and train the remaining steps."""
    from autoplan.runtime.trainer import Trainer, TrainOptions

    opts = TrainOptions(steps=RESHARD_STEPS, optimizer="adamw", lr=3e-3, eps=1e-6, seed=5)
    base = Trainer(save_plan or SAVE_PLAN, model, opts, log=None)
    losses = [base.train_step().loss for _ in range(2)]
    base.save(ckpt)
    saved = base.parameters_full()
    losses += [base.train_step().loss for _ in range(RESHARD_STEPS - 2)]
    result: dict = {"uninterrupted": losses}
    for name, plan in (load_plans or LOAD_PLANS).items():
        t = Trainer(plan, model, dataclasses.replace(opts, checkpoint_dir=ckpt), log=None)
        result[f"{name}.resumed_at"] = t.maybe_resume()
        loaded = t.parameters_full()
        result[f"{name}.params_equal"] = all(torch.equal(loaded[k], saved[k]) for k in loaded)
        result[name] = [t.train_step().loss for _ in range(RESHARD_STEPS - 2)]
    return result


# Expert-parallel checkpoints load under plans without expert parallelism (same micro-batches,
# so the per-micro-batch routing and load-balancing loss are the same computation).
MOE_SAVE_PLAN = make_plan(dp=2, m=2, ep=2, zero=1)
MOE_LOAD_PLANS = {"moe-dp2-ep1-replicate": make_plan(dp=2, m=2), "moe-tp2": make_plan(tp=2, m=4)}


def _moe_reshard(rank: int, ckpt: str) -> dict:
    return _reshard(rank, ckpt, MOE_SAVE_PLAN, MOE_LOAD_PLANS, "moe-tiny")


# --------------------------- the uninterrupted twin of the CLI's killed run (2 ranks)
CLI_MODEL = "gpt-tiny"
CLI_PLAN = make_plan(pp=2, bounds=((0, 2), (2, 4)), m=2, schedule="gpipe")
"""Pipeline over the 2 ranks: the tied embedding and head live on different ranks."""
CLI_STEPS = 12
CLI_LR = 3e-3


def _cli_twin(rank: int, out: str) -> dict:
    """What `autoplan run` with CLI_* and default options computes, never interrupted
    (test_runtime_checkpoint compares a killed-and-resumed CLI run with it)."""
    from autoplan.runtime.trainer import Trainer, TrainOptions

    t = Trainer(CLI_PLAN, CLI_MODEL, TrainOptions(steps=CLI_STEPS, lr=CLI_LR), log=None)
    return {"losses": [t.train_step().loss for _ in range(CLI_STEPS)]}


# ------------------------ what autograd keeps per rank under tensor / sequence parallelism
SAVED_MODELS = ("gpt-tiny", "llama-tiny")
SAVED_BATCH = 2


def _saved_activations(rank: int) -> dict:
    """Bytes per sample autograd keeps for one block of each SAVED_MODELS on this rank, the
    block tensor-parallel over the 2 ranks without and with sequence parallelism (the
    runtime's own styles, fp32 on CPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.models.presets import get_config
    from autoplan.profiler.timing import SavedBytes
    from autoplan.runtime.build import apply_tensor_parallel, materialize_units

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    class Kept(SavedBytes):
        """SavedBytes over the local shards of DTensors."""
        def pack(self, t):
            super().pack(local(t))
            return t

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name in SAVED_MODELS:
        cfg = get_config(name)
        for sp in (False, True):
            block = materialize_units(cfg, [1], seed=SEED)[1]
            apply_tensor_parallel(block, mesh, sp)
            x = torch.randn(SAVED_BATCH, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(SEED))
            if sp:
                x = x.chunk(world, dim=1)[rank]
            kept = Kept([local(q) for q in block.parameters()])
            with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
                y = block(x.requires_grad_(True))
            out[(name, sp)] = kept.total / SAVED_BATCH
            out[("sent", name, sp)] = tuple(local(y).shape)   # what a pipeline stage would send
    return out


SCENARIOS = {2: ("reshard", "cli-twin", "moe-reshard", "saved-activations")}


def _worker(rank: int, world: int, port: int, cases: dict, scenarios: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    jobs = [(n, lambda c=c: _equivalence(rank, c[0], Plan.from_dict(c[1]), *c[2:])) for n, c in cases.items()]
    jobs += [("reshard", lambda: _reshard(rank, str(Path(out) / "ckpt"))), ("cli-twin", lambda: _cli_twin(rank, out)),
             ("moe-reshard", lambda: _moe_reshard(rank, str(Path(out) / "moe-ckpt"))),
             ("saved-activations", lambda: _saved_activations(rank))]
    for name, job in jobs:
        if name not in cases and name not in scenarios:
            continue
        try:
            result = job()
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, Path(out) / f"{name}.rank{rank}.pt")
        if "error" in result:
            break   # the group may be out of step now; the remaining jobs are reported missing
    dist.barrier()
    dist.destroy_process_group()


def run_group(cases: dict, world: int, scenarios: tuple = ()) -> dict[str, list[dict]]:
    """Run equivalence ``cases`` and named ``scenarios`` on ``world`` gloo ranks;
    {name: [per-rank result]}. Judged by the result files: a rank that aborts in teardown
    after writing them (a rare gloo issue) does not fail the test; a group that produced
    nothing is retried once."""
    payload = {n: (c[0], c[1].to_dict(), *c[2:]) for n, c in cases.items()}
    names = list(cases) + list(scenarios)
    for attempt in range(2):
        out = Path(tempfile.mkdtemp(prefix="autoplan-rt-"))
        try:
            mp.spawn(_worker, args=(world, _free_port(), payload, tuple(scenarios), str(out)), nprocs=world)
        except Exception:
            if attempt == 0 and not all((out / f"{n}.rank{r}.pt").is_file() for n in names for r in range(world)):
                continue
        break
    return {n: [torch.load(out / f"{n}.rank{r}.pt", weights_only=False)
                if (out / f"{n}.rank{r}.pt").is_file() else {"error": "no result (the process died)"}
                for r in range(world)] for n in names}


_GROUPS: dict = {}
ALL_CASES = {2: CASES_2, 4: CASES_4, 8: CASES_8}


def group(world: int) -> dict[str, list[dict]]:
    """The results of every job of one world size; the group runs once per session."""
    if world not in _GROUPS:
        _GROUPS[world] = run_group(ALL_CASES[world], world, SCENARIOS.get(world, ()))
    return _GROUPS[world]


_REFERENCE: dict = {}


def reference(model: str, global_batch: int, micro_batch: int) -> dict:
    """Single process, same weights and data: grads of step 1 and the losses / grad norms
    of STEPS steps of the same SGD with clipping. The global batch is run as micro-batches
    of ``micro_batch`` samples with accumulated gradients (for dense models this equals
    one pass over the whole batch; MoE expert-choice routing picks tokens per batch, so
    there it is the micro-batch that defines the computation)."""
    key = (model, global_batch, micro_batch)
    if key in _REFERENCE:
        return _REFERENCE[key]
    from autoplan.models.zoo import loss_fn
    from autoplan.runtime.build import StageModule, materialize_units, meta_model, tied_embedding_fqns
    from autoplan.runtime.data import synthetic_batch
    from autoplan.runtime.experts import configure_load_balancing, start_step, step_value

    cfg = get_config(model)
    n = len(meta_model(cfg).layers)
    units = materialize_units(cfg, range(n), SEED)
    net = StageModule(units)
    tied = tied_embedding_fqns(cfg, n)
    if tied:   # a genuinely shared parameter, as in the zoo's own model
        units[n - 1].output.weight = units[0].tok_embeddings.weight
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms, grads, balance_values = [], [], {}, []
    chunks = global_batch // micro_batch
    # MoE: each micro-batch's load-balancing loss enters like its share of the mean loss.
    balance = configure_load_balancing(units.values(), "micro", None, grad_scale=1.0 / chunks)
    for i in range(STEPS):
        x, y = synthetic_batch(cfg, global_batch, i, SEED)
        opt.zero_grad()
        start_step(balance)
        total = 0.0
        for xm, ym in zip(x.split(micro_batch), y.split(micro_batch)):
            loss = loss_fn(net(xm), ym) / chunks
            loss.backward()
            total += float(loss.detach())
        if i == 0:
            grads = {name: p.grad.clone() for name, p in net.named_parameters(remove_duplicate=False)}
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_GRAD_NORM)))
        opt.step()
        losses.append(total)
        value, layers = step_value(balance)
        balance_values.append(value / layers if layers else None)
    _REFERENCE[key] = {"losses": losses, "grad_norms": norms, "grads": grads, "load_balancing": balance_values}
    return _REFERENCE[key]


def check_case(name: str, model: str, plan: Plan, per_rank: list[dict], options: dict | None = None) -> None:
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, f"{name}: {errors[0]}"
    # The global-batch load-balancing loss is the one a single process computes when the
    # whole global batch is one micro-batch (dropless routing makes nothing else differ).
    whole = (options or {}).get("load_balancing") == "global"
    ref = reference(model, plan.global_batch, plan.global_batch if whole else plan.micro_batch)
    got: dict[str, torch.Tensor] = {}
    for r in per_rank:
        got.update(r["grads"])
    assert set(got) == set(ref["grads"]), f"{name}: parameters differ: {set(got) ^ set(ref['grads'])}"
    for pname, g in ref["grads"].items():
        torch.testing.assert_close(got[pname], g, atol=GRAD_ATOL, rtol=1e-4, msg=lambda m: f"{name} {pname}: {m}")
    for r in per_rank:   # every rank reports the same global loss
        assert r["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL), name
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), name
        if ref["load_balancing"][0] is None:
            assert r["load_balancing"] == [None] * STEPS
        else:
            assert r["load_balancing"] == pytest.approx(ref["load_balancing"], rel=1e-6), name
        if plan.ep > 1 and r["local_experts"]:   # every rank holding MoE layers holds 1/ep of their experts
            experts = get_config(model).num_experts
            fsdp = plan.dp // plan.ep if plan.zero >= 1 else 1   # ZeRO shards them further
            assert {s[0] for s in r["local_experts"].values()} == {experts // plan.ep // fsdp}
    assert plan.ep == 1 or any(r["local_experts"] for r in per_rank)


def _check(cases: dict, world: int, name: str) -> None:
    model, plan, *options = cases[name]
    check_case(name, model, plan, group(world)[name], *options)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_2), ids=list(CASES_2))
def test_two_ranks_match_single_process(name):
    _check(CASES_2, 2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4), ids=list(CASES_4))
def test_four_ranks_match_single_process(name):
    _check(CASES_4, 4, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_8), ids=list(CASES_8))
def test_eight_ranks_match_single_process(name):
    _check(CASES_8, 8, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SAVED_MODELS)
def test_a_tensor_parallel_stage_sends_what_the_stack_says(name):
    """torch.distributed.pipelining sends each rank's local stage output. Without sequence
    parallelism a tensor-parallel block's output is whole on every rank (stack autoplan's
    pipeline_send 'whole'); with it, each rank holds (and sends) its sequence shard."""
    from autoplan.stacks import get_stack

    per_rank = group(2)["saved-activations"]
    cfg = get_config(name)
    whole = (SAVED_BATCH, cfg.seq_len, cfg.hidden)
    for r in per_rank:
        assert r[("sent", name, False)] == whole
        assert r[("sent", name, True)] == (SAVED_BATCH, cfg.seq_len // 2, cfg.hidden)
    assert get_stack("autoplan").pipeline_send_shape(2, False) == (False, False)
    assert get_stack("autoplan").pipeline_send_shape(2, True) == (True, False)


STATE_CASES = ("dp-ddp", "zero1", "zero2", "zero3", "olmo2-zero1")


@pytest.mark.slow
@pytest.mark.parametrize("name", STATE_CASES, ids=STATE_CASES)
def test_zero_stages_keep_what_the_memory_model_says(name):
    """After a step every rank holds its weights, optimizer states and the step's reduced
    gradients: the weights and optimizer states as the memory model counts them on stack
    autoplan (FSDP2 keeps only a shard of the fp32 weights from ZeRO-1 on:
    ``weights_sharded_from_zero``), and the gradients reduced to a shard at every FSDP
    stage (ZeRO-1 holds them whole only while they accumulate) or whole under DDP. fp32 on
    CPU: the weights and gradients take 4 bytes a parameter, SGD's momentum 4."""
    from autoplan.models.extract import spec_from_config
    from autoplan.stacks import get_stack
    from costmodel.memory import model_state_bytes

    model, plan, *_ = CASES_2[name]
    stack = get_stack("autoplan")
    sgd = dataclasses.replace(stack, weights_bytes_per_param=4, gradient_bytes_per_param=4,
                              master_weights_bytes_per_param=0, optimizer_bytes_per_param=4)
    layers = spec_from_config(get_config(model), dtype="fp32").layers
    dp = plan.groups[0].dp
    held = model_state_bytes(layers, 1, dp, plan.zero, sgd)
    params = model_state_bytes(layers, 1, 1, 0, sgd).optimizer / 4
    gathered = 2 * max(model_state_bytes([l], 1, 1, 0, sgd).optimizer / 4 for l in layers) * \
        sgd.gathered_weights_bytes_per_param if plan.zero >= 3 else 0.0
    grads = 4 * params / (dp if plan.zero >= 1 else 1)
    expected = held.weights - gathered + held.optimizer + grads
    for r in group(2)[name]:
        assert "error" not in r, r
        assert r["model_state_bytes"] == pytest.approx(expected, rel=1e-9)
    if plan.zero >= 1:
        # The point of sharding from ZeRO-1: a quarter of what DDP keeps (16 bytes a
        # parameter on one rank against 8 on each of two).
        assert held.weights - gathered == 4 * params / dp


@pytest.mark.slow
def test_global_load_balancing_is_the_whole_batch_loss_and_micro_is_not():
    """Qiu et al. 2025: with f over the global batch the loss is the single-process loss of the
    whole batch; per micro-batch it is the mean of the micro-batches' own losses, which is
    larger (each micro-batch is less balanced than the whole) and pushes the router harder."""
    _, plan, _ = CASES_2["lbl-global"]
    results = group(2)
    micro, glob = results["lbl-micro"][0]["load_balancing"], results["lbl-global"][0]["load_balancing"]
    whole = reference("moe-tiny", plan.global_batch, plan.global_batch)["load_balancing"]
    per_micro = reference("moe-tiny", plan.global_batch, plan.micro_batch)["load_balancing"]
    assert glob == pytest.approx(whole, rel=1e-6)
    assert micro == pytest.approx(per_micro, rel=1e-6)
    assert all(m > w + 1e-3 for m, w in zip(micro, whole))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_LOAD_PLANS), ids=list(MOE_LOAD_PLANS))
def test_expert_parallel_checkpoint_loads_under_another_plan(name):
    _check_resumed(group(2)["moe-reshard"], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOAD_PLANS), ids=list(LOAD_PLANS))
def test_checkpoint_loads_under_another_plan(name):
    _check_resumed(group(2)["reshard"], name)


def _check_resumed(per_rank: list[dict], name: str) -> None:
    """Every rank resumed plan ``name`` at step 2 with the saved weights and then trained
    as the uninterrupted run did."""
    for r in per_rank:
        assert "error" not in r, r.get("error")
        assert r[f"{name}.resumed_at"] == 2
        assert r[f"{name}.params_equal"], "weights after loading differ from the saved ones"
        # Other reductions (fewer/more ranks) round differently; AdamW with a larger eps
        # keeps that noise from being amplified on near-zero gradients.
        assert r[name] == pytest.approx(r["uninterrupted"][2:], abs=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", SAVED_MODELS, ids=SAVED_MODELS)
def test_sequence_parallel_keeps_what_the_memory_model_says(name):
    """Under sequence parallelism the runtime gathers a block's attention and MLP inputs
    before its column-parallel linears and autograd keeps the gathered tensors: the memory
    model's share kept with SP over without it must match the measured one, which the
    Megatron accounting (only the local shard kept) misses."""
    from autoplan.models.extract import spec_from_config
    from autoplan.models.presets import get_config
    from autoplan.stacks import get_stack
    from costmodel.memory import activation_bytes

    per_rank = group(2)["saved-activations"]
    assert all("error" not in r for r in per_rank), per_rank
    measured = per_rank[0]
    assert per_rank[1] == measured
    block = spec_from_config(get_config(name), dtype="fp32").layers[1]
    stack = dataclasses.replace(get_stack("autoplan"), activation_scale=1.0)
    assert stack.sequence_parallel_keeps_gathered_inputs

    def share(st):
        return (activation_bytes([block], "none", 1, 2, True, st, "fp32")
                / activation_bytes([block], "none", 1, 2, False, st, "fp32"))
    kept = measured[(name, True)] / measured[(name, False)]
    megatron = dataclasses.replace(stack, sequence_parallel_keeps_gathered_inputs=False)
    assert share(stack) == pytest.approx(kept, rel=0.06)
    assert share(megatron) != pytest.approx(kept, rel=0.06)
