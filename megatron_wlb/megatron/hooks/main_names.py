"""The names Megatron-LM main's own sequence-packing path and ours share: our scheduler's name, main's flag that
picks it, and the TransformerEngine main requires for it.

Below both ``main_schedule`` (our scheduler, ``register()``) and ``main_checks`` (main's checks widened to let
``wlb`` through), which read them; importing it needs neither torch nor Megatron.
"""

from __future__ import annotations

#: the value of ``config.sequence_packing_scheduler`` that selects our scheduler (enum member ``WLB``)
SCHEDULER_NAME = "wlb"
#: main's (after PR #6742) and dev's flag that picks the scheduler (``choices`` without ``wlb`` there)
SCHEDULER_FLAG = "--sequence-packing-scheduler"
#: TransformerConfig refuses any sequence-packing scheduler below this TransformerEngine (main after #6742, dev)
TE_MIN_VERSION = "2.9.0"

__all__ = ["SCHEDULER_FLAG", "SCHEDULER_NAME", "TE_MIN_VERSION"]
