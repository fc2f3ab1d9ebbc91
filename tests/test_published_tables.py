"""The published-run tables: every source builds rows whose plans are valid for their model
and cluster, and the report's per-source figures are computed from real estimates (the
figures themselves are the benchmark's business, not asserted here)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from autoplan.stacks import get_stack
from costmodel import estimate
from benchmarks.published import tables as T

SOURCES = {s.name: s for s in T.SOURCES}


@pytest.fixture(scope="module")
def built() -> dict[str, list]:
    return {name: s.build() for name, s in SOURCES.items()}


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_entry_is_a_row_or_says_why_not(name, built):
    entries = built[name]
    assert entries, f"{name} read no rows"
    for e in entries:
        assert isinstance(e, (T.PublishedRow, T.Skipped))
        assert e.source == name
        if isinstance(e, T.Skipped):
            assert len(e.reason) > 10
        else:
            assert e.gpus == e.cluster.num_gpus, e.ref
            assert e.status in ("ok", "OOM", "failed")
            assert e.status != "ok" or e.measured_time_s or e.measured_tflops or e.recompute_bracket, e.ref
            get_stack(e.stack)


# The first checking row of every source that has one (one model spec each keeps this fast),
# and the rows that exercise a degree the first rows do not: (source, index among its rows).
ROWS = {
    **{name: (name, 0) for name in (
        "Megatron-LM 2024 H100", "Llama 3 Table 4", "MegaScale 175B", "torchtitan benchmarks",
        "torchtitan docs/performance", "BLOOM 176B run", "BLOOM topology sweep", "Narayanan 2021 T2",
        "MT-NLG 530B (secondary)", "AMP GPT-2 trials", "llm-foundry MPT", "Megatron-LM Llama3 FP8 example",
        "Megatron-Bridge DGX-H100")},
    "Llama 3 Table 4, context parallelism 16": ("Llama 3 Table 4", 2),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_builders_produce_valid_plans(case, built):
    name, index = ROWS[case]
    row = [e for e in built[name] if isinstance(e, T.PublishedRow)][index]
    model = T.model_for(row, get_stack(row.stack))
    candidates = T.candidate_plans(row, model)
    assert candidates, f"no plan for {row.ref}"
    for choice, plans in candidates:
        for plan in plans:
            plan.validate(model, row.cluster)
            assert (plan.tp, plan.cp, plan.pp, plan.dp) == (row.tp, row.cp, row.pp, row.dp)
            assert plan.cp_comm == row.cp_comm
            assert plan.global_batch == row.global_batch
            assert plan.num_gpus == row.gpus
            if row.micro_batch:
                assert plan.micro_batch == row.micro_batch
            if row.split:
                assert [s.start for s in plan.stages] + [plan.stages[-1].end] == list(row.split)


# The MPT blocks as llm-foundry builds them (biases, learned positions as long as the
# sequence, a tied head): the source's own parameter count of each size, at two lengths.
MPT_PARAMS = [
    ("MPT-125m", 512, 124_131_840), ("MPT-125m", 65536, 174_070_272), ("MPT-1b", 2048, 1_315_950_592),
    ("MPT-7b", 2048, 6_658_859_008), ("MPT-30b", 8192, 30_019_254_272),
]


@pytest.mark.parametrize("model,seq_len,params", MPT_PARAMS)
def test_llm_foundry_models_have_the_sources_parameter_counts(model, seq_len, params, built):
    row = next(e for e in built["llm-foundry MPT"]
               if isinstance(e, T.PublishedRow) and e.model == model and e.seq_len == seq_len)
    assert T.model_for(row, get_stack(row.stack)).num_params == params


def test_llm_foundry_runs_it_cannot_rebuild_are_listed_not_guessed(built):
    skipped = [e for e in built["llm-foundry MPT"] if isinstance(e, T.Skipped)]
    assert skipped and all("network" in e.reason for e in skipped)


SKIPPED_ONLY = ["DeepSpeed Azure ZeRO-3 (low confidence)"]


@pytest.mark.parametrize("name", SKIPPED_ONLY)
def test_unmodellable_sources_are_listed_not_guessed(name, built):
    assert all(isinstance(e, T.Skipped) for e in built[name])


# Megatron-Bridge rows: (a distinctive piece of the reference, stack, or the skip reason's key word).
BRIDGE_ROWS = {
    "fp8-of-26.x-is-current-scaling": ("Llama 3 70B, 64 GPUs, NeMo 26.04.01", "megatron-core-fp8-cs"),
    "fp8-cs-is-current-scaling": ("Llama 3 70B, 64 GPUs, NeMo 25.11", "megatron-core-fp8-cs"),
    "unstated-precision-is-the-launcher-default": ("Llama 3 70B, 64 GPUs, NeMo 25.09", "megatron-core-fp8"),
    "megatron-fsdp-skipped": ("Llama 3 8B, 8 GPUs, NeMo 25.11", "Megatron-FSDP"),
}


@pytest.mark.parametrize("case", list(BRIDGE_ROWS))
def test_megatron_bridge_rows_run_on_their_fp8_recipe(case, built):
    ref, expected = BRIDGE_ROWS[case]
    entry = next(e for e in built["Megatron-Bridge DGX-H100"] if e.ref == ref)
    if isinstance(entry, T.Skipped):
        assert expected in entry.reason
    else:
        assert entry.stack == expected and get_stack(entry.stack).fp8_linears


def test_amp_partition_maps_to_zoo_units():
    # 30 DeepSpeed layer specs (embedding, no-op, 24 blocks, no-op, norm, head, loss) onto
    # 26 zoo units (embedding, 24 blocks, head).
    assert T.amp_split("[0, 30]", 1) == (0, 26)
    assert T.amp_split("[0, 15, 30]", 2) == (0, 14, 26)
    assert T.amp_split("[0, 1, 3, 30]", 3) == (0, 1, 2, 26)
    assert T.amp_split("[0, 1, 2, 30]", 3) is None      # a stage of one no-op spec


# torchtitan rows: (a distinctive piece of the row's reference, stack, bytes per gathered parameter).
TORCHTITAN_RECIPES = {
    "float8-default-is-tensorwise": ("Table 1 (1D FSDP, 8B, 8 GPUs): FSDP + torch.compile + Float8",
                                     "torchtitan-float8", 2.0),
    "rowwise": ("70B on 256 H100 (FSDP 32, TP 8): float8 rowwise, vanilla TP", "torchtitan-float8-rowwise", 2.0),
    "fp8-all-gather": ("H200 results table: 4 nodes", "torchtitan-float8", 1.0),
    "bf16": ("70B on 256 H100 (FSDP 32, TP 8): None (bfloat16), vanilla TP", "torchtitan", 2.0),
}


@pytest.mark.parametrize("case", list(TORCHTITAN_RECIPES))
def test_torchtitan_rows_run_on_their_float8_recipe(case, built):
    ref, stack, gathered = TORCHTITAN_RECIPES[case]
    row = next(e for e in built["torchtitan benchmarks"] if isinstance(e, T.PublishedRow) and e.ref.endswith(ref))
    assert row.stack == stack
    assert dataclasses.replace(get_stack(row.stack), **row.stack_overrides).gathered_weights_bytes_per_param == gathered
    # Async TP is still a reason to skip a row, Float8 no longer is.
    skipped = [e for e in built["torchtitan benchmarks"] if isinstance(e, T.Skipped)]
    assert skipped and all("async TP" in e.reason for e in skipped)


def test_float8_runs_are_paired_with_their_bf16_twin(built):
    # The 70B vanilla-TP runs of one document: bf16 and tensorwise Float8 pair up; the async
    # TP runs are skipped and the 2024 file's Float8 run is another document's.
    refs = [TORCHTITAN_RECIPES[c][0] for c in ("bf16", "rowwise")] + [
        "70B on 256 H100 (FSDP 32, TP 8): float8 tensorwise, vanilla TP", "Table 4 (FSDP 32 x TP 8, 70B, 256 GPUs): 2D"]
    rows = [next(e for e in built["torchtitan benchmarks"] if isinstance(e, T.PublishedRow) and e.ref.endswith(ref))
            for ref in refs]
    pairs = T.evaluate(rows).float8_pairs()
    assert [(row.stack, row.ref.endswith(ref)) for (row, _, _), ref in zip(pairs, refs[1:3])] == [
        ("torchtitan-float8-rowwise", True), ("torchtitan-float8", True)]
    for row, measured, (rich, lean) in pairs:
        twin = rows[0]
        assert measured == pytest.approx(twin.measured_time_s / row.measured_time_s)
        assert rich == lean > 0      # (runs of one recompute mode: one predicted speedup)


def test_megatron_pads_the_vocabulary_per_tensor_parallel_degree():
    assert [get_stack("megatron-deepspeed").padded_vocab(50257, tp) for tp in (1, 2, 4)] == [50304, 50432, 50688]
    assert get_stack("torchtitan").padded_vocab(50257, 4) == 50257     # (pads nothing)


def _pick(built, name, predicate):
    return next(e for e in built[name] if isinstance(e, T.PublishedRow) and predicate(e))


def test_report_figures_are_computed(built):
    rows = [
        _pick(built, "AMP GPT-2 trials", lambda r: r.status == "ok" and r.tp == 1 and r.pp == 1),
        _pick(built, "AMP GPT-2 trials", lambda r: r.status == "failed" and r.tp == 1 and r.pp == 1),
        _pick(built, "BLOOM topology sweep", lambda r: r.measured_peak_GiB is not None and r.pp > 1),
        _pick(built, "BLOOM topology sweep", lambda r: r.status == "OOM"),
        _pick(built, "torchtitan benchmarks", lambda r: r.recompute_bracket and r.measured_peak_GiB is not None),
        *[e for e in built["Megatron-Bridge DGX-H100"] if isinstance(e, T.Skipped)][:2],
    ]
    rep = T.evaluate(rows)
    assert len(rep.results) == 4 and len(rep.brackets) == 1 and len(rep.skipped) == 2

    assert rep.groups("AMP GPT-2 trials") == ["16 x T4"] and rep.groups("torchtitan benchmarks") == ["bf16"]
    amp = rep.stats("AMP GPT-2 trials")
    assert amp.rows == 2 and len(amp.time_errors) == 1 and amp.failed_rows == 1
    assert math.isfinite(amp.time_mape) and amp.time_mape == abs(amp.time_signed)
    assert amp.outcomes == 1                       # 'failed' is not a clean outcome
    bloom = rep.stats("BLOOM topology sweep")
    assert bloom.oom_rows == 1 and bloom.outcomes == 2 and 0 <= bloom.agree <= 2
    assert len(bloom.memory_errors) == 1 and math.isfinite(bloom.memory_mape)
    titan = rep.stats("torchtitan benchmarks")
    assert titan.brackets == 1 and titan.bracket_peak_within[1] == 1 and titan.bracket_time_within[1] == 1
    b = rep.brackets[0]
    assert b.lean.plan.recompute == "full" and b.rich.plan.recompute == "none"
    assert b.peak_bounds[0] < b.peak_bounds[1] and b.time_bounds[0] < b.time_bounds[1]
    assert rep.stats("Megatron-Bridge DGX-H100").skipped == 2

    by_stack = rep.time_errors_by_stack()
    assert set(by_stack) == {"megatron-deepspeed"} and len(by_stack["megatron-deepspeed"]) == 2
    summary = rep.summary_lines()
    assert len([line for line in summary if line.startswith("- AMP GPT-2 trials:")]) == 1
    section = "\n".join(rep.section_lines())
    for r in rows:
        assert r.ref in section
    assert "Bracketed rows" in section and "Not checking rows" in section
    # The AMP trial that ran lands in its layout's cell, with its own error.
    (layout,) = [line for line in section.splitlines() if line.startswith("| 16 x T4 | no | 1 |")]
    assert layout.split("|")[4].strip() == "1" and f"{amp.time_errors[0]:+.1%}" in layout


def test_open_choices_take_the_fastest_fitting_plan(built):
    # An AMP trial with its micro-batch and recompute mode left open, as a source might.
    given = _pick(built, "AMP GPT-2 trials", lambda r: r.status == "ok" and r.tp == 1 and r.pp == 1)
    row = dataclasses.replace(given, micro_batch=None, recompute=None)
    res = T.evaluate_row(row)
    assert set(res.chosen) == {"micro_batch", "recompute"}
    stack = dataclasses.replace(get_stack(row.stack), **row.stack_overrides)   # as evaluate_row runs it
    model = T.model_for(row, stack)
    fitting = []
    for _, plans in T.candidate_plans(row, model):
        assert [p.recompute for p in plans] == list(T.RECOMPUTE_ORDER)
        for plan in plans:
            est = estimate(model, row.cluster, plan, stack=stack)
            if est.fits:
                fitting.append(est.iteration_time_s)
    assert fitting and res.est.fits and res.est.iteration_time_s == pytest.approx(min(fitting))


def test_amp_layer_check_compares_like_with_like():
    checks = T.amp_layer_checks()
    assert {(c.device, c.tp) for c in checks} == {(d, tp) for d in ("T4-16GB", "V100-SXM2-16GB") for tp in (1, 2, 4)}
    for c in checks:
        assert c.layers == 24 and c.measured_ms > 0 and c.predicted_ms > 0
        assert (c.predicted_tp_ms == 0) == (c.tp == 1)
        # The host issues the all-reduces too: the forward is max(host, kernels + all-reduces).
        assert max(c.predicted_compute_ms, c.predicted_tp_ms) <= c.predicted_ms <= \
            c.predicted_compute_ms + c.predicted_tp_ms + 1e-9


@pytest.mark.parametrize("kind", ["homogeneous", "heterogeneous"])
def test_amp_t4_nodes_link_their_gpus_as_the_source_says(kind):
    """Li et al. 2022: "4 T4 GPUs with 50 Gbps PCIe connection intra-node bandwidth, and 50 Gbps
    inter-node bandwidth", both shared by a node's 4 GPUs; the V100 nodes keep NVLink."""
    from autoplan.units import GB, Gbit
    cluster = T.amp_cluster(kind)
    for g in cluster.groups:
        if g.device.name == "T4-16GB":
            assert g.intra_node.bandwidth == pytest.approx(50 * Gbit / 4 / GB * GB)
        else:
            assert g.intra_node.bandwidth > 100 * GB


