"""The pipeline shape exchange follows the activations' rank order (megatron_wlb.megatron.hooks.p2p, Megatron #5100)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
p2p_communication = pytest.importorskip("megatron.core.pipeline_parallel.p2p_communication")

from megatron_wlb.megatron.hooks import p2p  # noqa: E402


class _Group:
    def __init__(self, rank: int, size: int = 4):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _record_ops(monkeypatch):
    ops = []

    class Req:
        def wait(self):
            return None

    def isend(tensor, dst, group=None):
        ops.append(("send", dst, tensor.tolist()))
        return Req()

    def irecv(tensor, src, group=None):
        ops.append(("recv", src))
        tensor.copy_(torch.tensor([7, 1, 64]))
        return Req()

    def batched(*a, **k):
        raise AssertionError("the shape exchange must not be one batch_isend_irecv group (Megatron #5100)")

    monkeypatch.setattr(torch.distributed, "isend", isend)
    monkeypatch.setattr(torch.distributed, "irecv", irecv)
    monkeypatch.setattr(torch.distributed, "batch_isend_irecv", batched)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    return ops


@pytest.mark.parametrize("rank,first", [(0, "send"), (1, "recv"), (2, "send"), (3, "recv")])
def test_shape_exchange_uses_the_rank_ordered_p2p(monkeypatch, rank, first):
    ops = _record_ops(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    comm = SimpleNamespace(pp_group=_Group(rank), prev_rank=(rank - 1) % 4, next_rank=(rank + 1) % 4)
    activation = torch.zeros(5, 1, 64)
    recv_prev, recv_next = p2p._ordered_communicate_shapes(comm, activation, None, True, False)
    assert recv_prev == [7, 1, 64] and recv_next == [0, 0, 0]
    assert ops[0][0] == first  # even ranks send first, odd ranks receive first: the order of _p2p_ops
    assert ("send", (rank + 1) % 4, [5, 1, 64]) in ops and ("recv", (rank - 1) % 4) in ops


def test_install_replaces_megatrons_batched_exchange(monkeypatch):
    communicator = p2p_communication.P2PCommunicator
    monkeypatch.setattr(communicator, "_communicate_shapes", communicator._communicate_shapes)
    assert p2p.install()
    assert communicator._communicate_shapes is p2p._ordered_communicate_shapes
    assert p2p.install()  # idempotent
