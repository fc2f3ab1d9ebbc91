"""One place that reads and validates user-supplied mappings (cluster.json,
plan.json, HF config.json, keyword overrides).

A :class:`FieldReader` walks a dict while remembering the dotted path it is at,
so every error names the exact field (``cluster.json: node_groups[1].gpus_per_node``)
and unknown keys are reported with the closest valid spelling.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from autoplan.errors import ConfigError, closest

_MISSING = object()


class FieldReader:
    """Typed, path-aware access to one mapping of a config file."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, Mapping):
            raise ConfigError(where, f"expected an object with fields, got {type(data).__name__}")
        self.data = data
        self.where = where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is _MISSING:
            raise ConfigError(self.path(key), "is required but missing")
        return default

    def int(self, key: str, default: Any = _MISSING, *, minimum: int | None = None) -> int:
        value = self.raw(key, default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(self.path(key), f"must be an integer, got {value!r}")
        value = int(value)
        if minimum is not None and value < minimum:
            raise ConfigError(self.path(key), f"must be >= {minimum}, got {value}")
        return value

    def float(self, key: str, default: Any = _MISSING, *, positive: bool = False,
              minimum: float | None = None) -> float:
        value = self.raw(key, default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(self.path(key), f"must be a number, got {value!r}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(self.path(key), f"must be finite, got {value!r}")
        if positive and value <= 0:
            raise ConfigError(self.path(key), f"must be > 0, got {value:g}")
        if minimum is not None and value < minimum:
            raise ConfigError(self.path(key), f"must be >= {minimum:g}, got {value:g}")
        return value

    def str(self, key: str, default: Any = _MISSING, *, choices: Iterable[str] | None = None) -> str:
        value = self.raw(key, default)
        if value is None:
            return value
        if not isinstance(value, str):
            raise ConfigError(self.path(key), f"must be a string, got {value!r}")
        if choices is not None:
            choices = list(choices)
            if value not in choices:
                hint = closest(value, choices)
                raise ConfigError(self.path(key), f"{value!r} is not one of {choices}",
                                  hint or None)
        return value

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.path(key), f"must be true or false, got {value!r}")
        return value

    def sub(self, key: str, default: Any = _MISSING) -> "FieldReader | None":
        value = self.raw(key, default)
        if value is None:
            return None
        return FieldReader(value, self.path(key))

    def list(self, key: str, default: Any = _MISSING, *, nonempty: bool = False) -> list:
        value = self.raw(key, default)
        if value is None:
            return value
        if not isinstance(value, list):
            raise ConfigError(self.path(key), f"must be a list, got {type(value).__name__}")
        if nonempty and not value:
            raise ConfigError(self.path(key), "must not be empty")
        return value

    def items(self, key: str, **kw) -> list["FieldReader"]:
        return [FieldReader(v, f"{self.path(key)}[{i}]") for i, v in enumerate(self.list(key, **kw))]

    def reject_unknown(self, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        for key in self.data:
            if key not in allowed and not str(key).startswith("_"):
                hint = closest(str(key), allowed)
                raise ConfigError(self.path(str(key)), "is not a known field",
                                  hint or f"known fields: {', '.join(allowed)}")


def load_json(path: str | Path, what: str = "file", fix: str | None = None) -> Any:
    """Parse a JSON file; a missing or malformed file is a ConfigError naming the path
    (and, for a syntax error, the line and column)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), f"{what} not found") from None
    except IsADirectoryError:
        raise ConfigError(str(path), f"is a directory, expected a JSON {what}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(str(path), f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})", fix) from None


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never
    half of one: a fresh, unpredictably named temporary file in the same directory
    (created exclusively, so a link planted there is never followed), then an atomic
    rename over ``path``."""
    import os
    import tempfile
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
