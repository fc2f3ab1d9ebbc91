"""The training stack is an input: shipped stacks load and are documented, memory follows
each stack's precision and loss, and bad stack input is one clear error."""
from __future__ import annotations

import dataclasses
import json

import pytest

import autoplan
from autoplan.catalog import get_device
from autoplan.errors import ConfigError
from autoplan.stacks import _FILE_KEYS, STACK_DIR, TARGET_STACKS, Stack, get_stack, stack_names
from costmodel import EstimateOptions
from costmodel.compute import roofline_parts
from costmodel.efficiency import default_efficiency
from costmodel.uncertainty import error_bands
from costmodel.memory import loss_logits, model_state_bytes
from tests.helpers import uniform_model

ISSUE_STACKS = ("autoplan", "megatron-core", "megatron-lm-2021", "megatron-deepspeed", "deepspeed", "torchtitan")


def test_every_named_stack_ships():
    assert set(ISSUE_STACKS) <= set(stack_names())
    assert set(TARGET_STACKS.values()) <= set(stack_names())


@pytest.mark.parametrize("name", stack_names())
def test_stack_file_is_valid_and_sourced(name):
    stack = get_stack(name)
    assert stack.name == name
    assert json.loads((STACK_DIR / f"{name}.json").read_text())["name"] == name
    # Every figure that differs from the dataclass default says where it comes from.
    defaults = Stack(name="x", description="x", version="x")
    for f in dataclasses.fields(Stack):
        if f.name in ("name", "description", "version", "sources"):
            continue
        if getattr(stack, f.name) != getattr(defaults, f.name):
            assert _FILE_KEYS.get(f.name, f.name) in stack.sources, f"{name}.{f.name} has no source"
    assert Stack.from_dict(stack.to_dict(), where=name) == stack


@pytest.mark.parametrize("value,message", [
    ("megatron", "not a known training stack"),
    ("no-such-stack", "known: "),
    (3, "must be a stack name"),
], ids=["partial-name", "unknown", "not-a-string"])
def test_unknown_stack_is_one_line_error(value, message):
    with pytest.raises(ConfigError, match=message) as e:
        get_stack(value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,field", [
    ({"attention": "flash9"}, "attention"),
    ({"gradient_bytes_per_param": -2}, "gradient_bytes_per_param"),
    ({"allocator_fragmentation": 1.5}, "allocator_fragmentation"),
    ({"cuda_context_GiB": "lots"}, "cuda_context_GiB"),
    ({"grads_in_bf16": True}, "grads_in_bf16"),
    ({"schema_version": 99}, "schema_version"),
    ({"sharded_grad_collective": "broadcast"}, "sharded_grad_collective"),
    ({"fp8_cast_bytes_per_weight": 8.0}, "fp8_cast_bytes_per_weight"),
    ({"activation_traffic_scale": 0}, "activation_traffic_scale"),
    ({"vocab_multiple": 0}, "vocab_multiple"),
    ({"vocab_multiple": 12.5}, "vocab_multiple"),
    ({"weights_sharded_from_zero": 4}, "weights_sharded_from_zero"),
    ({"pipeline_max_zero": 0}, "pipeline_max_zero"),
    ({"pipeline_send": "broadcast"}, "pipeline_send"),
    ({"zero3_gather_unit": "tensor"}, "zero3_gather_unit"),
    ({"overlap_zero3": "sometimes"}, "overlap_zero3"),
    ({"zero3_kernels_per_rank": -1}, "zero3_kernels_per_rank"),
    ({"zero3_kernels_per_rank": 0.5}, "zero3_kernels_per_rank"),
    ({"zero3_host_us_per_rank": -2.0}, "zero3_host_us_per_rank"),
], ids=["kernel", "negative", "fragmentation", "type", "unknown-field", "version", "collective",
        "fp8-casts-without-fp8", "no-traffic", "vocab-multiple-zero", "vocab-multiple-fraction",
        "no-such-zero-stage", "zero-stage-zero", "pipeline-send", "zero3-gather-unit", "overlap-zero3-type",
        "zero3-kernels-negative", "zero3-kernels-fraction", "zero3-host-negative"])
def test_bad_stack_file_names_the_field(tmp_path, edit, field):
    data = get_stack("megatron-core").to_dict() | edit
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=field):
        get_stack(str(path))


@pytest.mark.parametrize("edit,message", [
    ({"base": "mine"}, "base: names the stack itself"),
    ({"base": "megatron"}, "base: 'megatron' is not a known training stack"),
], ids=["itself", "unknown"])
def test_bad_base_names_the_field(tmp_path, edit, message):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "description": "x", "version": "x"} | edit))
    with pytest.raises(ConfigError, match=message) as e:
        get_stack(str(path))
    assert "\n" not in str(e.value)


def test_a_variant_stack_takes_its_base_and_replaces_what_it_sets(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"schema_version": 2, "name": "mine", "base": "megatron-core", "description": "x",
                                "version": "x", "cuda_context_GiB": 2.0, "gradient_bytes_per_param": 2,
                                "sources": {"gradient_bytes_per_param": "my recipe"}}))
    mine, base = get_stack(str(path)), get_stack("megatron-core")
    assert dataclasses.replace(mine, name=base.name, description=base.description, version=base.version,
                               cuda_context_bytes=base.cuda_context_bytes, gradient_bytes_per_param=4.0,
                               sources=base.sources) == base
    assert (mine.cuda_context_bytes, mine.gradient_bytes_per_param) == (2 * 2 ** 30, 2.0)
    assert mine.sources["gradient_bytes_per_param"] == "my recipe"
    # A figure set without a source of its own does not keep the base's source for it.
    assert "cuda_context_GiB" not in mine.sources and "attention" in mine.sources


def test_stack_from_a_path(tmp_path):
    data = get_stack("megatron-core").to_dict() | {"name": "mine", "cuda_context_GiB": 2.0}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert get_stack(str(path)).cuda_context_bytes == 2 * 2 ** 30


