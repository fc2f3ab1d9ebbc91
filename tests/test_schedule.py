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


def _zero_bubble_reference(p, m):
    """ZB-H1's list schedule with unit action times, written plainly (actions as dictionary
    keys, every step re-scanning what is done): the oracle for the indexed implementation."""
    from autoplan.schedule import _one_f_one_b
    orders = [[a if a.kind == "F" else Action(a.stage, "I", a.micro_batch) for a in _one_f_one_b(g, p, m)]
              for g in range(p)]
    done, out, t = {}, [[] for _ in range(p)], 0
    pending, alive = [[] for _ in range(p)], [0] * p
    while any(orders[g] or pending[g] for g in range(p)):
        for g in range(p):
            nxt = orders[g][0] if orders[g] else None
            deps = [] if nxt is None else (
                [Action(g - 1, "F", nxt.micro_batch)] if nxt.kind == "F" and g > 0 else
                [] if nxt.kind == "F" else
                [Action(g, "F", nxt.micro_batch)] + ([Action(g + 1, "I", nxt.micro_batch)] if g < p - 1 else []))
            ready = nxt is not None and all(done.get(d, t + 1) <= t for d in deps) \
                and not (nxt.kind == "F" and alive[g] >= p - g)
            if ready:
                act = orders[g].pop(0)
                if act.kind == "F":
                    alive[g] += 1
                else:
                    pending[g].append(act.micro_batch)
            elif pending[g]:
                act = Action(g, "W", pending[g].pop(0))
                alive[g] -= 1
            else:
                continue
            out[g].append(act)
            done[act] = t + 1
        t += 1
    return out


ZB_CASES = [(1, 1), (1, 5), (2, 1), (2, 2), (3, 7), (4, 4), (4, 8), (5, 3), (8, 24), (13, 40), (16, 17)]


@pytest.mark.parametrize("p,m", ZB_CASES, ids=[f"p{p}-m{m}" for p, m in ZB_CASES])
def test_zero_bubble_program_is_the_unit_time_list_schedule(p, m):
    from autoplan.schedule import _one_f_one_b, _zero_bubble
    got = _zero_bubble(p, m)
    assert got == _zero_bubble_reference(p, m)
    for g, actions in enumerate(got):
        # F and I keep 1F1B's order, and no rank holds more than 1F1B's p - g micro-batches.
        one_f_one_b = [(a.kind.replace("B", "I"), a.micro_batch) for a in _one_f_one_b(g, p, m)]
        assert [(a.kind, a.micro_batch) for a in actions if a.kind != "W"] == one_f_one_b
        alive = peak = 0
        for a in actions:
            alive += {"F": 1, "I": 0, "W": -1}[a.kind]
            peak = max(peak, alive)
        assert peak <= p - g
