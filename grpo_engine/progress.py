"""Progress of a phase that can take more than a few seconds (warm start, SFT, evaluation, export, GGUF import).

On a terminal: one line redrawn in place. Elsewhere (a log file, CI, nohup): a plain line every `every_s` seconds
and one when the phase ends, so a long phase never goes silent and a short one prints nothing. The GRPO phase has
its own console (monitor.py); this is the same rule for the rest.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

EVERY_S = 10.0


class Progress:
    """`with Progress("SFT warm start", total=1100) as p: ... p.update(done, "loss 0.53")`."""

    def __init__(self, name: str, total: int, *, stream: TextIO | None = None, every_s: float | None = None):
        self.name, self.total, self.every_s = name, total, EVERY_S if every_s is None else every_s
        self.stream = stream if stream is not None else sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = self.last = time.monotonic()
        self.done, self.note, self.printed = 0, "", False

    def __enter__(self) -> Progress:
        return self

    def update(self, done: int, note: str = "") -> None:
        self.done, self.note = done, note
        now = time.monotonic()
        if self.live:
            self.stream.write(f"\r{self._status(now)}\x1b[K")
            self.stream.flush()
        elif now - self.last >= self.every_s:
            self.last, self.printed = now, True
            self._line(self._status(now))

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        elif exc_type is None and self.printed:
            self._line(f"{self.name}: done in {time.monotonic() - self.start:.0f} s")

    def _status(self, now: float) -> str:
        note = f"  {self.note}" if self.note else ""
        return f"{self.name}: {self.done}/{self.total}{note}  {now - self.start:.0f} s"

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