# ----------------------------------------------------------------- model states
@pytest.mark.parametrize("stack", ["megatron-core", "deepspeed", "torchtitan", "aa-scaling"])
@pytest.mark.parametrize("zero,dp", [(0, 4), (1, 4), (2, 8), (3, 8)], ids=str)
def test_zero_model_state_bytes_follow_the_stack(stack, zero, dp):
    s = get_stack(stack)
    layers = list(uniform_model(4, params=1e9).layers)
    got = model_state_bytes(layers, tp=1, dp=dp, zero=zero, stack=s)
    P = 4e9
    # ZeRO-3's working set: two gathered units' weights and one unit's whole gradient.
    gathered = 1e9 * s.gathered_weights_bytes_per_param if zero >= 3 else 0.0
    assert got.weights == pytest.approx(s.weights_bytes_per_param * P / (dp if zero >= s.weights_sharded_from_zero else 1)
                                        + 2 * gathered)
    assert got.gradients == pytest.approx(s.gradient_bytes_per_param * P / (dp if zero >= 2 else 1) + gathered)
    assert got.optimizer == pytest.approx((s.master_weights_bytes_per_param + s.optimizer_bytes_per_param) * P
                                          / (dp if zero >= 1 else 1))


# name: (zero, pp) -> (stage run, weights sharded, gradients sharded, reduced every micro-batch,
# gathered per unit) on autoplan's runtime, 8 data-parallel ranks
AUTOPLAN_ZERO = {
    "zero0": ((0, 1), (0, False, False, False, False)),
    "zero1": ((1, 1), (1, True, False, False, False)),
    "zero2": ((2, 1), (2, True, True, True, False)),
    "zero3": ((3, 1), (3, True, True, True, True)),
    "zero1-pipelined": ((1, 2), (1, True, False, False, False)),
    "zero2-pipelined-runs-as-zero1": ((2, 2), (1, True, False, False, False)),
    "zero3-pipelined-runs-as-zero1": ((3, 4), (1, True, False, False, False)),
}


@pytest.mark.parametrize("name", list(AUTOPLAN_ZERO), ids=list(AUTOPLAN_ZERO))
def test_autoplan_stack_shards_as_its_runtime_does(name):
    """The autoplan stack's sharding fields say what autoplan.data_parallel makes the runtime
    do (the wrapper, when FSDP reshards and reduces), and the memory model counts that."""
    from autoplan.data_parallel import data_parallel_choice

    (zero, pp), (runs, weights, grads, every, per_unit) = AUTOPLAN_ZERO[name]
    s, dp = get_stack("autoplan"), 8
    choice = data_parallel_choice(dp, zero, pp)
    realized = s.realized_zero(zero, pp)
    assert realized == runs
    # FSDP2 (fully_shard) keeps only a shard of the parameters it wraps, at every stage.
    assert (choice.wrapper == "fully_shard") == weights == (realized >= s.weights_sharded_from_zero)
    assert choice.reduce_every_micro_batch == every == (realized >= s.reduce_every_micro_batch_from_zero)
    assert choice.reshard_after_forward == per_unit
    layers = list(uniform_model(4, params=1e9).layers)
    got = model_state_bytes(layers, tp=1, dp=dp, zero=realized, stack=s)
    P = 4e9
    assert got.weights - (2 * 1e9 * s.gathered_weights_bytes_per_param if per_unit else 0.0) == \
        pytest.approx(4 * P / (dp if weights else 1))
    assert got.gradients - (1e9 * s.gathered_weights_bytes_per_param if per_unit else 0.0) == \
        pytest.approx(4 * P / (dp if grads else 1))
    assert (got.casts > 0) == (not per_unit)   # the bf16 compute copy, whole below ZeRO-3


# name: (stack, zero, pp) -> the stage the estimate runs the plan at
REALIZED = {
    "autoplan-pipelined-zero3": ("autoplan", 3, 2, 1),
    "autoplan-pipelined-zero2": ("autoplan", 2, 2, 1),
    "autoplan-zero3-one-stage": ("autoplan", 3, 1, 3),
    "torchtitan-pipelined-zero3": ("torchtitan", 3, 2, 1),
    "torchtitan-zero3-one-stage": ("torchtitan", 3, 1, 3),
    "megatron-core-pipelined-zero3": ("megatron-core", 3, 2, 3),
}


@pytest.mark.parametrize("name", list(REALIZED), ids=list(REALIZED))
def test_estimate_runs_a_plan_at_the_stage_its_stack_realizes(name):
    """A plan whose ZeRO stage the stack runs as a lower one is estimated (memory and time)
    as that one, and the estimate's inputs say so."""
    stack, zero, pp, runs = REALIZED[name]
    model = autoplan.models.get("gpt2-medium")
    cluster = autoplan.Cluster.homogeneous("A100-80GB", 1, 8)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=pp, dp=8 // pp, micro_batch=1, global_batch=32,
                                 zero=zero)
    est = autoplan.estimate(model, cluster, plan, stack=stack)
    same = autoplan.estimate(model, cluster, dataclasses.replace(plan, zero=runs), stack=stack)
    assert est.memory_by_rank == same.memory_by_rank
    assert est.iteration_time_s == same.iteration_time_s
    assert ("zero" in est.inputs) == (runs != zero)
    if runs != zero:
        assert f"ZeRO-{zero} runs as ZeRO-{runs}" in est.inputs["zero"]


# name: (stack, dp, zero, pp, tp) -> whether the half-precision compute copy covers the
# embedding tables too (FSDP's mixed precision) or only the matmuls' weights (autocast)
CAST_ALL = {
    "autoplan-one-replica-autocasts": ("autoplan", 1, 1, 1, 1, False),
    "autoplan-ddp-autocasts": ("autoplan", 4, 0, 1, 1, False),
    "autoplan-replicate-with-tp": ("autoplan", 4, 0, 1, 2, True),
    "autoplan-fsdp-zero1": ("autoplan", 4, 1, 1, 1, True),
    "autoplan-fsdp-pipelined": ("autoplan", 4, 3, 2, 1, True),
    "torchtitan-replicate-autocasts": ("torchtitan", 4, 0, 2, 1, False),
    "torchtitan-fsdp": ("torchtitan", 4, 1, 2, 1, True),
    "megatron-core-bf16-weights": ("megatron-core", 4, 1, 1, 1, False),
}