@pytest.mark.parametrize("blocks,pp,expected", [
    # 63 items (embedding, 60 blocks, norm, head) in runs of 4 then 3: one block beside the head.
    (60, 16, [(0, 4)] + [(a, a + 4) for a in range(4, 60, 4)] + [(60, 62)]),
    # 63 items in 32 + 31: the head's stage gets 29 blocks, Megatron's split would give it 30.
    (60, 2, [(0, 32), (32, 62)]),
    # 43 items in 11, 11, 11, 10: the norm opens no stage of its own.
    (40, 4, [(0, 11), (11, 22), (22, 33), (33, 42)]),
    # 83 items in 3 x 21 + 20: every stage keeps at least one unit.
    (80, 4, [(0, 21), (21, 42), (42, 63), (63, 82)]),
], ids=["60-blocks-16-stages", "60-blocks-2-stages", "40-blocks-4-stages", "80-blocks-4-stages"])
def test_hagemann_runs_use_aa_scaling_s_pipeline_split(blocks, pp, expected):
    from benchmarks.published import validate
    import autoplan
    model = autoplan.models.transformer(layers=blocks, hidden=256, heads=4, seq_len=128, vocab=1000, arch="llama")
    bounds = validate.aa_scaling_split(model, pp)
    assert bounds == expected
    assert bounds[0][0] == 0 and bounds[-1][1] == model.num_layers
    assert all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))


