"""Refresh the flag part of ``autoplan/data/engines/megatron-lm.json`` from a Megatron-LM checkout.

    PYTHONPATH=/path/to/Megatron-LM python scripts/megatron_flags.py > flags.json

Builds Megatron-LM's own argument parser (``megatron.training.arguments.add_megatron_arguments``)
and prints, for every flag the table lists, what argparse does with it (action, type,
choices, default, destination), as JSON to paste over the table's "flags". The rules part of
the table is written by hand from ``validate_args`` (each rule names its source line).
Megatron-LM imports GPU-only packages (triton) at import time, so run it where they install.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "autoplan" / "data" / "engines" / "megatron-lm.json"


def main() -> None:
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    out = {}
    for flag in json.loads(TABLE.read_text())["flags"]:
        action = by_flag.get(flag)
        if action is None:
            out[flag] = None   # gone from this Megatron-LM: the export must stop using it
            continue
        kind = {"_StoreAction": "store", "_StoreTrueAction": "store_true",
                "_StoreFalseAction": "store_false"}.get(type(action).__name__, type(action).__name__)
        entry = {"dest": action.dest, "action": kind, "default": action.default}
        if kind == "store":
            entry["type"] = getattr(action.type, "__name__", "str") if action.type else "str"
        if action.choices:
            entry["choices"] = [str(c) for c in action.choices]
        out[flag] = entry
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
