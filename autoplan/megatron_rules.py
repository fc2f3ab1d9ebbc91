"""Megatron-LM's flags and ``validate_args`` rules, as a table, and a checker for exports.

Megatron-LM's trainer is not a package one can install to test against, so the flags and the
rules of its ``validate_args`` that autoplan's export relies on are kept as data
(``autoplan/data/engines/megatron-lm.json``, with the commit they were read from and the
source line of every rule). :func:`check_script` parses an exported launch script with an
argparse built from the table's flags (unknown flags, wrong types and bad choices fail as in
Megatron-LM) and evaluates every rule on the result.

A rule is two expressions, ``when`` and ``require``, over the parsed flags (argparse
destinations; unset flags at their defaults), ``world_size``, ``data_parallel_size``,
``virtual_pipeline_model_parallel_size`` (derived as ``validate_args`` does), ``arch`` (the
GPU's compute-capability major) and the functions ``env(NAME)``, ``layout_stages``,
``layout_count``, ``layout_first``, ``layout_last``. Expressions are evaluated by a small
interpreter over Python's syntax tree (names, constants, arithmetic, comparisons, boolean
operators, conditional expressions and calls of those functions only).
"""
from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from autoplan.errors import ConfigError

TABLE_PATH = Path(__file__).parent / "data" / "engines" / "megatron-lm.json"


@cache
def table() -> dict:
    """The flag and rule table (parsed once)."""
    return json.loads(TABLE_PATH.read_text())


@dataclass(frozen=True)
class Broken:
    """A rule an export breaks."""

    rule: str
    """Rule id in the table."""
    message: str
    """What Megatron-LM requires."""
    source: str
    """Where in Megatron-LM the rule is."""


def parse_script(text: str) -> tuple[list[str], dict[str, str | None]]:
    """(argv, env) of an exported launch script: ``export``/``unset`` lines and the words of
    the ``MEGATRON_ARGS=( ... )`` array, as bash would read them."""
    env: dict[str, str | None] = {}
    argv: list[str] = []
    inside = False
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if inside:
            if s == ")":
                inside = False
                continue
            argv += shlex.split(s, comments=True)
        elif s == "MEGATRON_ARGS=(":
            inside = True
        elif s.startswith("export "):
            key, _, value = s[len("export "):].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
        elif s.startswith("unset "):
            env[s[len("unset "):].strip()] = None
        else:
            raise ConfigError("megatron script", f"unexpected line {s!r}")
    if inside:
        raise ConfigError("megatron script", "MEGATRON_ARGS=( is not closed")
    return argv, env


def parser() -> argparse.ArgumentParser:
    """argparse with the table's flags, set up as Megatron-LM sets them up."""
    p = argparse.ArgumentParser(prog="megatron", allow_abbrev=False, exit_on_error=False, add_help=False)
    types = {"int": int, "float": float, "str": str}
    for flag, spec in table()["flags"].items():
        kw: dict = {"dest": spec["dest"], "default": spec["default"]}
        if spec["action"] == "store":
            kw["type"] = types[spec.get("type", "str")]
            if "choices" in spec:
                kw["choices"] = spec["choices"]
            if "nargs" in spec:
                kw["nargs"] = spec["nargs"]
        else:
            kw["action"] = spec["action"]
        p.add_argument(flag, **kw)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags as Megatron-LM's parser reads them; a flag it lacks or a bad value raises."""
    try:
        args, unknown = parser().parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError("megatron flags", str(e)) from None
    if unknown:
        raise ConfigError("megatron flags", f"Megatron-LM has no flag {unknown[0]!r}")
    return args


def broken_rules(argv: list[str], env: dict[str, str | None], world_size: int, arch: int = 9) -> list[Broken]:
    """The table's rules that these flags, environment and world size break (``arch``: the
    GPU's compute-capability major; rules differ from Blackwell, 10, on)."""
    args = parse_args(argv)
    names = dict(vars(args))
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    names.update(world_size=world_size, arch=arch, data_parallel_size=world_size // max(1, tp * pp * cp),
                 virtual_pipeline_model_parallel_size=_vpp(args))
    funcs = {"env": lambda k: env.get(k), "layout_stages": lambda s: len(_layout_stages(s)),
             "layout_count": lambda s, c: "".join(_layout_stages(s)).count(c),
             "layout_first": lambda s: "".join(_layout_stages(s))[:1],
             "layout_last": lambda s: "".join(_layout_stages(s))[-1:]}
    out = []
    for rule in table()["rules"]:
        when = rule.get("when")
        if when and not _eval(when, names, funcs):
            continue
        if not _eval(rule["require"], names, funcs):
            out.append(Broken(rule["id"], rule["message"], rule["source"]))
    return out


def check_script(text: str, world_size: int, arch: int = 9) -> None:
    """Raise a ConfigError naming the first flag or rule of Megatron-LM the script breaks."""
    argv, env = parse_script(text)
    broken = broken_rules(argv, env, world_size, arch)
    if broken:
        b = broken[0]
        raise ConfigError("megatron flags", f"breaks Megatron-LM rule {b.rule!r}: {b.message} ({b.source} "
                          f"@ {table()['commit'][:7]})")


def _vpp(args: argparse.Namespace) -> int | None:
    """Virtual stages per pipeline rank as validate_args derives them (None for one)."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout is not None:
        v = len(_layout_stages(args.pipeline_model_parallel_layout)) // pp
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        v = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None and args.num_layers:
        v = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
    else:
        v = 1
    return v if v and v > 1 else None


def _layout_stages(layout: str) -> list[str]:
    """The stages of a layout string with repetitions unrolled ('(t|)*2' and 't*3')."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


def _eval(expr: str, names: dict, funcs: dict):
    return _node(ast.parse(expr, mode="eval").body, names, funcs)


def _node(n: ast.AST, names: dict, funcs: dict):
    if isinstance(n, ast.Constant):
        return n.value
    if isinstance(n, ast.Name):
        if n.id not in names:
            raise ConfigError("megatron rules", f"rule names {n.id!r}, which is no flag destination")
        return names[n.id]
    if isinstance(n, (ast.Tuple, ast.List)):
        return tuple(_node(e, names, funcs) for e in n.elts)
    if isinstance(n, ast.BoolOp):
        values = (_node(v, names, funcs) for v in n.values)
        return all(values) if isinstance(n.op, ast.And) else any(values)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub)):
        v = _node(n.operand, names, funcs)
        return (not v) if isinstance(n.op, ast.Not) else -v
    if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
        return _BINOPS[type(n.op)](_node(n.left, names, funcs), _node(n.right, names, funcs))
    if isinstance(n, ast.Compare):
        left = _node(n.left, names, funcs)
        for op, right_node in zip(n.ops, n.comparators):
            right = _node(right_node, names, funcs)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(n, ast.IfExp):
        return _node(n.body if _node(n.test, names, funcs) else n.orelse, names, funcs)
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in funcs and not n.keywords:
        return funcs[n.func.id](*(_node(a, names, funcs) for a in n.args))
    raise ConfigError("megatron rules", f"unsupported expression {ast.dump(n)[:60]}")
