"""Schedule programs: complete, dependency-consistent, and exportable for the runtime."""
from __future__ import annotations

import pytest

import autoplan
from autoplan.schedule import Action, build_program
from tests.helpers import ideal_cluster, uniform_model

CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("interleaved-1f1b", 2, 4, 2),
         ("interleaved-1f1b", 4, 8, 3), ("zero-bubble", 4, 8, 1), ("zero-bubble", 2, 1, 1), ("1f1b", 1, 3, 1)]


def _program(schedule, pp, m, v):
    model = uniform_model(24)
    plan = autoplan.Plan.uniform(model, ideal_cluster(pp), tp=1, pp=pp, dp=1, micro_batch=1, global_batch=m,
                                 schedule=schedule, virtual_stages=v)
    return build_program(plan)


@pytest.mark.parametrize("schedule,pp,m,v", CASES, ids=[f"{s}-p{p}-m{m}-v{v}" for s, p, m, v in CASES])
def test_program_is_complete_and_respects_dependencies(schedule, pp, m, v):
    prog = _program(schedule, pp, m, v)
    prog.validate()
    position = {a: (g, i) for g, r in enumerate(prog.ranks) for i, a in enumerate(r)}
    for a, (g, i) in position.items():
        for d in prog.dependencies(a):
            dg, di = position[d]
            if dg == g:
                assert di < i, f"{a} runs before its dependency {d} on the same rank"


def test_1f1b_order_is_megatron_order():
    prog = _program("1f1b", 4, 6, 1)
    assert [str(a) for a in prog.ranks[0]][:5] == ["0F0", "0F1", "0F2", "0F3", "0B0"]
    assert [str(a) for a in prog.ranks[3]][:4] == ["3F0", "3B0", "3F1", "3B1"]


def test_compute_only_export_matches_pipelining_notation():
    prog = _program("zero-bubble", 2, 2, 1)
    rows = prog.to_compute_only()
    assert len(rows) == 2
    assert set(rows[0]) == {"0F0", "0F1", "0I0", "0I1", "0W0", "0W1"}
    assert prog.to_csv().count("\n") == 2


def test_interleaved_needs_micro_batches_multiple_of_pp():
    with pytest.raises(autoplan.ConfigError, match="num_micro_batches"):
        _program("interleaved-1f1b", 4, 6, 2)


def test_action_str():
    assert str(Action(3, "W", 12)) == "3W12"
