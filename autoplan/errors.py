"""Errors a user can act on.

Every input problem raises :class:`ConfigError`, which names the field that is
wrong (as a dotted path into the file or call) and, where there is one, the fix.
The CLI prints these as one line instead of a traceback.
"""
from __future__ import annotations

import difflib
import re
from typing import Iterable

_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters written as escapes, so a
    message built from hostile input stays one line (and cannot forge another)."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], str(text))


class AutoplanError(Exception):
    """Base class of every error autoplan raises on purpose."""


class ConfigError(AutoplanError, ValueError):
    """A field of a cluster, model, plan or call is missing or invalid."""

    def __init__(self, field: str, problem: str, fix: str | None = None):
        self.field = field
        self.problem = problem
        self.fix = fix
        text = f"{field}: {problem}" if field else problem
        if fix:
            text += f" ({fix})"
        super().__init__(one_line(text))


class NoPlanFitsError(AutoplanError):
    """No plan in the search space fits in device memory; the message explains why."""


def closest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """A ' Did you mean ...?' hint, or '' when nothing is close."""
    lowered = {c.lower(): c for c in choices}
    # Only a name of plausible length can be a misspelling (and difflib is quadratic).
    if len(name) > 100:
        return ""
    hits = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    if not hits:
        return ""
    return "did you mean " + " or ".join(repr(lowered[h]) for h in hits) + "?"
