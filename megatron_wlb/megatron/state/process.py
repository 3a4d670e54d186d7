"""What ``apply()`` installed in this process, and the state its hooks share (torch-free)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_wlb.megatron.args.settings import WlbSettings

if TYPE_CHECKING:
    from megatron_wlb.megatron.data.packed import WlbDataIterator


@dataclass
class Runtime:
    """What apply() installed in this process, and the state its hooks share."""

    installed: bool = False
    #: the entry point gives middle pipeline stages packed-sequence params (launcher, patched pretrain_gpt)
    middle_stage_batches: bool = False
    #: some split uses Megatron's own (unpacked) loader, whose batches legitimately carry no packed params
    megatron_loaders: bool = False
    settings: WlbSettings | None = None
    registry: Any = None
    logger: Any = None
    #: the online cost-model refit (``--wlb-cost-model online``), on every rank
    refit: Any = None
    originals: dict[str, Callable] = field(default_factory=dict)
    #: the plan agreement checks run (``agreement.wrap_train_step``): how many, and their seconds in all
    agreement_checks: int = 0
    agreement_s: float = 0.0
    #: seconds the start-up agreement took (fingerprinting the settings and datasets, and comparing them)
    startup_agreement_s: float = 0.0
    #: Megatron-LM main's own sequence-packing scheduler: whether ``wlb`` was registered there, or why not
    #: (``main_schedule.register``)
    main_scheduler: str = ""

    def agreed(self, seconds: float) -> None:
        self.agreement_checks += 1
        self.agreement_s += seconds


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """This process's hook state (settings once args are validated, iterators, metrics logger)."""
    return _RUNTIME


def first_train_iterator() -> WlbDataIterator | None:
    """The training iterator of this rank's first model chunk (all chunks plan alike), if built."""
    registry = _RUNTIME.registry
    return registry.iterators[0] if registry is not None and registry.iterators else None


def untrained_report() -> str | None:
    """What the packer still holds when training ends (read but never trained: pieces waiting for a later
    iteration), as one line for rank 0's log, or None when nothing waits (or no training iterator was built)."""
    iterator = first_train_iterator()
    if iterator is None:
        return None
    tokens = int(iterator.packer.pending())
    if not tokens:
        return None
    held = iterator.packer.held()
    documents = sorted({p.doc_id for p in held})
    shown = ", ".join(map(str, documents[:8])) + (", ..." if len(documents) > 8 else "")
    which = (f" ({len(held)} pieces of {len(documents)} documents or samples waiting for a later iteration: "
             f"{shown})" if held else "")
    return (f"> megatron_wlb: training ended with {tokens} tokens read but not trained{which}; a run resumed from "
            "the last checkpoint with the same --wlb-* flags trains them (or raise --train-iters)")


def is_rank0() -> bool:
    import torch.distributed as dist  # lazy: importing the package needs no torch

    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank0(line: str) -> None:
    if is_rank0():
        print(line, flush=True)
