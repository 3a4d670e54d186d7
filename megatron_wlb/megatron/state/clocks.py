"""Where the step timing's timestamps come from (``timing.Recorder``): ``CpuClock`` reads a monotonic clock
(``ThreadClock``: the thread's CPU time); ``CudaClock`` records CUDA events on the current stream and reads them
only once they have completed, so nothing synchronises on the critical path."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """Where timestamps come from; ``seconds`` is only called on stamps that are ``ready``."""
    kind: str
    #: iterations the training log stays behind, so that it reads only completed stamps
    lag: int

    def stamp(self) -> Any: ...

    def ready(self, stamp: Any) -> bool: ...

    def wait(self, stamp: Any) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class CpuClock:
    """A monotonic clock: the CPU executes synchronously, so a stamp is final when taken."""
    kind = "cpu"
    lag = 0

    def stamp(self) -> float:
        return time.perf_counter()

    def ready(self, stamp: Any) -> bool:
        return True

    def wait(self, stamp: Any) -> None:
        return None

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)


class ThreadClock(CpuClock):
    """This thread's CPU time (``time.thread_time``): what the step itself computed, without the time the
    process waited, was preempted or had its core stolen (``WLB_TRACE_CLOCK=thread``, for fitting a cost
    model; its walls and waits are then thread seconds too, not the iteration's wall)."""
    kind = "cpu-thread"

    def stamp(self) -> float:
        return time.thread_time()


class CudaClock:
    """CUDA events recorded on the current stream; read only after they completed (no host sync)."""
    kind = "cuda"
    lag = 1  # the training log measures the previous iteration, whose events have long completed

    def __init__(self, event_type: Any = None):
        if event_type is None:
            event_type = torch.cuda.Event
        self.event_type = event_type

    def stamp(self) -> Any:
        event = self.event_type(enable_timing=True)
        event.record()
        return event

    def ready(self, stamp: Any) -> bool:
        return bool(stamp.query())

    def wait(self, stamp: Any) -> None:
        stamp.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3


__all__ = ["Clock", "CpuClock", "CudaClock", "ThreadClock"]