@pytest.mark.parametrize("name", list(CAST_ALL), ids=list(CAST_ALL))
def test_the_compute_copy_covers_the_embedding_under_fsdp(name):
    stack, dp, zero, pp, tp, every = CAST_ALL[name]
    s = get_stack(stack)
    assert s.casts_all_weights(dp, zero, pp, tp) == every
    model = autoplan.models.transformer(layers=2, hidden=256, heads=4, seq_len=128, vocab=32000)
    embedding = next(l for l in model.layers if l.kind == "embedding")
    realized = s.realized_zero(zero, pp)
    whole = model_state_bytes(model.layers, tp, dp, realized, s, cast_all=every)
    matmuls = model_state_bytes(model.layers, tp, dp, realized, s)
    table = embedding.params.at(tp) * s.weight_cast_bytes_per_param if every and realized < 3 else 0.0
    assert whole.casts - matmuls.casts == pytest.approx(table)


def test_published_per_parameter_figures():
    # ZeRO (Rajbhandari et al. 2020, Fig. 1): 16 bytes per parameter for bf16 mixed precision
    # with Adam; Megatron-LM's distributed optimizer: 6 + 12/d with fp32 gradients.
    assert get_stack("deepspeed").state_bytes_per_param(1, 0) == 16
    assert get_stack("megatron-core").state_bytes_per_param(8, 1) == pytest.approx(6 + 12 / 8)
    # DeepSpeed's BF16 optimizer: the fp32 accumulation buffer and the bf16 gradients kept
    # beside it, 4 bytes per parameter more than fp16 ZeRO-1's 2 (BigScience's chronicles).
    assert get_stack("megatron-deepspeed").state_bytes_per_param(8, 1) == pytest.approx(2 + 6 + 12 / 8)


def test_autocast_copies_count_for_fp32_weight_stacks():
    layers = list(uniform_model(4, params=1e9).layers)
    with_cast = model_state_bytes(layers, 1, 1, 0, get_stack("autoplan"))
    plain = model_state_bytes(layers, 1, 1, 0, dataclasses.replace(get_stack("autoplan"),
                                                                   weight_cast_bytes_per_param=0))
    assert with_cast.casts - plain.casts == pytest.approx(2 * 4e9)
    assert with_cast.weights == plain.weights   # the casts live with the forward/backward, not the states


# -------------------------------------------------------------------- the loss
@pytest.mark.parametrize("stack,tp,expected_share", [
    ("megatron-core", 4, 1 / 4),        # vocabulary-parallel: each rank its shard
    ("autoplan", 4, 1.0),               # gathered logits: the full vocabulary everywhere
], ids=["vocab-parallel", "gathered"])
def test_loss_runs_over_the_stack_s_logits(stack, tp, expected_share):
    model = autoplan.models.get("gpt-tiny")
    head = model.layers[-1]
    full = head.output_bytes / 2
    assert loss_logits(head, tp, "bf16", get_stack(stack)) == pytest.approx(full * expected_share)


def test_loss_bytes_land_on_the_last_stage_only():
    # (As the stack builds it: megatron-core pads the 50,257-token vocabulary to 50,304.)
    model = autoplan.models.for_stack("gpt2-small", "megatron-core", seq_len=1024)
    cluster = autoplan.Cluster.homogeneous("A100-80GB", 1, 2)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=2, dp=1, micro_batch=4, global_batch=16)
    lean = dataclasses.replace(get_stack("megatron-core"), loss_saved_bytes_per_logit=0, loss_peak_bytes_per_logit=0)
    heavy = dataclasses.replace(lean, loss_saved_bytes_per_logit=4, loss_peak_bytes_per_logit=20)
    a = autoplan.estimate(model, cluster, plan, stack=lean)
    b = autoplan.estimate(model, cluster, plan, stack=heavy)
    logits = 4 * model.layers[-1].output_bytes / 2
    assert b.memory_by_group[0].total == pytest.approx(a.memory_by_group[0].total)
    last_a, last_b = a.memory_by_group[1], b.memory_by_group[1]
    assert last_b.activations - last_a.activations == pytest.approx(4 * logits)
    assert last_b.transient >= 16 * logits - 1


# -------------------------------------------------------------- estimate options
def test_stack_decides_overlap_unless_overridden():
    assert EstimateOptions(stack="megatron-lm-2021").overlap_grad_reduce is False
    assert EstimateOptions(stack="megatron-core").overlap_grad_reduce is True
    assert EstimateOptions(stack="megatron-core", overlap_grad_reduce=False).overlap_grad_reduce is False


@pytest.mark.parametrize("collective,zero,kind", [
    ("reduce_scatter", 0, "all_reduce"),
    ("reduce_scatter", 1, "reduce_scatter"),
    ("all_reduce", 1, "all_reduce"),
    ("all_reduce", 2, "all_reduce"),
    ("all_reduce", 3, "reduce_scatter"),
], ids=["no-zero", "zero1-scatter", "zero1-all-reduce", "zero2-all-reduce", "zero3-always-scatter"])
def test_gradient_collective_follows_the_stack(collective, zero, kind):
    stack = dataclasses.replace(get_stack("megatron-core"), sharded_grad_collective=collective)
    assert stack.grad_reduce_kind(zero) == kind


def test_all_reducing_zero1_stack_pays_twice_the_gradient_traffic():
    """AA-Scaling all-reduces whole gradients under ZeRO-1 and keeps its shard: its data-parallel
    reduction moves twice a reduce-scatter's bytes, in the estimate and in the search's figures."""
    from costmodel.comm import collective_latency
    from costmodel.estimate import stage_costs
    from search.evaluate import Setting, Skeleton, analyze
    from search.tables import Kind, Tables
    model = uniform_model(4, params=5e8)
    cluster = autoplan.Cluster.homogeneous("A100-80GB", 2, 8, inter_node_GBps=25)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=16, micro_batch=1, global_batch=16, zero=1)
    scatter = dataclasses.replace(get_stack("megatron-core"), overlap_grad_reduce=False)
    reduce = {}
    for collective in ("reduce_scatter", "all_reduce"):
        options = EstimateOptions(stack=dataclasses.replace(scatter, sharded_grad_collective=collective))
        reduce[collective] = stage_costs(model, cluster, plan, options)[0].grad_reduce
        # The search prices the same stage the same way.
        sk = Skeleton(groups=plan.groups, kinds=(Kind(0, 1, 1, plan.cp_comm, 1),))
        st = Setting(1, plan.num_micro_batches, plan.schedule, 1, 1, False)
        _, figs = analyze(Tables(model, cluster, options=options), sk, st, [(0, model.num_layers)], ["none"])
        assert figs[0].grad_reduce == pytest.approx(reduce[collective], rel=1e-9)
    # Twice the bytes; the latencies are those of NCCL's algorithm for each.
    group = plan.groups[0].dp_groups()[0]
    moved = {k: t - collective_latency(cluster, group, k) for k, t in reduce.items()}
    assert moved["all_reduce"] == pytest.approx(2 * moved["reduce_scatter"], rel=1e-6)



