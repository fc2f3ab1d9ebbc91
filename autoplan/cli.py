"""The ``autoplan`` command line. Each subcommand lives in ``autoplan/commands/<name>.py``
and exposes ``register(subparsers)``; this module only wires them up and turns
autoplan's own errors into one clear line instead of a traceback."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from autoplan.errors import AutoplanError

import autoplan.commands as _commands

# Listed so that --help shows the main flow first; any other module in
# autoplan/commands is added after these.
ORDER = ("search", "estimate", "run", "calibrate", "profile", "bench", "export", "models", "devices", "cluster",
         "stacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan",
        description="Find the best way to split a model over a GPU cluster, predict its step time "
                    "and memory, and run it with PyTorch's distributed stack.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = [m.name for m in pkgutil.iter_modules(_commands.__path__) if not m.name.startswith("_")]
    for name in sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        importlib.import_module(f"autoplan.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except AutoplanError as e:
        print(f"autoplan {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
