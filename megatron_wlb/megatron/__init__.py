"""The Megatron-LM adapter: ``apply()`` hooks WLB-LLM into a Megatron-LM training process.

Importing this package needs neither torch nor Megatron; ``apply()`` imports them.
"""

from __future__ import annotations

from megatron_wlb.megatron.settings import WlbSettings

__all__ = ["WlbSettings"]
