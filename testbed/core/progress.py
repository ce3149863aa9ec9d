"""Progress of long work on stderr: one line per update, rewritten in place on a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.done = 0

    def update(self, done: int | None = None, note: str = "") -> None:
        self.done = self.done + 1 if done is None else done
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        line = f"{self.label}: {self.done}/{self.total} ({elapsed:.1f} s){' ' + note if note else ''}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
