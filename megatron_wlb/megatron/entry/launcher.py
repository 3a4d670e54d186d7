"""A thin ``pretrain_gpt`` for WLB-LLM: Megatron's own ``pretrain`` loop, our data, sharding and loss.

For installs that have Megatron's training code (``megatron/training``, shipped in the megatron-core
wheel from 0.19) but no Megatron-LM checkout:

    torchrun --nproc-per-node 8 -m megatron_wlb.megatron.entry.launcher <Megatron flags> --wlb-packer wlb ...

Every rank (every TP rank and every pipeline stage) reads its own copy of the packed micro-batch from
the ``WlbDataIterator`` that ``apply()`` builds on every rank, already planned for its CP rank, so
there is no TP broadcast of variable-length tensors and no middle-stage special case: each stage
uploads the same rows and the same ``WlbPackedSeqParams``; stages that do not embed or compute the
loss simply ignore the tokens or labels. The loss is per token
(``--calculate-per-token-loss`` is required): Megatron then divides the summed loss by the tokens of
the whole global batch, so every token weighs the same whatever micro-batch it was packed into.

The steps and providers are ``gpt_entry``'s, imported after ``apply()``: ``--help`` runs without Megatron.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

import megatron_wlb.megatron as wlb
from megatron_wlb.megatron.args.compat import install_python_shims
from megatron_wlb.megatron.args.flags import asks_for_help, wlb_help
from megatron_wlb.megatron.args.validation import exit_on_startup_error
from megatron_wlb.megatron.state import process as wlb_state


def main(argv: Sequence[str] | None = None) -> None:
    """Apply the WLB-LLM hooks and run Megatron's ``pretrain`` with this module's providers; a start-up problem
    (flags, data) exits with its one-line message (``args.StartupError``)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]

    if asks_for_help(sys.argv[1:]):  # ours only: Megatron's --help crashes on 0.19.2 (upstream)
        print(wlb_help("python -m megatron_wlb.megatron.entry.launcher"), end="")
        return
    with exit_on_startup_error(), released_at_exit():
        _pretrain()


@contextmanager
def released_at_exit() -> Iterator[None]:
    """``release_process_groups`` once training returns, or leaves by Megatron's own early exits (``sys.exit(0)``
    of ``--exit-interval``, ``--exit-duration-in-mins``, ``--exit-signal-handler``: every rank leaves at the same
    iteration, so every rank meets the barrier); not on an error, where another rank may never arrive."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            _report_untrained()
            release_process_groups()
        raise
    _report_untrained()
    release_process_groups()


def _report_untrained() -> None:
    """Rank 0 says what the packer still held when training ended (issue 49: it was skipped without a word)."""
    report = wlb_state.untrained_report()
    if report is not None:
        wlb_state.print_rank0(report)


def release_process_groups() -> None:
    """Once training has returned: every rank meets, then the process groups are destroyed, so that gloo's
    worker threads do not outlive the interpreter. Megatron's ``pretrain`` leaves them up, and an exit with
    them alive can abort ("terminate called without an active exception", SIGABRT; pytorch#190489)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _pretrain() -> None:
    """`apply()`, then Megatron's ``pretrain`` with ``gpt_entry``'s providers."""
    wlb.apply(middle_stage_batches=True)  # also makes the dataset-helper build safe (startup.py)
    from megatron_wlb.megatron.entry import gpt_entry  # lazy: Megatron, imported after apply() (and the CPU redirects)

    gpt_entry.pretrain_gpt()


def __getattr__(name: str) -> Any:
    """``get_batch``, ``forward_step``, ``model_provider``, ... of ``gpt_entry``, for a ``pretrain_gpt`` of one's own:
    imported on first use, so that ``--help`` runs without Megatron."""
    if name in ("ARGS_DEFAULTS", "datasets_provider", "forward_step", "get_batch", "loss_func", "model_provider"):
        install_python_shims()  # megatron.training needs typing.override (apply() installs it too)
        from megatron_wlb.megatron.entry import gpt_entry  # lazy: it imports Megatron

        return getattr(gpt_entry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