@pytest.mark.parametrize("zero,field,copy_bytes", [
    (3, "zero3_copy_bytes_per_param", 14.0),
    (3, "zero3_stream_copy_bytes_per_param", 14.0),
    (1, "zero3_copy_bytes_per_param", 14.0),
], ids=["zero3-compute-stream", "zero3-beside-collectives", "zero1-gathers-nothing"])
def test_zero3_copies_follow_their_stream(zero, field, copy_bytes):
    """ZeRO-3's copies (Stack.zero3_copy_bytes_per_param) lengthen the backward by the stage's
    parameters times those bytes at HBM speed where they run on the compute stream; beside the
    collectives (zero3_stream_copy_bytes_per_param) they hide behind compute as the collectives
    do. The estimate and the search's figures agree; without ZeRO-3 there are none."""
    from costmodel.estimate import stage_costs
    from search.evaluate import Setting, Skeleton, analyze
    from search.tables import Kind, Tables
    model = uniform_model(4, flops=1e13, params=5e8)
    cluster = autoplan.Cluster.homogeneous("A100-80GB", 1, 8)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=8, micro_batch=1, global_batch=8, zero=zero)
    base = dataclasses.replace(get_stack("torchtitan"), zero3_copy_bytes_per_param=0.0,
                               zero3_stream_copy_bytes_per_param=0.0)
    backward = {}
    for bytes_ in (0.0, copy_bytes):
        options = EstimateOptions(stack=dataclasses.replace(base, **{field: bytes_}))
        backward[bytes_] = stage_costs(model, cluster, plan, options)[0].backward
        sk = Skeleton(groups=plan.groups, kinds=(Kind(0, 1, 1, plan.cp_comm, 1),))
        st = Setting(1, plan.num_micro_batches, plan.schedule, 1, zero, False)
        _, figs = analyze(Tables(model, cluster, options=options), sk, st, [(0, model.num_layers)], ["none"])
        assert figs[0].backward == pytest.approx(backward[bytes_], rel=1e-9)
    device = cluster.groups[0].device
    on_compute = zero >= 3 and field == "zero3_copy_bytes_per_param"
    expected = model.num_params * copy_bytes / (device.memory_bandwidth * default_efficiency(device.name).memory) \
        if on_compute else 0.0
    # (This model's compute covers its collectives and the copies beside them.)
    assert backward[copy_bytes] - backward[0.0] == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("host_us,host_bound", [(0.0, False), (0.001, False), (5000.0, True)],
                         ids=["no-host-cost", "host-keeps-ahead", "host-bound"])
def test_forward_waits_on_a_slow_host(host_us, host_bound):
    """A forward whose kernels the GPU finishes sooner than the stack's model code issues them
    takes the host's time; the backward (autograd's C++ loop) does not; the search's stage
    figures follow the estimate's."""
    from costmodel.compute import layer_timing
    from costmodel.estimate import stage_costs
    from search.evaluate import Setting, Skeleton, analyze
    from search.tables import Kind, Tables
    model = autoplan.models.transformer(layers=2, hidden=256, heads=4, seq_len=128, vocab=1000)
    cluster = autoplan.Cluster.homogeneous("V100-16GB", 1, 1)
    block = model.layers[1]
    device = cluster.slots[0].device
    gpu = layer_timing(device, block, 1, 1, False, "fp16")
    timed = layer_timing(device, block, 1, 1, False, "fp16", forward_host_s_per_kernel=host_us * 1e-6)
    host = block.kernels_fwd * host_us * 1e-6
    assert timed.forward == pytest.approx(max(gpu.forward, host))
    assert (timed.forward > gpu.forward) == host_bound
    assert (timed.backward, timed.backward_input) == (gpu.backward, gpu.backward_input)
    stack = dataclasses.replace(get_stack("megatron-deepspeed"), forward_host_s_per_kernel=host_us * 1e-6)
    options = EstimateOptions(stack=stack)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp16")
    costs = stage_costs(model, cluster, plan, options)[0]
    sk = Skeleton(groups=plan.groups, kinds=(Kind(0, 1, 1, plan.cp_comm, 1),))
    st = Setting(1, plan.num_micro_batches, plan.schedule, 1, 0, False)
    _, figs = analyze(Tables(model, cluster, dtype="fp16", options=options), sk, st, [(0, model.num_layers)], ["none"])
    assert figs[0].forward == pytest.approx(costs.forward, rel=1e-12)


# name: (host microseconds per forward kernel, what the forward's all-reduces add beyond the wait)
HOST_AND_ALL_REDUCES = {
    "device-bound-all-reduces-add": (0.0, "all"),
    "host-wait-hides-part-of-them": (16.0, "part"),
    "host-wait-hides-them-all": (5000.0, "none"),
}


