"""One place that reads and validates user-supplied files and mappings (cluster.json,
plan.json, HF config.json, profiles, run records, scenarios, checkpoint pointers,
keyword overrides).

:func:`load_json` reads a file with limits (size, UTF-8, nesting depth, integer range,
finite numbers, no repeated keys), so hostile or broken input ends in one
:class:`ConfigError` line, never a traceback, a hang or an exhausted memory.
A :class:`FieldReader` then walks a dict while remembering the dotted path it is at,
so every error names the exact field (``cluster.json: node_groups[1].gpus_per_node``),
checks each value's type and range, and reports unknown keys with the closest valid
spelling.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterable, Mapping

from autoplan.errors import ConfigError, closest

_MISSING = object()

MAX_FILE_BYTES = 64 * 2**20
"""Largest JSON file read (a profile of many models is a few MB; configs are kilobytes)."""
MAX_DEPTH = 32
"""Deepest nesting of objects and lists (the formats need 6)."""
MAX_INT_DIGITS = 40
"""Integer literals longer than this are refused before Python converts them (a
thousands-digit literal costs quadratic time and is never a real count)."""
MAX_INT = 2**53
"""Largest magnitude an integer field may have unless it says otherwise (exactly
representable as a float, which is how JSON tools exchange numbers)."""
MAX_NAME_CHARS = 4096
"""Longest string field (names, labels, paths) unless it says otherwise."""
MAX_TEXT_CHARS = 65536
"""Longest multi-line string field (descriptions, commands)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_CONTROL_MULTILINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x85\u2028\u2029]")


class _BadJSON(Exception):
    """A limit broken while parsing; turned into a ConfigError naming the file."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadJSON(f"integer {text[:24]}... has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > 64:
        raise _BadJSON(f"number {text[:24]}... is too long")
    value = float(text)
    if not math.isfinite(value):
        raise _BadJSON(f"number {text} is out of range")
    return value


def _parse_constant(name: str):
    raise _BadJSON(f"{name} is not a number JSON allows (numbers must be finite)")


def _no_repeats(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _BadJSON(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _check_tree(data: Any) -> None:
    """Depth and string checks the parser cannot do (iteratively: no recursion limit)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                raise _BadJSON(f"is nested more than {MAX_DEPTH} levels deep")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, value in items:
                if isinstance(key, str):
                    _check_string(key)
                stack.append((value, depth + 1))
        elif isinstance(node, str):
            _check_string(node)


def _check_string(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadJSON(f"string {s[:40]!r} holds an unpaired surrogate escape (not valid Unicode)") from None


def parse_json_text(text: str, where: str, fix: str | None = None) -> Any:
    """Parse JSON text with the limits of :func:`load_json`; errors name ``where``."""
    try:
        data = json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_parse_constant, object_pairs_hook=_no_repeats)
        _check_tree(data)
        return data
    except json.JSONDecodeError as e:
        raise ConfigError(where, f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})", fix) from None
    except RecursionError:
        raise ConfigError(where, f"is nested more than {MAX_DEPTH} levels deep", fix) from None
    except (_BadJSON, ValueError) as e:
        raise ConfigError(where, f"is not acceptable JSON: {e}", fix) from None