def test_layer_check_isolates_one_block():
    """Korthikanti Table 4's layer: the middle stage holds one block, and the settings
    relate as the stage model says (the full recompute repeats the forward, collectives
    included; sequence parallelism shards the replicated work)."""
    from benchmarks.published import validate
    rows = {r["experiment"]: r for r in validate.korthikanti_layer_rows()}
    assert set(rows) == set(validate.KORTHIKANTI_LAYER_SETTINGS)
    base, sp = rows["Baseline no recompute"], rows["Sequence Parallelism"]
    full, sel = rows["Baseline with recompute"], rows["Selective Recompute"]
    assert full["predicted_forward_ms"] == pytest.approx(base["predicted_forward_ms"])
    assert full["predicted_backward_ms"] == pytest.approx(base["predicted_backward_ms"] + base["predicted_forward_ms"])
    assert base["predicted_backward_ms"] < sel["predicted_backward_ms"] < full["predicted_backward_ms"]
    assert sp["predicted_forward_ms"] < base["predicted_forward_ms"]
    # One block of the 22B model at t = 8, micro-batch 4: milliseconds, not the whole model's seconds.
    assert 1 < base["predicted_forward_ms"] < 50


def test_layer_check_sets_the_step_beyond_its_layers_against_the_model():
    """Table 5's one-node rows of the same model: the step less its layers, measured and
    predicted, for each setting Table 4 also timed (full recompute; selective + SP)."""
    from benchmarks.published import validate
    steps = [(row, validate.estimate_row(row)[0]) for row in validate.korthikanti_rows() if row.gpus == row.tp]
    assert {(r.recompute, r.sequence_parallel) for r, _ in steps} == {("full", False), ("selective", True)}
    _, lines = validate.layer_section(steps)
    assert lines[-1].startswith("Beyond its layers") and lines[-1].count("measured") == 3