@pytest.mark.parametrize("name", list(HOST_AND_ALL_REDUCES), ids=list(HOST_AND_ALL_REDUCES))
def test_forward_all_reduces_fill_the_wait_on_the_host(name):
    """The host issues a layer's tensor-parallel all-reduces as it issues its kernels and goes
    on while they run: a forward waiting on the host takes max(host, kernels + all-reduces).
    The backward's all-reduces add in full; the search's figures follow the estimate's."""
    from costmodel.comm import collective_time
    from costmodel.compute import layer_timing
    from costmodel.estimate import stage_costs
    from search.evaluate import Setting, Skeleton, analyze
    from search.tables import Kind, Tables
    host_us, adds = HOST_AND_ALL_REDUCES[name]
    model = autoplan.models.transformer(layers=2, hidden=256, heads=4, seq_len=128, vocab=1000)
    cluster = autoplan.Cluster.homogeneous("T4", 1, 2, intra_node_GBps=1.5)
    device = cluster.slots[0].device
    stack = dataclasses.replace(get_stack("megatron-deepspeed"), forward_host_s_per_kernel=host_us * 1e-6)
    plan = autoplan.Plan.uniform(model, cluster, tp=2, pp=1, dp=1, micro_batch=1, global_batch=1, dtype="fp16")
    costs = stage_costs(model, cluster, plan, EstimateOptions(stack=stack))[0]
    bare = stage_costs(model, cluster, plan, EstimateOptions(stack=dataclasses.replace(
        stack, forward_host_s_per_kernel=0.0)))[0]
    block = model.layers[1]
    device_fwd = layer_timing(device, block, 1, 2, False, "fp16").forward
    comm = block.tp_allreduces_fwd * collective_time(cluster, [0, 1], block.output_bytes, "all_reduce")
    host = block.kernels_fwd * host_us * 1e-6
    assert (host <= device_fwd, device_fwd < host < device_fwd + comm, host >= device_fwd + comm) == (
        adds == "all", adds == "part", adds == "none")
    # What the forward's all-reduces add beyond the layers' own max(host, kernels).
    layers_alone = sum(max(l.kernels_fwd * host_us * 1e-6, layer_timing(device, l, 1, 2, False, "fp16").forward)
                       for l in model.layers)
    added = costs.forward - layers_alone
    assert costs.tp_comm_forward == pytest.approx(added, rel=1e-9, abs=1e-15)
    if adds == "all":
        assert added == pytest.approx(bare.tp_comm_forward, rel=1e-9)
    elif adds == "part":
        assert 0 < added < bare.tp_comm_forward
    else:
        assert added == pytest.approx(0.0, abs=1e-15)
    assert costs.backward == pytest.approx(bare.backward, rel=1e-12)
    sk = Skeleton(groups=plan.groups, kinds=(Kind(0, 2, 1, plan.cp_comm, 1),))
    st = Setting(1, plan.num_micro_batches, plan.schedule, 1, 0, False)
    _, figs = analyze(Tables(model, cluster, dtype="fp16", options=EstimateOptions(stack=stack)), sk, st,
                      [(0, model.num_layers)], ["none"])
    assert figs[0].forward == pytest.approx(costs.forward, rel=1e-12)
    assert figs[0].backward == pytest.approx(costs.backward, rel=1e-12)


@pytest.mark.parametrize("margin", [-0.1, 0.6, True], ids=["negative", "too-big", "bool"])
def test_memory_margin_is_validated(margin):
    with pytest.raises(ConfigError, match="memory_margin"):
        EstimateOptions(memory_margin=margin)


def test_plans_within_the_margin_are_tight_not_fits():
    model = autoplan.models.get("gpt2-small", seq_len=1024)
    cluster = autoplan.Cluster.homogeneous("V100-16GB", 1, 1)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=1, micro_batch=8, global_batch=8,
                                 recompute="selective")
    est = autoplan.estimate(model, cluster, plan)
    cap = cluster.groups[0].device.memory_bytes
    share = 1 - est.peak_memory_bytes / cap
    assert est.fits and not est.tight and 0.05 < share < 0.45
    tight = autoplan.estimate(model, cluster, plan, memory_margin=share + 0.01)
    assert tight.fits and tight.tight and tight.status == "tight"
    assert tight.headroom_bytes == pytest.approx(cap - est.peak_memory_bytes)


def test_estimate_names_its_inputs_and_interval():
    model = autoplan.models.get("gpt-tiny")
    cluster = autoplan.Cluster.homogeneous("H100", 1, 8)
    plan = autoplan.Plan.uniform(model, cluster, tp=2, pp=1, dp=4, micro_batch=2, global_batch=16)
    est = autoplan.estimate(model, cluster, plan, stack="torchtitan")
    assert est.stack == "torchtitan"
    assert est.inputs["stack"].startswith("torchtitan")
    assert est.inputs["H100-SXM5-80GB"].startswith("roofline")
    # The interval is where the truth lay for 80% of the stack's checking rows; where the model
    # was biased on them (torchtitan: every row measured slower), it need not contain the point.
    time_band, memory_band = error_bands("torchtitan")
    assert time_band.rows > 0 and time_band.low < time_band.high
    assert est.time_interval_s == pytest.approx(time_band.interval(est.iteration_time_s))
    assert est.memory_interval_bytes == pytest.approx(memory_band.interval(est.peak_memory_bytes))
    d = est.to_dict()
    assert d["stack"] == "torchtitan" and d["status"] in ("fits", "tight") and len(d["iteration_time_interval_s"]) == 2


def test_stack_kernels_change_what_the_model_saves():
    model = autoplan.models.get("gpt2-small", seq_len=1024)
    math = autoplan.models.for_stack(model, "megatron-lm-2021")
    flash = autoplan.models.for_stack(model, "megatron-core")
    assert math.config.attention == "math" and flash.config.attention == "flash"
    block = 1
    assert math.layers[block].activation_bytes["none"].total > 1.5 * flash.layers[block].activation_bytes["none"].total


@pytest.mark.parametrize("mlp,saved_less", [("swiglu", True), ("geglu", True), ("gelu", False)])
def test_fused_gated_activation_saves_one_ffn_wide_tensor_less(mlp, saved_less):
    # Megatron-Core's SwiGLU fusion saves only the up and gate projections; the eager
    # up * act(gate) also keeps act(gate): one bf16 tensor of ffn width per token.
    hidden, ffn, seq = 256, 704, 128

    def block(fused):
        model = autoplan.models.transformer(layers=1, hidden=hidden, heads=2, ffn_hidden=ffn, seq_len=seq, vocab=1000,
                                            arch="llama", mlp=mlp, fused_swiglu=fused)
        return model.layers[1]
    eager, fused = block(False), block(True)
    saved = eager.activation_bytes["none"].at(1, False) - fused.activation_bytes["none"].at(1, False)
    assert saved == (2 * ffn * seq if saved_less else 0)
    assert (fused.kernels_fwd < eager.kernels_fwd) == saved_less
    assert fused.gemms_fwd == eager.gemms_fwd and fused.params == eager.params


