"""A plain progress bar on stderr: one line redrawn with a carriage return, shown only
when stderr is a terminal (logs and pipes stay clean) and never more than ~10 times a
second (redrawing costs more than a DP step)."""
from __future__ import annotations

import sys
import time


class Progress:
    """``phase(name, total)`` starts a phase; ``step(n)`` advances it; ``close()`` ends."""

    def __init__(self, enabled: bool = True, stream=None, width: int = 28):
        self.stream = stream or sys.stderr
        self.enabled = bool(enabled) and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width
        self.name = ""
        self.total = 0
        self.done = 0
        self._last = 0.0
        self._shown = False
        self.best: float | None = None

    def phase(self, name: str, total: int) -> None:
        self.name, self.total, self.done = name, max(int(total), 0), 0
        self._draw(force=True)

    def incumbent(self, seconds: float) -> None:
        """The best plan so far takes ``seconds`` per iteration (shown on the line)."""
        self.best = seconds
        self._draw(force=True)

    def step(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0) if self.total else 0.0
        bar = "#" * int(frac * self.width)
        line = f"\rsearch {self.name:<10} [{bar:<{self.width}}] {self.done}/{self.total}"
        if self.best is not None:
            line += f"  best {self.best:.4g} s/iter"
        self.stream.write(line.ljust(88))
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * 88 + "\r")
            self.stream.flush()
