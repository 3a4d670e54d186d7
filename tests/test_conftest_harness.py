"""The shared multiprocess harness (tests/conftest.py) reports a failing rank instead of passing or hanging."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conftest import run_world  # noqa: E402


def _fails_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError(f"rank {rank} of {world} fails")


def test_a_failing_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="rank 1 of 2 fails"):
        run_world(_fails_on_rank_one, 2, start_method="fork")