@pytest.mark.parametrize("device", ["A100-80GB", "H100"])
def test_first_generation_flash_attention_runs_at_half_the_speed(device):
    # Same layers, same memory: only the fused attention's time doubles (Dao 2023: FlashAttention-2
    # is about twice as fast as FlashAttention).
    model = autoplan.models.transformer(layers=1, hidden=512, heads=4, seq_len=4096, vocab=1000)
    dev = get_device(device)
    eff = default_efficiency(dev.name)
    parts = {k: roofline_parts(dev, eff, model.layers[1], 2, 1, False, "bf16", k) for k in ("flash1", "flash2")}
    assert parts["flash1"]["attention"] == pytest.approx(2 * parts["flash2"]["attention"], rel=1e-12)
    assert parts["flash1"]["gemm"] == parts["flash2"]["gemm"] and parts["flash1"]["attention"] > 0
    stack = dataclasses.replace(get_stack("torchtitan"), attention="flash1")
    assert stack.model_kernels() == get_stack("torchtitan").model_kernels()   # (saves what flash2 saves)


# A Llama-3-8B block and a small one, on one H100 rank: (hidden, ffn, micro-batch, seq).
FP8_BLOCKS = {"llama3-8b-block": (4096, 14336, 2, 8192), "small-block": (256, 1024, 1, 128)}


def _fp8_parts(shape, stack_name):
    hidden, ffn, b, seq = shape
    model = autoplan.models.transformer(layers=1, hidden=hidden, heads=hidden // 128, kv_heads=max(1, hidden // 512),
                                        ffn_hidden=ffn, seq_len=seq, vocab=32000, arch="llama")
    dev = get_device("H100")
    eff = default_efficiency(dev.name)
    return {kind: roofline_parts(dev, eff, layer, b, 1, False, "bf16", "flash2", get_stack(stack_name).fp8_cast)
            for kind, layer in (("block", model.layers[1]), ("head", model.layers[-1]))}


@pytest.mark.parametrize("block,faster", [("llama3-8b-block", True), ("small-block", False)])
def test_fp8_linears_trade_gemm_time_for_casts(block, faster):
    # A large block's GEMMs run up to twice as fast in fp8 and the casts cost less than that
    # saves; on a small block the casts cost more (torchao's own roofline makes the same
    # call). Attention and the LM head stay as they were.
    bf16, fp8 = _fp8_parts(FP8_BLOCKS[block], "torchtitan"), _fp8_parts(FP8_BLOCKS[block], "torchtitan-float8")
    h100 = get_device("H100")
    fastest = bf16["block"]["gemm"] * h100.peak("bf16") / h100.peak("fp8")   # (the fp8 peak is twice bf16's)
    assert fastest * (1 - 1e-9) <= fp8["block"]["gemm"] < bf16["block"]["gemm"]
    assert fp8["block"]["bandwidth"] > bf16["block"]["bandwidth"]
    assert fp8["block"]["attention"] == bf16["block"]["attention"]
    assert fp8["head"] == bf16["head"]
    assert (sum(fp8["block"].values()) < sum(bf16["block"].values())) == faster


def test_rowwise_scaling_casts_cost_more_than_tensorwise():
    shape = FP8_BLOCKS["llama3-8b-block"]
    tensorwise, rowwise = _fp8_parts(shape, "torchtitan-float8"), _fp8_parts(shape, "torchtitan-float8-rowwise")
    assert rowwise["block"]["gemm"] == tensorwise["block"]["gemm"]
    assert rowwise["block"]["bandwidth"] > tensorwise["block"]["bandwidth"]


# Transformer Engine's extra bytes per element over a bf16 run, by a linear's role (TE 2.8 on
# Hopper, no sequence parallelism): the input of a norm-fused linear (QKV, FC1), of a plain one
# (proj, FC2), and every output gradient. (delayed scaling, current scaling)
TE_CAST_BYTES = {"norm_input": (1, 4), "plain_input": (4, 6), "output_gradient": (4, 6)}


@pytest.mark.parametrize("stack,recipe", [("megatron-core-fp8", 0), ("megatron-core-fp8-cs", 1)])
def test_te_cast_bytes_are_the_per_linear_figures_averaged_over_a_llama_block(stack, recipe):
    # The stack's one figure per element is TE's per-role bytes summed over a Llama-3-70B block
    # (one fused FC1 in TE) over the elements autoplan's GEMM list counts (gate and up apart).
    h, ffn, kv = 8192, 28672, 1024
    te = (TE_CAST_BYTES["norm_input"][recipe] * 2 * h + TE_CAST_BYTES["plain_input"][recipe] * (h + ffn)
          + TE_CAST_BYTES["output_gradient"][recipe] * ((h + 2 * kv) + h + 2 * ffn + h))
    model = autoplan.models.transformer(layers=1, hidden=h, heads=64, kv_heads=8, ffn_hidden=ffn, seq_len=128,
                                        vocab=1000, arch="llama", **get_stack(stack).model_kernels())
    counted = sum(g.k + g.n for g in model.layers[1].gemms_fwd)   # (inputs and outputs per token)
    assert get_stack(stack).fp8_cast_bytes_per_activation == pytest.approx(te / counted, abs=0.005)


class _MeasuredEverything:
    """A profile store that has measured every layer (in the plan's dtype)."""

    def layer_timing(self, device, layer, micro_batch, tp, sequence_parallel, dtype):
        from costmodel.compute import LayerTiming
        return LayerTiming(1.0, 2.0, 1.0, 1.0, 0.0, source="measured")

    def efficiency(self, device):
        return None


@pytest.mark.parametrize("unit,fp8,source", [
    ("block", False, "measured"), ("block", True, "roofline"), ("head", True, "measured"),
], ids=["bf16-block", "fp8-block", "fp8-stack-head"])
def test_profiles_measured_in_bf16_do_not_time_fp8_blocks(unit, fp8, source):
    from costmodel.compute import layer_timing
    model = autoplan.models.transformer(layers=1, hidden=256, heads=2, seq_len=128, vocab=1000)
    layer = model.layers[1] if unit == "block" else model.layers[-1]
    cast = get_stack("torchtitan-float8" if fp8 else "torchtitan").fp8_cast
    t = layer_timing(get_device("H100"), layer, 1, 1, False, "bf16", _MeasuredEverything(), fp8_cast=cast)
    assert t.source == source