@pytest.mark.parametrize("date,gradient_bytes,buffer_MiB,reduce_bytes", [
    # From 02-28: DeepSpeed's BF16 optimizer, the stack as shipped: fp32 buffer + kept bf16
    # gradients, all-reduced in bf16 through a whole-group copy, no ZeRO buckets.
    ("02-28", 6.0, 0, 2.0),
    # Before: DeepSpeed's ZeRO-1 optimizer, 2-byte gradients through its two 5e8-element buckets.
    ("02-27", 2.0, 1907, 2.0),
], ids=["bf16-optimizer", "zero1-optimizer"])
def test_bloom_sweep_rows_keep_their_optimizer_s_gradients(date, gradient_bytes, buffer_MiB, reduce_bytes):
    from autoplan.units import MiB
    row = next(r for r in T.bloom_sweep() if isinstance(r, T.PublishedRow) and r.ref.startswith(date))
    stack = dataclasses.replace(get_stack(row.stack), **row.stack_overrides)
    assert stack.gradient_bytes_per_param + stack.half_gradient_bytes_per_param == gradient_bytes
    assert stack.dp_buffer_bytes == buffer_MiB * MiB
    assert stack.grad_reduce_bytes_per_param == reduce_bytes
    result = T.evaluate_row(row)
    model = T.model_for(row, stack)
    first = result.plan.stages[0]
    params = sum(l.params.at(row.tp) for l in model.layers[first.start:first.end])
    assert result.est.memory_by_group[0].gradients == pytest.approx(params * gradient_bytes, rel=1e-9)


