"""The batch path off the critical path: the next micro-batch is built while the current one trains.

``PrefetchingIterator`` wraps a ``WlbDataIterator``. When it hands out micro-batch i of an iteration,
a background thread starts on micro-batch i + 1 of the same iteration: its CP plan, its rows of
tokens/labels/loss_mask/positions (``WlbDataIterator.produce``) and, on CUDA, its upload: the rows
are copied into pinned host memory and sent with non-blocking copies on a side stream
(``cp_hooks.stage_upload``), kept here beside the micro-batch, not on it (``take_staged``);
``upload_micro_batch`` then only makes the compute stream wait for that stream's event. The host can run ahead
of the GPU.

What stays on the critical path, on purpose: the first micro-batch of every iteration (it packs the
iteration's global plan, which must follow the online cost-model refit of the iteration before and
must not run ahead of a checkpoint's data state; with CP it also lays out the iteration's micro-batches,
whose layouts the CP ranks agree on before the step: ``agreement.py``). Plans and their order are
exactly the wrapped iterator's: the same ``produce`` calls, in the same order, one at a time.

``last_seconds`` is the host time ``__next__`` spent on the critical path (waiting for the thread,
or building the micro-batch itself); ``critical_seconds`` / ``background_seconds`` add them up.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from megatron_wlb.cp.plan import RankMicroBatch
from megatron_wlb.megatron.data.packed import WlbDataIterator

#: the uploads the prefetch threads started (``stage``), by the micro-batch they are of, until ``take_staged``
_STAGED: weakref.WeakKeyDictionary[RankMicroBatch, Any] = weakref.WeakKeyDictionary()
_STAGED_LOCK = threading.Lock()


def take_staged(batch: RankMicroBatch) -> Any:
    """The upload a prefetch thread started for ``batch`` (what its ``stage`` returned), once; None if none."""
    with _STAGED_LOCK:
        return _STAGED.pop(batch, None)


class PrefetchingIterator:
    """``WlbDataIterator`` with the next micro-batch of an iteration built (and staged) on a thread.

    Everything else (``packer``, ``current``, ``iteration``, ``n``, ``stream``, ...) is the wrapped
    iterator's. ``stage``: a function ``RankMicroBatch -> upload or None`` run on the thread after building (the
    CUDA upload, kept for ``take_staged``; None: build only)."""

    def __init__(self, inner: WlbDataIterator, stage: Any = None) -> None:
        self.inner = inner
        self.stage = stage
        self.last: RankMicroBatch | None = None
        self.last_seconds = 0.0
        self.position = 0
        self.critical_seconds = 0.0
        self.background_seconds = 0.0
        self.prefetched = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wlb-prefetch")
        self._pending: Future | None = None
        self._lock = threading.Lock()  # one produce() at a time, whichever thread runs it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __iter__(self) -> PrefetchingIterator:
        return self

    def _build(self, staged: bool) -> tuple[RankMicroBatch, int, float]:
        start = time.perf_counter()
        with self._lock:
            batch = self.inner.produce()
            position = self.inner.position
        if staged and self.stage is not None:
            upload = self.stage(batch)
            if upload is not None:
                with _STAGED_LOCK:
                    _STAGED[batch] = upload
        return batch, position, time.perf_counter() - start

    def __next__(self) -> RankMicroBatch:
        start = time.perf_counter()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            batch, position, seconds = pending.result()
            self.background_seconds += seconds
            self.prefetched += 1
        else:
            batch, position, _ = self._build(staged=False)
        self.last = self.inner.last = batch
        self.position = position
        self.last_seconds = time.perf_counter() - start
        self.inner.last_seconds = self.last_seconds
        self.critical_seconds += self.last_seconds
        if self.inner.remaining_in_iteration > 0:  # no pending build here: the cursor is settled
            self._pending = self._pool.submit(self._build, True)
        return batch

    def _drain(self) -> None:
        if self._pending is not None:
            self._pending.result()

    def state_dict(self) -> dict[str, Any]:
        self._drain()
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self.inner.load_state_dict(state)

    def close(self) -> None:
        """Stop the thread (after the micro-batch it may be building)."""
        self._pool.shutdown(wait=True)


def unwrap(iterator: Any) -> Any:
    """The ``WlbDataIterator`` inside Megatron's ``RerunDataIterator`` and/or a ``PrefetchingIterator``."""
    iterator = getattr(iterator, "iterable", iterator)
    return iterator.inner if isinstance(iterator, PrefetchingIterator) else iterator


__all__ = ["PrefetchingIterator", "take_staged", "unwrap"]