def read_text(path: str | Path, what: str = "file", max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``; anything else (missing,
    a directory or device, too big, not UTF-8) is a ConfigError naming the path."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(str(path), f"{what} not found") from None
    except OSError as e:
        raise ConfigError(str(path), f"cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(str(path), f"is a directory, expected a {what}")
    if not stat.S_ISREG(st.st_mode):
        # A FIFO or device would block or never end.
        raise ConfigError(str(path), f"is not a regular file, expected a {what}")
    if st.st_size > max_bytes:
        raise ConfigError(str(path), f"is {st.st_size:,} bytes; a {what} may have at most {max_bytes:,}")
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(str(path), f"cannot be read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise ConfigError(str(path), f"grew past {max_bytes:,} bytes while being read")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"is not UTF-8 text (byte {e.start}: {e.reason})",
                          "save it as UTF-8") from None


def load_json(path: str | Path, what: str = "file", fix: str | None = None,
              max_bytes: int = MAX_FILE_BYTES) -> Any:
    """Read and parse a JSON file with limits: a regular file of at most ``max_bytes``,
    UTF-8, nested at most MAX_DEPTH deep, integers of at most MAX_INT_DIGITS digits,
    finite numbers, no key twice in an object. Every problem is a ConfigError naming
    the path (and, for a syntax error, the line and column)."""
    return parse_json_text(read_text(path, what, max_bytes), str(path), fix)


def check_text(value: str, where: str, *, max_chars: int = MAX_NAME_CHARS, multiline: bool = False) -> str:
    """``value`` if it is a string of at most ``max_chars`` without control characters
    (line breaks allowed when ``multiline``): names end up in reports, comments of
    exported configs and command lines, where a line break would start a new line."""
    if not isinstance(value, str):
        raise ConfigError(where, f"must be a string, got {_show(value)}")
    if len(value) > max_chars:
        raise ConfigError(where, f"is {len(value):,} characters long, at most {max_chars:,} allowed")
    bad = (_CONTROL_MULTILINE if multiline else _CONTROL).search(value)
    if bad:
        raise ConfigError(where, f"contains the control character {bad.group()!r}",
                          "use one line of printable text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(where, "is not valid Unicode (unpaired surrogate)") from None
    return value


def _show(value: Any) -> str:
    """A short repr for error messages (a huge value must not make a huge message)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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

    def int(self, key: str, default: Any = _MISSING, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
        """An integer field (an integral float such as 8.0 is accepted) within
        [minimum, maximum]; ``maximum`` defaults to MAX_INT."""
        return check_int(self.raw(key, default), self.path(key), minimum=minimum, maximum=maximum)

    def float(self, key: str, default: Any = _MISSING, *, positive: bool = False,
              minimum: float | None = None, maximum: float | None = None) -> float:
        """A finite number within the given bounds."""
        return check_float(self.raw(key, default), self.path(key), positive=positive, minimum=minimum,
                           maximum=maximum)

    def str(self, key: str, default: Any = _MISSING, *, choices: Iterable[str] | None = None,
            max_chars: int | None = None, multiline: bool = False) -> str:
        """A one-line string (multi-line when ``multiline``) of bounded length, or one of
        ``choices``."""
        value = self.raw(key, default)
        if value is None:
            return value
        if not isinstance(value, str):
            raise ConfigError(self.path(key), f"must be a string, got {_show(value)}")
        if choices is not None:
            choices = list(choices)
            if value not in choices:
                hint = closest(value[:100], choices)
                raise ConfigError(self.path(key), f"{_show(value)} is not one of {choices}",
                                  hint or None)
            return value
        limit = max_chars or (MAX_TEXT_CHARS if multiline else MAX_NAME_CHARS)
        return check_text(value, self.path(key), max_chars=limit, multiline=multiline)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.path(key), f"must be true or false, got {_show(value)}")
        return value

    def sub(self, key: str, default: Any = _MISSING) -> "FieldReader | None":
        value = self.raw(key, default)
        if value is None:
            return None
        return FieldReader(value, self.path(key))

    def list(self, key: str, default: Any = _MISSING, *, nonempty: bool = False,
             max_len: int | None = None) -> list:
        value = self.raw(key, default)
        if value is None:
            return value
        if isinstance(value, tuple):   # a dict built in Python rather than parsed
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(self.path(key), f"must be a list, got {type(value).__name__}")
        if nonempty and not value:
            raise ConfigError(self.path(key), "must not be empty")
        if max_len is not None and len(value) > max_len:
            raise ConfigError(self.path(key), f"has {len(value):,} entries, at most {max_len:,} allowed")
        return value

    def ints(self, key: str, default: Any = _MISSING, *, minimum: int | None = None,
             maximum: int | None = None, max_len: int | None = None, nonempty: bool = False) -> list[int]:
        """A list of integers, each within [minimum, maximum]."""
        values = self.list(key, default, nonempty=nonempty, max_len=max_len)
        if values is None:
            return values
        return [check_int(v, f"{self.path(key)}[{i}]", minimum=minimum, maximum=maximum)
                for i, v in enumerate(values)]

    def strs(self, key: str, default: Any = _MISSING, *, max_len: int | None = None) -> list[str]:
        """A list of one-line strings."""
        values = self.list(key, default, max_len=max_len)
        if values is None:
            return values
        return [check_text(v, f"{self.path(key)}[{i}]") for i, v in enumerate(values)]

    def items(self, key: str, **kw) -> list["FieldReader"]:
        """The entries of a list of objects, each as a FieldReader."""
        return [FieldReader(v, f"{self.path(key)}[{i}]") for i, v in enumerate(self.list(key, **kw))]

    def reject_unknown(self, allowed: Iterable[str]) -> None:
        """Refuse keys not in ``allowed`` (keys starting with '_' are comments and pass)."""
        allowed = list(allowed)
        for key in self.data:
            if key not in allowed and not str(key).startswith("_"):
                name = str(key) if len(str(key)) <= 60 else str(key)[:57] + "..."
                hint = closest(name, allowed)
                raise ConfigError(self.path(name), "is not a known field",
                                  hint or f"known fields: {', '.join(allowed)}")


def check_int(value: Any, where: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer (or an integral finite float) within
    [minimum, maximum] (``maximum`` defaults to MAX_INT); else a ConfigError at ``where``."""
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, f"must be an integer, got {_show(value)}")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise ConfigError(where, f"must be an integer, got {_show(value)}")
    top = MAX_INT if maximum is None else maximum
    if abs(value) > MAX_INT or value > top:
        raise ConfigError(where, f"must be <= {top:,}, got {value:.6g}" if isinstance(value, float)
                          else f"must be <= {top:,}, got {_show(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(where, f"must be >= {minimum}, got {value}")
    return value


def check_float(value: Any, where: str, *, positive: bool = False, minimum: float | None = None,
                maximum: float | None = None) -> float:
    """``value`` as a float if it is a finite number within the bounds; else a ConfigError."""
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, f"must be a number, got {_show(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise ConfigError(where, "is out of range") from None
    if not math.isfinite(value):
        raise ConfigError(where, f"must be finite, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(where, f"must be > 0, got {value:g}")
    if minimum is not None and value < minimum:
        raise ConfigError(where, f"must be >= {minimum:g}, got {value:g}")
    if maximum is not None and value > maximum:
        raise ConfigError(where, f"must be <= {maximum:g}, got {value:g}")
    return value


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically without following a planted link (see
    :func:`autoplan.files.write_text`, which every writer uses)."""
    from autoplan.files import write_text
    write_text(path, text)