@pytest.mark.parametrize("source,ref_part,fused_norm", [
    # April 2024 docs: the 70B configs ran torchtitan's eager fp32 RMSNorm ...
    ("torchtitan docs/performance", "395a526: Llama 2 70B, AC full", False),
    ("torchtitan docs/performance", "1ea476e: Llama 3 70B, AC full", False),
    # ... the 13B config its Triton kernel ...
    ("torchtitan docs/performance", "395a526: Llama 2 13B, AC none", True),
    # ... and the 405B config compiled, which fuses the eager norm.
    ("torchtitan docs/performance", "3faaa1a: Llama 3.1 405B", True),
    # December 2024 benchmarks: eager without torch.compile, fused with it.
    ("torchtitan benchmarks", "Table 1 (1D FSDP, 8B, 8 GPUs): FSDP$", False),
    ("torchtitan benchmarks", "Table 1 (1D FSDP, 8B, 8 GPUs): FSDP + torch.compile", True),
], ids=["llama2-70b-eager", "llama3-70b-eager", "llama2-13b-triton", "405b-compiled", "8b-eager", "8b-compiled"])
def test_torchtitan_rows_normalize_as_their_config_did(source, ref_part, fused_norm, built):
    exact = ref_part.endswith("$")
    rows = [r for r in built[source] if isinstance(r, T.PublishedRow)
            and (r.ref.endswith(ref_part[:-1]) if exact else ref_part in r.ref)]
    assert rows, ref_part
    for row in rows:
        stack = dataclasses.replace(get_stack(row.stack), **row.stack_overrides)
        assert stack.fused_norm is fused_norm, row.ref
        assert ("eager fp32 RMSNorm" in row.note) is (not fused_norm), row.note
        # The eager norm's fp32 copies are in the model the row is estimated with.
        assert T.model_for(row, stack).config.fused_norm is fused_norm


def test_network_table_marks_the_choice_and_the_tables_that_made_it():
    from benchmarks.published import validate
    rhos = {1: {"a_13B": 0.5, "b_30B": 0.9}, 8: {"a_13B": 0.8, "b_30B": 0.7}}
    lines = validate.network_table_lines(rhos, fitting={"a_13B"}, chosen=8)
    header = next(line for line in lines if line.startswith("| table"))
    assert header.endswith("| 8 adapters (25 GB/s) * |") and "1 adapter (3.125 GB/s) |" in header
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| a_") or line.startswith("| b_")}
    assert rows["a_13B"] == "| a_13B | fit | 0.50 | 0.80 |"
    assert rows["b_30B"] == "| b_30B | check | 0.90 | 0.70 |"


