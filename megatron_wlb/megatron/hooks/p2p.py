"""Pipeline shape exchange in the rank-ordered pattern of Megatron's tensor p2p (no #5100 deadlock).

Packed micro-batches vary in length, so pipeline stages exchange each activation's shape before the
activation (``variable_seq_lengths``). Megatron's ``P2PCommunicator._communicate_shapes`` posts that
exchange as one ``batch_isend_irecv`` group on every rank, while its activations go through
``_p2p_ops``, where even pipeline ranks send before they receive and odd ranks receive before they
send. With NCCL and PP >= 4 the two orders can wait on each other: Megatron-LM issue #5100 (a hang
with ``variable_seq_lengths`` and batched p2p). ``install()`` makes the shape exchange use
``_p2p_ops`` itself, so shapes and activations follow one order on every rank; each call still
waits for its own requests before returning, as Megatron's does. Same signature, same result.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.pipeline_parallel import p2p_communication

from megatron_wlb.megatron.hooks import table as hooks
from megatron_wlb.megatron.hooks.rebind import wrapping


def _ordered_communicate_shapes(self: Any, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool,
                                recv_next: bool) -> tuple[list[int], list[int]]:
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def shape_of(tensor: Any) -> torch.Tensor | None:
        return None if tensor is None else torch.tensor(tensor.size(), device=device, dtype=torch.int64)

    recv_prev_shape = torch.empty((3,), device=device, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.empty((3,), device=device, dtype=torch.int64) if recv_next else None
    reqs = p2p_communication._p2p_ops(
        tensor_send_prev=shape_of(tensor_send_prev), tensor_recv_prev=recv_prev_shape,
        tensor_send_next=shape_of(tensor_send_next), tensor_recv_next=recv_next_shape,
        group=self.pp_group, prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank)
    for req in (reqs.values() if isinstance(reqs, dict) else reqs):
        req.wait()
    return (recv_prev_shape.tolist() if recv_prev_shape is not None else [0, 0, 0],
            recv_next_shape.tolist() if recv_next_shape is not None else [0, 0, 0])


def ordered_communicate_shapes(original: Any) -> Any:
    """The replacement of ``P2PCommunicator._communicate_shapes`` (``hooks.HOOKS``); None where this Megatron's
    p2p module has no ``_p2p_ops`` to order the exchange with."""
    if not hasattr(p2p_communication, "_p2p_ops"):
        return None
    return wrapping(original)(_ordered_communicate_shapes)


def install() -> bool:
    """Replace ``P2PCommunicator._communicate_shapes`` (megatron-core 0.16 and 0.19); idempotent.
    Returns False where this Megatron has no such method (nothing to fix)."""
    hooks.install("pipeline")
    return hooks.is_installed("P2PCommunicator._communicate_shapes")
