"""A progress line with an ETA on stderr, without a dependency.

The ETA weighs each remaining item by its expected cost (entries differ by orders of
magnitude: a vocabulary-wide head at micro-batch 8 against an embedding at 1) and
prices the remaining weight at the seconds per weight of the last few items: items
run smallest first, and the recent ones resemble the next ones best.
On a terminal the line redraws in place; in a log it prints a line every
``log_every_s`` seconds so CI logs stay short.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Weighted progress of a run of ``total_weight``."""

    def __init__(self, total: int, total_weight: float, title: str = "profile", stream: TextIO | None = None,
                 enabled: bool = True, log_every_s: float = 10.0, width: int = 24):
        self.total = total
        self.total_weight = max(total_weight, 1e-30)
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every_s = log_every_s
        self.width = width
        self.done = 0
        self.done_weight = 0.0
        self.recent: list[tuple[float, float]] = []
        """(weight, seconds) of the last RECENT items."""
        self._last_step = None
        self.start = time.monotonic()
        self._last_log = -1e9
        self._last_len = 0

    RECENT = 8

    def eta_s(self) -> float | None:
        """Seconds left, or None before anything was timed."""
        w = sum(x for x, _ in self.recent)
        t = sum(y for _, y in self.recent)
        if w <= 0 or t <= 0:
            return None
        return max(0.0, self.total_weight - self.done_weight) * t / w

    def line(self, label: str = "") -> str:
        frac = min(1.0, self.done_weight / self.total_weight)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        eta = self.eta_s()
        eta_text = "ETA --:--" if eta is None else f"ETA {_clock(eta)}"
        elapsed = _clock(time.monotonic() - self.start)
        return (f"{self.title} [{bar}] {self.done}/{self.total} {frac:4.0%}  {elapsed} elapsed  "
                f"{eta_text}  {label}").rstrip()

    def step(self, weight: float, label: str = "") -> None:
        """One item of ``weight`` finished; ``label`` names the next (or this) one."""
        now = time.monotonic()
        self.recent.append((weight, now - (self._last_step if self._last_step is not None else self.start)))
        self.recent = self.recent[-self.RECENT:]
        self._last_step = now
        self.done += 1
        self.done_weight += weight
        self.show(label)

    def show(self, label: str = "") -> None:
        if not self.enabled:
            return
        text = self.line(label)
        if self.tty:
            pad = max(0, self._last_len - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._last_len = len(text)
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s or self.done == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_log = now

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