def test_fp8_stack_plans_and_estimates_faster_than_bf16():
    model = autoplan.models.transformer(layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq_len=4096,
                                        vocab=32000, arch="llama")
    cluster = autoplan.Cluster.homogeneous("H100", 1, 8)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=8, micro_batch=1, global_batch=16, zero=3)
    times = {s: autoplan.estimate(model, cluster, plan, stack=s) for s in ("torchtitan", "torchtitan-float8")}
    assert times["torchtitan-float8"].iteration_time_s < times["torchtitan"].iteration_time_s
    # fp8 compute leaves the memory as it was (Float8Linear saves its bf16 input).
    assert times["torchtitan-float8"].peak_memory_bytes == times["torchtitan"].peak_memory_bytes
    found = autoplan.search(model, cluster, 16, stack="torchtitan-float8", progress=False)
    assert found.best.estimate.iteration_time_s <= times["torchtitan-float8"].iteration_time_s * (1 + 1e-9)


def test_dropout_masks_are_measured():
    base = dict(layers=2, hidden=256, heads=4, seq_len=256, vocab=1000, attention="math")
    plain = autoplan.models.transformer(**base)
    dropped = autoplan.models.transformer(**base, dropout=0.1)
    b = 256 * 256
    extra = dropped.layers[1].activation_bytes["none"].total - plain.layers[1].activation_bytes["none"].total
    # Korthikanti et al. 2022: two hidden masks (1 byte each) per token and hidden unit, plus the
    # attention-probability mask and its dropped probabilities (1 + 2 bytes per score).
    assert extra == pytest.approx(2 * b + 3 * 4 * 256 * 256, rel=0.01)
    with pytest.raises(ConfigError, match="dropout"):
        autoplan.models.transformer(**base, dropout=1.0)


# (stack, the vocabulary it builds for GPT-2's 50,257 tokens)
VOCAB_PADDING = {"megatron-core": 50304, "megatron-lm-2021": 50304, "megatron-deepspeed": 50304,
                 "megatron-core-fp8": 50304, "torchtitan": 50257, "deepspeed": 50257, "autoplan": 50257}


@pytest.mark.parametrize("stack", list(VOCAB_PADDING), ids=list(VOCAB_PADDING))
def test_megatron_stacks_pad_the_vocabulary(stack):
    model = autoplan.models.for_stack("gpt2-small", stack, seq_len=256)
    assert model.config.vocab == VOCAB_PADDING[stack]
    head = model.layers[-1].gemms_fwd[0]
    assert head.n == VOCAB_PADDING[stack]


def test_a_padded_head_is_faster_on_h100_only_where_unaligned_is_measured():
    # Megatron pads GPT-2's vocabulary, so its head runs on the aligned kernels; unpadded
    # (torchtitan), the head's GEMMs take the fallback kernels on H100, not on A100 (not measured).
    times = {}
    for device in ("H100", "A100-80GB"):
        cluster = autoplan.Cluster.homogeneous(device, 1, 1)
        for stack in ("megatron-core", "torchtitan"):
            model = autoplan.models.for_stack("gpt2-medium", stack, seq_len=1024)
            dev = cluster.slots[0].device
            times[device, stack] = roofline_parts(dev, default_efficiency(dev.name), model.layers[-1], 4, 1, False,
                                                  "bf16")["gemm"]
    assert times["H100", "torchtitan"] > 3 * times["H100", "megatron-core"]
    assert times["A100-80GB", "torchtitan"] == pytest.approx(times["A100-80GB", "megatron-core"], rel=0.01)


def _h100_profile():
    """benchmarks/gpu_step_profile.py and the rows of its committed H100 profile."""
    import csv
    import sys
    from pathlib import Path
    root = Path(__file__).parent.parent
    if str(root / "benchmarks") not in sys.path:
        sys.path.insert(0, str(root / "benchmarks"))
    import gpu_step_profile
    with open(root / "benchmarks/results/gpu/h100/step_profile.csv") as f:
        return gpu_step_profile, list(csv.DictReader(f))


def test_autoplan_traffic_scale_is_the_h100_fit():
    """autoplan.json's activation_traffic_scale is what benchmarks/gpu_step_profile.py's fit
    gives on the committed Llama-3.2-1B profile (its fitting model), and the weight traffic the
    stack derives from autocast's code is within a quarter of that profile's intercept."""
    gpu_step_profile, rows = _h100_profile()
    fit = gpu_step_profile.traffic_fit(rows, get_device("H100"))[gpu_step_profile.FIT_MODEL]
    stack = get_stack("autoplan")
    assert fit["activation_traffic_scale"] == pytest.approx(stack.activation_traffic_scale, abs=0.02)
    derived = stack.weight_cast_traffic_bytes_per_param + stack.weight_grad_traffic_bytes_per_param
    assert fit["weight_bytes_per_param_per_micro_batch"] == pytest.approx(derived, rel=0.25)


# (stack, layer kind, the bandwidth-bound seconds exceed the zoo's)
TRAFFIC_CASES = {
    "autoplan-block": ("autoplan", 1, True),
    "autoplan-embedding-lookup-reads-uncast": ("autoplan", 0, True),
    "megatron-core-block": ("megatron-core", 1, False),
    "torchtitan-head": ("torchtitan", -1, False),
    # DeepSpeed's BF16 optimizer passes over the gradients on every micro-batch.
    "megatron-deepspeed-block": ("megatron-deepspeed", 1, True),
}


@pytest.mark.parametrize("case", list(TRAFFIC_CASES), ids=list(TRAFFIC_CASES))
def test_stack_traffic_adds_to_the_zoo_bytes(case):
    stack_name, index, more = TRAFFIC_CASES[case]
    stack = get_stack(stack_name)
    layer = autoplan.models.transformer(layers=1, hidden=1024, heads=8, seq_len=1024, vocab=32000).layers[index]
    dev = get_device("H100")
    eff = default_efficiency(dev.name)
    zoo = roofline_parts(dev, eff, layer, 2, 1, False, "bf16")["bandwidth"]
    own = roofline_parts(dev, eff, layer, 2, 1, False, "bf16", traffic=stack.traffic)["bandwidth"]
    if not more:
        assert stack.traffic is None and own == zoo
    else:
        scale, fwd, bwd = stack.traffic
        weights = 0.0 if layer.kind == "embedding" else (fwd + bwd) * layer.params_at(1)
        bw = dev.memory_bandwidth * eff.memory
        assert own == pytest.approx(zoo * scale + weights / bw, rel=1e-9)