# (row reference, layers, pipeline depth, micro-batches per step, stack, fp32 loss)
DGXC_CASES = {
    "llama-8b-bf16": ("Llama 3.1 8b BF16 (TP=1, PP=1, CP=2, MBS=1, GA=32), 8 GPUs", 32, 1, 32, "megatron-core", False),
    "llama-405b-fp8-proxy": ("Llama 3.1 405b FP8 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63), 96 GPUs", 21, 3, 63,
                             "megatron-core-fp8", False),
    "llama-405b-bf16-full": ("Llama 3.1 405b BF16 (TP=8, PP=9, CP=2, VP=7, MBS=1, GA=63), 576 GPUs", 126, 9, 63,
                             "megatron-core", False),
    # GPT-3's recipe does not fuse the cross entropy: Megatron's own, on an fp32 copy.
    "gpt3-175b-bf16": ("GPT 3 175b BF16, 512 GPUs", 96, 8, 64, "megatron-core", True),
}


@pytest.mark.parametrize("case", list(DGXC_CASES), ids=list(DGXC_CASES))
def test_dgxc_rows_run_as_their_recipes_say(case, built):
    ref, layers, pp, accumulation, stack_name, fp32_loss = DGXC_CASES[case]
    row = next(r for r in built["NVIDIA DGX Cloud benchmarking"] if isinstance(r, T.PublishedRow) and r.ref == ref)
    assert (row.layers, row.pp, row.stack, row.recompute) == (layers, pp, stack_name, "none")
    assert row.global_batch == row.dp * row.micro_batch * accumulation
    stack = dataclasses.replace(get_stack(row.stack), **row.stack_overrides)
    # Apex's distributed Adam with grad_sync_dtype bf16: a bf16 gradient buffer, reduced in bf16.
    assert stack.gradient_bytes_per_param == 2.0 and stack.grad_reduce_bytes_per_param == 2.0
    assert stack.fp32_loss is fp32_loss


# (row reference, micro-batch, recompute, context parallelism, fp32 loss, fitting): None where
# the table leaves it open and the report picks the fastest plan predicted to fit. The
# pretraining table fits the 2024 stack's attention class; the long-sequence table checks it.
NEMO_CASES = {
    "gpt3-5b": ("GPT3-5B, 64 GPUs", 4, "none", 1, True, True),
    "llama3-8b-cp": ("LLAMA3-8B, 8 GPUs", 1, "none", 2, False, True),
    "long-sequence-1m": ("LLAMA2-7B, 1024K, 1024 GPUs", None, None, 32, True, False),
}


@pytest.mark.parametrize("case", list(NEMO_CASES), ids=list(NEMO_CASES))
def test_nemo_rows_keep_what_the_tables_give_and_leave_the_rest_open(case, built):
    ref, micro_batch, recompute, cp, fp32_loss, fitting = NEMO_CASES[case]
    row = next(r for r in built[T.NEMO_2024] if r.ref == ref)
    assert (row.micro_batch, row.recompute, row.cp, row.fitting) == (micro_batch, recompute, cp, fitting)
    assert row.stack == "megatron-core-2024-fp8"
    assert row.tp * row.pp * row.cp * row.dp == row.cluster.num_gpus
    assert dataclasses.replace(get_stack(row.stack), **row.stack_overrides).fp32_loss is fp32_loss


def _non_causal_flops_per_token(r) -> float:
    """6 x (block and LM-head parameters) + 12 l h s: the count the pretraining table's TFLOP/s use."""
    h, ffn, layers = r.hidden, r.ffn_hidden, r.layers
    kv = 2 * h * h * r.kv_heads / r.heads
    mlp = (3 if r.arch == "llama" else 2) * h * ffn
    return 6 * layers * (2 * h * h + kv + mlp) + 12 * layers * h * r.seq_len + 6 * h * r.vocab


