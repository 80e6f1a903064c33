"""Progress of long work: stage lines, a bar for work that can be counted
(layers quantized, nodes lowered, bytes written), and on a terminal the
seconds spent so far in a stage that cannot be counted (torch's own passes).

Library code counts with `counter(label, total)`; whoever shows progress
installs a `TerminalProgress` with `shown_by(...)` (the CLI does, on stderr).
With none installed, counting costs nothing and shows nothing."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, TextIO

WIDTH = 30  # characters of the bar itself
REDRAW_EVERY_S = 0.1  # a terminal redraw per counted item would cost more than the work
TICK_EVERY_S = 1.0


class TerminalProgress:
    """Writes stage lines to `stream`; where `live` (a terminal), also redraws
    one status line in place: a bar while work is counted, otherwise the
    seconds spent in the current stage. Not live, it writes only the lines."""

    def __init__(self, stream: TextIO | None = None, live: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._lock = threading.Lock()
        self._status = ""  # what the status line shows now ("" : nothing drawn)
        self._counting = False
        self._drawn_at = 0.0
        self._stage_started = time.monotonic()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def line(self, text: str) -> None:
        """A stage line: printed whole, starts a new stage."""
        with self._lock:
            self._erase()
            self.stream.write(text + "\n")
            self.stream.flush()
            self._stage_started = time.monotonic()

    def update(self, label: str, done: float, total: float, unit: str = "") -> None:
        if not self.live:
            return
        now = time.monotonic()
        if done < total and now - self._drawn_at < REDRAW_EVERY_S:
            return
        filled = int(WIDTH * min(done / total, 1.0)) if total else WIDTH
        amount = f"{done:.1f}/{total:.1f} {unit}" if unit else f"{int(done)}/{int(total)}"
        with self._lock:
            self._counting = True
            self._drawn_at = now
            self._draw(f"{label} [{'#' * filled}{'.' * (WIDTH - filled)}] {amount}")

    def finish_count(self) -> None:
        with self._lock:
            self._counting = False
            self._erase()

    def tick(self) -> None:
        """Shows the seconds spent in the current stage (unless a bar is up)."""
        with self._lock:
            if self.live and not self._counting:
                self._draw(f"  ... {time.monotonic() - self._stage_started:.0f} s in this stage")

    def __enter__(self) -> TerminalProgress:
        if self.live:
            self._ticker = threading.Thread(target=self._tick_until_stopped, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            self._erase()

    def _tick_until_stopped(self) -> None:
        while not self._stop.wait(TICK_EVERY_S):
            self.tick()

    def _draw(self, status: str) -> None:
        self.stream.write(f"\r{status}\x1b[K")  # \x1b[K: erase what a longer status left
        self.stream.flush()
        self._status = status

    def _erase(self) -> None:
        if self._status:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._status = ""


_shown_by: ContextVar[TerminalProgress | None] = ContextVar("executorch_mlx_progress", default=None)


@contextmanager
def shown_by(display: TerminalProgress | None) -> Iterator[None]:
    """Counters created inside report to `display` (None: to nothing)."""
    token = _shown_by.set(display)
    try:
        yield
    finally:
        _shown_by.reset(token)


class Counter:
    """`total` units of work, shown in units of `scale` (2**20 with unit "MiB")."""

    def __init__(self, label: str, total: float, unit: str = "", scale: float = 1.0) -> None:
        self.label, self.total, self.unit, self.scale = label, total, unit, scale
        self.done = 0.0
        self._display = _shown_by.get()

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        if self._display is not None and self.total:
            self._display.update(self.label, self.done / self.scale, self.total / self.scale, self.unit)

    def __enter__(self) -> Counter:
        return self

    def __exit__(self, *exc) -> None:
        if self._display is not None:
            self._display.finish_count()


def counter(label: str, total: float, unit: str = "", scale: float = 1.0) -> Counter:
    return Counter(label, total, unit, scale)


class CountingWriter:
    """A file whose writes advance `count` by their size in bytes."""

    def __init__(self, file, count: Counter) -> None:
        self._file, self._count = file, count

    def write(self, data) -> int:
        written = self._file.write(data)
        self._count.advance(memoryview(data).nbytes)
        return written

    def __getattr__(self, name):
        return getattr(self._file, name)