@pytest.mark.parametrize("stack,early", [("autoplan", True), ("megatron-core", False), ("torchtitan", False)],
                         ids=["autoplan-stops-early", "megatron-reruns-the-forward", "torchtitan-turns-it-off"])
def test_full_recompute_reruns_what_the_stack_s_checkpoint_reruns(stack, early):
    from costmodel.compute import layer_timing
    model = autoplan.models.for_stack("gpt2-medium", stack, seq_len=1024)
    cluster = autoplan.Cluster.homogeneous("H100", 1, 1)
    plans = {mode: autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=1, micro_batch=4, global_batch=8,
                                         recompute=mode) for mode in ("none", "full")}
    est = {mode: autoplan.estimate(model, cluster, plan, stack=stack) for mode, plan in plans.items()}
    extra = est["full"].breakdown["compute"] - est["none"].breakdown["compute"]
    forward = sum(layer_timing(get_device("H100"), l, 4, 1, False, "bf16", None, get_stack(stack).attention,
                               traffic=get_stack(stack).traffic).forward for l in model.layers) * 2
    if early:
        assert 0.3 * forward < extra < 0.9 * forward
    else:
        assert extra == pytest.approx(forward, rel=1e-6)


def test_the_committed_h100_profile_holds_the_gpu_work_within_a_fifth():
    """benchmarks/gpu_step_profile.py --check on the committed H100 profile: every plan's
    predicted step is within 20% of its measured GPU busy time (the wall time of small
    models' steps is the host's, which the model does not claim)."""
    gpu_step_profile, rows = _h100_profile()
    results = gpu_step_profile.check(rows)
    assert len(results) == 13
    assert all(abs(c["busy_error"]) < 0.20 for c in results), results


# (device, stack, vocabulary, head size, what the estimate's inputs say of alignment; None:
# nothing). autoplan's runtime keeps the vocabulary as given; Megatron-LM pads it to 128 x tp
# and keeps explicit attention, whose batched products read rows of the head size.
ALIGNMENT_NOTE_CASES = {
    "unpadded-vocab-on-h100": ("H100", "autoplan", 50257, 64, "the head's GEMMs read rows of 50257 elements"
                               ", not 16-byte aligned (a multiple of 8 would be): charged at 0.18"),
    "unpadded-vocab-on-a100": ("A100-80GB", "autoplan", 50257, 64, "charged as aligned, optimistic"),
    "megatron-pads-the-vocab": ("H100", "megatron-lm-2021", 50257, 64, None),
    "odd-head-size-on-h100": ("H100", "megatron-lm-2021", 50257, 150, "the block's GEMMs read rows of 150 elements"),
    "cpu-processes": ("CPU", "autoplan", 50257, 64, None),
}


@pytest.mark.parametrize("case", list(ALIGNMENT_NOTE_CASES), ids=list(ALIGNMENT_NOTE_CASES))
def test_estimate_says_where_gemm_rows_are_unaligned(case):
    device, stack, vocab, head, says = ALIGNMENT_NOTE_CASES[case]
    model = autoplan.models.transformer(layers=2, hidden=head * 4, heads=4, seq_len=256, vocab=vocab)
    cluster = autoplan.Cluster.homogeneous(device, 1, 2)
    plan = autoplan.Plan.uniform(model, cluster, tp=1, pp=1, dp=2, micro_batch=2, global_batch=4)
    note = autoplan.estimate(model, cluster, plan, stack=stack).inputs.get("alignment")
    if says is None:
        assert note is None
    else:
        assert says in note and ";" not in note   # (the inputs print as one '; '-separated line)


# (stack, its loss runs on an fp32 copy of the logits)
LOSS_PRECISION_CASES = {
    "megatron-core-upcasts": ("megatron-core", True),
    "megatron-deepspeed-upcasts": ("megatron-deepspeed", True),
    "torchtitan-upcasts": ("torchtitan", True),
    "autoplan-runtime-upcasts": ("autoplan", True),
    "aa-scaling-keeps-bf16": ("aa-scaling", False),
    "llm-foundry-fused-kernel": ("llm-foundry", False),
}


@pytest.mark.parametrize("case", list(LOSS_PRECISION_CASES), ids=list(LOSS_PRECISION_CASES))
def test_loss_precision_follows_the_stack_into_the_head_only(case):
    # The loss's passes over an fp32 copy of the logits (the cast, the log-softmax, its
    # backward and the cast back) move more bytes per logit than on bf16 logits; the blocks
    # and everything but the head's bandwidth-bound traffic stay as they are.
    stack_name, upcasts = LOSS_PRECISION_CASES[case]
    stack = get_stack(stack_name)
    assert stack.fp32_loss is upcasts and stack.model_kernels()["fp32_loss"] is upcasts
    seq, vocab = 256, 4096
    kernels = {k: v for k, v in stack.model_kernels().items() if k != "fp32_loss"}
    specs = {fp32: autoplan.models.transformer(layers=1, hidden=256, heads=4, seq_len=seq, vocab=vocab,
                                               fp32_loss=fp32, **kernels) for fp32 in (False, True)}
    half, full = specs[False].layers, specs[True].layers
    for a, b in zip(half[:-1], full[:-1]):
        assert a == b
    head_half, head_full = half[-1], full[-1]
    assert head_half.gemms_fwd == head_full.gemms_fwd and head_half.activation_bytes == head_full.activation_bytes
    logits = seq * vocab
    extra = (head_full.memory_bytes_fwd.at(1, False) + head_full.memory_bytes_bwd.at(1, False)
             - head_half.memory_bytes_fwd.at(1, False) - head_half.memory_bytes_bwd.at(1, False))
    # An fp32 pass reads or writes 2 bytes more per logit than a bf16 one: the cast, the
    # log-softmax and its backward's several passes, and the cast back come to 16-40 B.
    assert 16 * logits <= extra <= 40 * logits
