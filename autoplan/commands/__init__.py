"""Subcommands of the ``autoplan`` CLI, one module each, each exposing ``register(subparsers)``."""
