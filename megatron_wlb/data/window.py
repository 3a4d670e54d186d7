"""A stream read through a moving window: what the document reader's and the sample intake's cursors share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class MovingWindow(ABC):
    """Documents (or pieces) in stream order, generated a chunk at a time (``generate``) into a window
    (``ids``, ``lengths``; ``start`` is the stream position of ``ids[0]``) that forgets what lies before
    the ``start`` of the last ``window`` asked for, so memory grows with the window, not the stream."""

    def __init__(self, start: int = 0):
        self.ids = np.zeros(0, dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.start = int(start)

    @property
    def stop(self) -> int:
        """Stream position after the last entry generated so far."""
        return self.start + int(self.ids.size)

    @abstractmethod
    def generate(self) -> bool:
        """Append the next chunk to the window; False at the end of the stream."""

    def _drop(self, count: int) -> None:
        """Drop the window's first ``count`` entries (a subclass hashes them first, or drops its own arrays)."""
        self.ids, self.lengths = self.ids[count:].copy(), self.lengths[count:].copy()

    def _forget(self, before: int) -> None:
        drop = min(max(0, before - self.start), int(self.ids.size))
        if drop:
            self._drop(drop)
            self.start += drop

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and stream ids of entries ``[start, stop)`` (fewer at the end)."""
        if start < self.start:
            raise ValueError(f"stream position {start} was already passed (the window starts at {self.start}); "
                             "open a new cursor to read from the start")
        if start - self.start > self.ids.size // 2:
            self._forget(start)
        while self.stop < stop and self.generate():
            pass
        a, b = start - self.start, stop - self.start
        return self.lengths[a:b], self.ids[a:b]
