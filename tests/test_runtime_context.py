"""The runtime's context parallelism, single-process parts: which tokens each rank holds and
which models and exchanges it refuses. (Multi-process equivalence with the single-process
reference: the cp-* cases of test_runtime_parallel.)"""
from __future__ import annotations

import pytest
import torch

from autoplan.errors import ConfigError
from autoplan.models.presets import get_config
from autoplan.runtime.context import check_context_supported, shard_positions

# name -> (seq_len, cp, exchange, causal, positions of each rank)
POSITIONS = {
    "zig-zag-2": (8, 2, "p2p", True, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    "zig-zag-4-all-gather": (16, 4, "all_gather", True,
                             [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
    "a2a-contiguous": (8, 2, "a2a", True, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "bidirectional-contiguous": (8, 2, "p2p", False, [[0, 1, 2, 3], [4, 5, 6, 7]]),
}


@pytest.mark.parametrize("case", POSITIONS, ids=list(POSITIONS))
def test_each_rank_holds_its_share_of_the_sequence(case):
    s, cp, comm, causal, expected = POSITIONS[case]
    got = [shard_positions(s, cp, r, comm, causal).tolist() for r in range(cp)]
    assert got == expected
    assert sorted(sum(got, [])) == list(range(s))


def _causal_work(positions: list[int]) -> int:
    return sum(p + 1 for p in positions)   # keys each query sees under a causal mask


def test_zig_zag_balances_causal_work():
    s, cp = 64, 4
    work = [_causal_work(shard_positions(s, cp, r, "p2p", True).tolist()) for r in range(cp)]
    assert len(set(work)) == 1
    contiguous = [_causal_work(shard_positions(s, cp, r, "a2a", True).tolist()) for r in range(cp)]
    assert max(contiguous) > 3 * min(contiguous)


REFUSED = {
    # name: (model, cp, exchange, seq_len, field, words)
    "ring-with-soft-cap": ("gemma2-tiny", 2, "p2p", 32, "cp_comm", "'a2a'"),
    "ring-with-explicit-attention": ("llama-tiny", 2, "all_gather", 32, "cp_comm", "attention='math'"),
    "sequence-not-in-2cp-chunks": ("llama-tiny", 4, "p2p", 36, "groups[0].cp", "divisible by 8"),
    "vision-model": ("swin-tiny-test", 2, "p2p", 0, "groups[0].cp", "transformer language model"),
}


@pytest.mark.parametrize("name", REFUSED, ids=list(REFUSED))
def test_what_the_runtime_cannot_split_is_refused(name):
    model, cp, comm, seq, field, words = REFUSED[name]
    overrides = {"attention": "math"} if "explicit" in name else {}
    cfg = get_config(model, **overrides)
    with pytest.raises(ConfigError) as e:
        check_context_supported(cfg, cp, comm, seq or 1)
    assert e.value.field == field and words in str(e.value) and e.value.fix


def test_cp_one_needs_nothing():
    check_context_supported(get_config("gemma2-tiny"), 1, "p2p", 7)
    assert torch.equal(shard_positions(8, 1, 0, "p2p", True), torch.arange(8))