def test_nemo_long_sequence_times_use_the_count_the_pretraining_table_shows():
    df = T._read("nemo_2024_h100_performance.csv")
    pretraining = df[df.source_table.str.startswith("Pretraining")]
    long_sequence = df[df.source_table.str.startswith("Long")]
    assert len(pretraining) == 9 and len(long_sequence) == 9
    for r in pretraining.itertuples():
        # The table gives both tokens/s and TFLOP/s: their ratio is the FLOPs it counts per token.
        assert r.tflops_per_gpu * 1e12 / r.tokens_per_s_per_gpu == pytest.approx(_non_causal_flops_per_token(r),
                                                                                  rel=2e-3), r.model
        assert r.iter_time_s_derived == pytest.approx(r.global_batch * r.seq_len / (r.tokens_per_s_per_gpu
                                                                                     * r.num_gpus), rel=1e-4)
    for r in long_sequence.itertuples():
        tokens = r.global_batch * r.seq_len
        assert r.iter_time_s_derived == pytest.approx(
            tokens * _non_causal_flops_per_token(r) / (r.tflops_per_gpu * 1e12 * r.num_gpus), rel=1e-4)


def test_fitting_rows_stay_out_of_the_checking_figures():
    rows = [r for r in T.build([T.NEMO_2024]) if r.ref in ("LLAMA2-7B, 8 GPUs", "LLAMA2-7B, 4K, 4 GPUs")]
    assert [r.fitting for r in rows] == [True, False]
    rep = T.evaluate(rows)
    checking = next(r for r in rep.results if not r.row.fitting)
    assert rep.time_errors_by_stack() == {"megatron-core-2024-fp8": [checking.time_error]}
    assert rep.stats(T.NEMO_2024).rows == 1
    fitting_part = rep.stats(T.NEMO_2024, "pretraining (24.07, fitting)")
    assert fitting_part.rows == 1 and len(fitting_part.time_errors) == 1
    assert "1 more fitted a figure of the stack" in rep.summary_lines()[0]


WHAT_IF_CASES = {
    "text": (["attention=flash2"], {"attention": "flash2"}),
    "boolean": (["fused_norm=false"], {"fused_norm": False}),
    "number": (["zero3_kernels_per_rank=2"], {"zero3_kernels_per_rank": 2}),
    "file-unit": (["nccl_MiB_per_group=128"], {"nccl_bytes_per_group": 128 * 2 ** 20}),
    "several": (["attention=flash3", "fp32_loss=true"], {"attention": "flash3", "fp32_loss": True}),
}


@pytest.mark.parametrize("case", list(WHAT_IF_CASES), ids=list(WHAT_IF_CASES))
def test_what_if_reads_stack_fields(case):
    items, expected = WHAT_IF_CASES[case]
    assert T.parse_what_if(items) == expected


@pytest.mark.parametrize("item", ["bogus=1", "attention", "=flash2"])
def test_what_if_names_the_bad_field(item):
    from autoplan.errors import ConfigError
    with pytest.raises(ConfigError, match="--what-if"):
        T.parse_what_if([item])


# (dated stack, the stack it varies): the 2024 stacks differ from them in the attention class only.
DATED_STACKS = {"bf16": ("megatron-core-2024", "megatron-core"),
                "fp8": ("megatron-core-2024-fp8", "megatron-core-fp8")}


@pytest.mark.parametrize("case", list(DATED_STACKS), ids=list(DATED_STACKS))
def test_2024_stacks_differ_in_attention_only(case):
    dated, current = (get_stack(name) for name in DATED_STACKS[case])
    differ = {f.name for f in dataclasses.fields(dated)
              if getattr(dated, f.name) != getattr(current, f.name)} - {"name", "description", "version", "sources"}
    assert differ == {"attention"}
    assert dated.sources["attention"].startswith("fitted")


def test_2024_attention_class_is_the_one_its_fit_chooses(monkeypatch):
    """The shipped stacks hold what `validate.py --fit` writes (the fit's files are not touched here)."""
    from benchmarks.published import validate
    written = {}
    monkeypatch.setattr(T, "write_fitted", lambda name, values, sources: written.update({name: (values, sources)}))
    chosen = validate.fit_megatron_core_2024_attention()
    assert set(written) == set(validate.MEGATRON_CORE_2024)
    for name, (values, sources) in written.items():
        assert values == {"attention": chosen} == {"attention": get_stack(name).attention}
        assert sources["attention"] == get_stack(name).sources["attention"]
