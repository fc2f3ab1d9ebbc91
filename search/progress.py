"""A plain progress bar on stderr: one line redrawn with a carriage return, shown only
when stderr is a terminal (logs and pipes stay clean) and never more than ~10 times a
second (redrawing costs more than a DP step). A background ticker redraws it with the
phase's elapsed seconds every TICK_S while one long step (a CP-SAT solve, a full
estimate) runs, so the bar never looks frozen."""
from __future__ import annotations

import sys
import threading
import time

TICK_S = 0.5
"""How often the elapsed time is redrawn while no step completes."""


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
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def phase(self, name: str, total: int) -> None:
        with self._lock:
            self.name, self.total, self.done = name, max(int(total), 0), 0
            self._started = time.monotonic()
        self._draw(force=True)
        if self.enabled and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="search-progress", daemon=True)
            self._ticker.start()

    def incumbent(self, seconds: float) -> None:
        """The best plan so far takes ``seconds`` per iteration (shown on the line)."""
        self.best = seconds
        self._draw(force=True)

    def step(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self._draw(force=time.monotonic() - self._last >= TICK_S)

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        with self._lock:
            now = time.monotonic()
            if self._stop.is_set() or (not force and now - self._last < 0.1):
                return
            self._last = now
            frac = min(self.done / self.total, 1.0) if self.total else 0.0
            bar = "#" * int(frac * self.width)
            line = (f"\rsearch {self.name:<10} [{bar:<{self.width}}] {self.done}/{self.total} "
                    f"{now - self._started:5.1f}s")
            if self.best is not None:
                line += f"  best {self.best:.4g} s/iter"
            self.stream.write(line.ljust(88))
            self.stream.flush()
            self._shown = True

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * 88 + "\r")
            self.stream.flush()
