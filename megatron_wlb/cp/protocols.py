"""What the simulator and the command line need of a CP shard layout, stated as a protocol.

``cp.layouts.ShardLayout`` (the real layouts) and ``sim.dyncp.DynamicCPLayout`` (Megatron's dynamic
CP sizes) satisfy it structurally; so may a test's stand-in. Numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from megatron_wlb.costmodel import CostModel


@runtime_checkable
class Layout(Protocol):
    """One micro-batch sharded over a CP group: per CP rank, attention seconds, tokens and causal pairs."""

    @property
    def name(self) -> str:
        """The layout used (for ``adaptive``: the one it chose)."""
        ...

    @property
    def rank_work(self) -> np.ndarray:
        """Estimated attention seconds per CP rank, shape ``(cp,)``."""
        ...

    @property
    def rank_tokens(self) -> np.ndarray:
        """Tokens (query rows) per CP rank, shape ``(cp,)``."""
        ...

    @property
    def rank_pairs(self) -> np.ndarray:
        """Causal (query, key) pairs each CP rank's attention computes, shape ``(cp,)``."""
        ...


#: ``(layout name, document lengths, cp, cost model) -> Layout``: how the simulator shards a micro-batch
LayoutBuilder = Callable[[str, np.ndarray, int, "CostModel"], Layout]
