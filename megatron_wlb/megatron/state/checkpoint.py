"""Packer + stream state in Megatron checkpoints: a JSON sidecar in the iteration directory.

Megatron writes ``<save>/iter_0000100/...`` (``get_checkpoint_name(..., return_base_dir=True)``) and
records the iteration in ``latest_checkpointed_iteration.txt``. We add
``<save>/iter_0000100/wlb_packer_state.json``: the data iterator's state (the packer's waiting
queues and carried pieces, its position in the document stream, a digest of the stream consumed
so far and the reader's settings). Every rank holds the same state (identical packers); global
rank 0 writes it, every rank reads it. ``load_checkpoint`` returns the iteration it resumed from; the
wrapper reads that iteration's sidecar and hands it to the training iterator when it is built
(Megatron loads checkpoints before it builds data iterators). A resumed run then yields exactly the
micro-batches an uninterrupted run would have: no document is lost or repeated.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.validation import Refusal, RunRefusal, StartupError
from megatron_wlb.megatron.data.packed import WlbDataIterator, dumps_state
from megatron_wlb.megatron.hooks.rebind import wrapping
from megatron_wlb.megatron.state.checkpoint_files import (
    SIDECAR_NAME,
    iteration_dir,
    load_data_state,
    newest_sidecar_before,
    save_data_state,
    saved_by_megatron_wlb,
    saved_megatron_args,
    waiting_pieces,
)
from megatron_wlb.packing.base import LayoutChanged
from megatron_wlb.packing.types import resolved_knobs


@dataclass
class DataStateRegistry:
    """The process's training iterators (one per virtual pipeline chunk) and a state waiting for them."""

    iterators: list[WlbDataIterator] = field(default_factory=list)
    pending: dict[str, Any] | None = None
    pending_iteration: int | None = None
    #: data-stream restarts in this training's history (``--wlb-reset-data-stream``), saved with every sidecar
    data_stream_resets: int = 0
    #: the last restart (``reset_record``), saved with every sidecar
    data_stream_reset: dict[str, Any] | None = None
    #: this run's datasets' digests (``agreement.RunFingerprint.datasets``), saved with every sidecar
    fingerprint: dict[str, str] | None = None
    #: the resumed checkpoint's (None: a fresh start, a reset data stream, or a sidecar before version 4)
    saved_fingerprint: dict[str, str] | None = None

    def register(self, iterator: WlbDataIterator) -> None:
        """Track ``iterator``; restore a state loaded earlier into it."""
        if self.pending is not None:
            _restore(iterator, self.pending, self.pending_iteration)
        self.iterators.append(iterator)

    def state(self) -> dict[str, Any] | None:
        """The data state to save: the one every chunk iterator that has been read holds (checked). A chunk
        iterator nobody reads (a middle-stage chunk of an unpatched ``get_batch``) stays at its start and is
        left out; the chunks that read must agree."""
        if not self.iterators:
            return None
        used = [it for it in self.iterators if it.packer.iteration > 0] or self.iterators[:1]
        states = [it.state_dict() for it in used]
        first = dumps_state(states[0])
        if any(dumps_state(s) != first for s in states[1:]):
            raise RuntimeError("the training iterators of this rank's pipeline chunks disagree on the data state; "
                               "each chunk must read every micro-batch of the iteration")
        return states[0]

    def set_pending(self, state: dict[str, Any], iteration: int) -> None:
        self.pending = state
        self.pending_iteration = iteration
        for it in self.iterators:
            _restore(it, state, iteration)


#: Megatron's flag of each size a cost model's layout names (``ParallelLayout``)
LAYOUT_FLAGS = {"TP": "--tensor-model-parallel-size", "CP": "--context-parallel-size",
                "PP": "--pipeline-model-parallel-size", "EP": "--expert-model-parallel-size"}


def relayout_refusal(iteration: int | None, saved: str, now: str) -> str:
    """The one-line refusal of a checkpoint planned on the layout ``saved`` resumed on ``now`` (another TP, CP,
    PP or EP: e.g. a dynamic-CP pool of DP2 x CP2 resumed as DP4 x CP1): what changed and what resumes."""
    sizes = [dict(re.findall(r"([A-Z]+)(\d+)", name)) for name in (saved, now)]
    flags = " ".join(f"{flag} {sizes[0][key]}" for key, flag in LAYOUT_FLAGS.items()
                     if key in sizes[0] and sizes[0][key] != sizes[1].get(key, "1"))
    return (f"megatron_wlb: the checkpoint at iteration {iteration} was planned on the layout {saved}, this run is "
            f"{now}: its packer's queues and plans are priced for that layout; resume on it ({flags}, any DP size "
            f"at the same global batch), or pass {RESET_FLAG} to restart the data stream on this layout (the "
            "optimizer, iteration and LR schedule resume)")


def _restore(iterator: WlbDataIterator, state: dict[str, Any], iteration: int | None) -> None:
    """``iterator.load_state_dict(state)``; a state this run cannot continue is refused in one line."""
    try:
        iterator.load_state_dict(state)
    except LayoutChanged as exc:
        raise StartupError(relayout_refusal(iteration, exc.saved, exc.now)) from None
    except ValueError as exc:
        raise exc if isinstance(exc, Refusal) else StartupError(
            f"megatron_wlb: cannot resume the checkpoint at iteration {iteration}: {exc}") from None


def wrap_save_checkpoint(original: Callable, registry: DataStateRegistry, get_args: Callable[[], Any],
                         is_writer: Callable[[], bool], settings: Callable[[], dict | None] = lambda: None,
                         log: Callable[[str], None] = print) -> Callable:
    """Megatron's ``save_checkpoint(iteration, model, optimizer, ...)``, then our sidecar. With Megatron's own
    samples (``--wlb-pieces concat-and-cut``) it also says how many of their tokens wait in the packer: a
    run resumed from this checkpoint without our flags (Megatron's sampler, from consumed_train_samples)
    would skip them."""

    @wrapping(original)
    def save_checkpoint(iteration, *args, **kwargs):
        out = original(iteration, *args, **kwargs)
        state = registry.state()
        if state is not None and is_writer():
            a = MegatronArgs.of(get_args())
            save_dir = a.save or ""
            if kwargs.get("non_persistent_ckpt"):
                if a.non_persistent_ckpt_type == "global":
                    save_dir = a.non_persistent_global_ckpt_dir or os.path.join(save_dir, "non_persistent")
                else:  # local (per-node) checkpoints: keep the sidecar beside the persistent ones
                    save_dir = os.path.join(save_dir, "wlb_non_persistent_local")
            save_data_state(iteration_dir(save_dir, iteration, kwargs.get("release", False)), iteration, state,
                            settings(), registry.data_stream_resets, registry.data_stream_reset, registry.fingerprint)
            if str(state.get("stream_digest", "")).startswith("samples:"):
                waiting = int(registry.iterators[0].packer.pending())
                log(f"> megatron_wlb: checkpoint at iteration {iteration}: {waiting} tokens of Megatron's samples wait "
                    "in the packer (resumed with --wlb-pieces concat-and-cut they are trained; resumed without it, "
                    "from consumed_train_samples, they would be skipped)")
        return out

    return save_checkpoint


def candidate_dirs(a: MegatronArgs, iteration: int) -> list[str]:
    """Where the checkpoint of ``iteration`` (``--load``) may live (persistent, non-persistent global/local,
    release)."""
    load_dir = a.load
    if not load_dir:
        return []
    global_dir = a.non_persistent_global_ckpt_dir or os.path.join(load_dir, "non_persistent")
    roots = [load_dir, global_dir, os.path.join(a.save or load_dir, "wlb_non_persistent_local")]
    dirs = [iteration_dir(r, iteration) for r in roots if r]
    dirs.append(iteration_dir(load_dir, iteration, release=True))
    return dirs


#: settings that may change on resume (they do not shape the plan)
RESUMABLE_SETTINGS = frozenset({"log_interval", "trace"})


def settings_difference(saved: dict[str, Any] | None, now: dict[str, Any] | None,
                        seq_len: int | None = None) -> list[str]:
    """``name: saved -> now`` for every plan-shaping setting that differs (empty when either is unknown).

    ``max_seq_len`` None is 1.5 x ``seq_len`` (``resolved_knobs``); the preset is not compared, the knob values it
    resolved to are."""
    if not saved or not now:
        return []
    saved, now = resolved_knobs(saved, seq_len), resolved_knobs(now, seq_len)
    saved.pop("preset", None)
    now.pop("preset", None)
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if k not in RESUMABLE_SETTINGS and saved.get(k) != now.get(k)]


def _seq_len(a: MegatronArgs) -> int | None:
    return int(a.seq_length) if a.seq_length else None


#: the flag that restarts only the data stream on resume (optimizer, iteration and LR schedule are kept)
RESET_FLAG = "--wlb-reset-data-stream"


def micro_batches_per_rank(a: MegatronArgs) -> tuple[int, int]:
    """(DP size, micro-batches per DP rank per iteration) of Megatron's ``args``."""
    gbs, mbs = int(a.global_batch_size or 0), int(a.micro_batch_size or 1)
    return a.dp, max(1, gbs // (mbs * a.dp))


def plan_layout_refusal(data_state: dict[str, Any], margs: Any) -> str | None:
    """Why the checkpoint's plans cannot continue on this run's layout (Megatron's ``args`` or their view), with
    the exact remedy (None if they can: the same number of micro-batches per iteration, whatever the DP size)."""
    a = MegatronArgs.of(margs)
    saved = (data_state.get("packer") or {}).get("config") or {}
    if "dp" not in saved or not a.global_batch_size:
        return None
    dp, n = micro_batches_per_rank(a)
    planned = int(saved["dp"]) * int(saved["n"])
    if planned == dp * n:
        return None
    mbs = int(a.micro_batch_size or 1)
    return (f"the checkpoint planned {planned} micro-batches per iteration (DP {saved['dp']} x {saved['n']}), this "
            f"run {dp * n} (DP {dp} x {n}): resume with --global-batch-size {planned * mbs} (now "
            f"{a.global_batch_size}), which any DP size dividing {planned} continues exactly, "
            f"or pass {RESET_FLAG} to restart the data stream at its first document")


def reset_record(iteration: int, a: MegatronArgs) -> dict[str, Any]:
    """What the sidecar keeps of a ``--wlb-reset-data-stream``: the iteration it took effect at and Megatron's
    data flags it was given with (JSON values)."""
    flags = {"data_path": a.data_path, "train_data_path": a.train_data_path, "valid_data_path": a.valid_data_path,
             "test_data_path": a.test_data_path, "split": a.split, "seed": a.seed}
    return {"iteration": int(iteration), "data_flags": json.loads(json.dumps(flags, default=str))}


def stale_reset(payload: dict[str, Any], iteration: int, a: MegatronArgs, now: dict[str, Any] | None) -> str | None:
    """Why ``--wlb-reset-data-stream`` does not apply to this resume (None if it does): the checkpoint was saved
    after a reset given the same data flags and ``--wlb-*`` settings, and it resumes exactly without the flag
    (a flag left in a requeue script would otherwise retrain the stream's first documents on every restart)."""
    done = payload.get("data_stream_reset")
    if not isinstance(done, dict) or reset_record(done.get("iteration", -1), a) != done:
        return None
    if settings_difference(payload.get("settings"), now, _seq_len(a)) or plan_layout_refusal(payload["data"], a):
        return None
    return (f"the checkpoint at iteration {iteration} was saved after the data-stream reset at iteration "
            f"{done['iteration']} with these same data flags and --wlb-* settings, so its stream resumes where it "
            "stopped (a reset applies once: remove the flag from the job script)")


def missing_sidecar_refusal(load_dir: str, iteration: int, balanced: bool = False) -> str:
    """The one-line refusal of a checkpoint at ``iteration`` > 0 without a sidecar, naming the ``--ckpt-step`` of
    the newest earlier checkpoint that has one (a job killed between Megatron's save and ours leaves this).
    ``balanced``: the run reads Megatron's samples (``--wlb-pieces concat-and-cut``), where a reset continues from
    consumed_train_samples and drops only the pieces the packer held back."""
    earlier = newest_sidecar_before(load_dir, iteration)
    remedy = (f"resume from iteration {earlier}, the newest earlier checkpoint that holds one, with --ckpt-step "
              f"{earlier}" if earlier is not None else
              "resume from a checkpoint saved with megatron_wlb applied (--ckpt-step N), or start afresh without "
              "--load")
    reset = ("continue Megatron's samples from consumed_train_samples without the tokens the packer held back"
             if balanced else "restart the data stream at its first document")
    return (f"megatron_wlb: the checkpoint in {load_dir} resumes at iteration {iteration} but holds no "
            f"{SIDECAR_NAME}, so the packer's queues and stream position are unknown (a job stopped between "
            f"Megatron's save and ours leaves this): {remedy}; as a last resort pass {RESET_FLAG} to {reset} "
            "(the optimizer, iteration and LR schedule resume)")


def wrap_load_checkpoint(original: Callable, registry: DataStateRegistry, get_args: Callable[[], Any],
                         settings: Callable[[], dict | None] = lambda: None,
                         log: Callable[[str], None] = print,
                         saved_args: Callable[[str], Any | None] = saved_megatron_args) -> Callable:
    """Megatron's ``load_checkpoint(model, optimizer, scheduler, load_arg='load', ...)``, then our sidecar.

    Resuming at iteration > 0 without a sidecar is an error (the data position would be lost), and so is
    resuming with other ``--wlb-*`` settings than the checkpoint was saved with (the queues and thresholds
    it holds belong to those), named setting by setting, or with another number of micro-batches per
    iteration; another DP size at the same global batch resumes exactly (the saved plans, re-dealt).
    ``--wlb-reset-data-stream`` lifts all three: the data stream restarts at its first document with these
    settings, while Megatron keeps the optimizer, iteration and LR schedule (unlike ``--finetune``); the
    restarts are counted in the sidecar and logged. It applies once: resuming from a checkpoint saved after
    a reset given the same flags, it is ignored (logged; ``stale_reset``).
    """

    @wrapping(original)
    def load_checkpoint(*args, **kwargs):
        out = original(*args, **kwargs)
        iteration = int(out[0] if isinstance(out, tuple) else out)
        load_arg = kwargs.get("load_arg", args[3] if len(args) > 3 else "load")
        if iteration <= 0 or load_arg != "load":
            return out
        a = MegatronArgs.of(get_args())
        load_dir = a.load or ""
        payload = next((p for p in (load_data_state(d, iteration) for d in candidate_dirs(a, iteration))
                        if p is not None), None)
        reset = bool(a.wlb_reset_data_stream)
        stale = stale_reset(payload, iteration, a, settings()) if reset and payload is not None else None
        if stale:
            log(f"> megatron_wlb: {RESET_FLAG} ignored: {stale}")
            reset = False
        if reset:
            registry.data_stream_resets = int((payload or {}).get("data_stream_resets", 0)) + 1
            registry.data_stream_reset = reset_record(iteration, a)
            if (settings() or {}).get("pieces") == "concat-and-cut":  # Megatron's samples: its sampler's position
                waiting = waiting_pieces(payload)
                log(f"> megatron_wlb: {RESET_FLAG}: Megatron's samples continue from consumed_train_samples "
                    f"({int(a.consumed_train_samples or 0)}) at iteration {iteration}, planned "
                    f"afresh; the {sum(p[2] for p in waiting)} tokens of the {len(waiting)} pieces the checkpoint's "
                    f"packer held back are not trained (data-stream reset {registry.data_stream_resets} of this "
                    "training); optimizer, iteration and learning-rate schedule resume from the checkpoint")
                return out
            log(f"> megatron_wlb: {RESET_FLAG}: the data stream restarts at its first document at iteration "
                f"{iteration} (data-stream reset {registry.data_stream_resets} of this training); optimizer, "
                "iteration and learning-rate schedule resume from the checkpoint")
            return out
        balanced = (settings() or {}).get("pieces") == "concat-and-cut"
        if (payload is None and balanced and newest_sidecar_before(load_dir, iteration) is None
                and not any(saved_by_megatron_wlb(saved_args(d)) for d in candidate_dirs(a, iteration)
                            if os.path.isdir(d))):
            # neither an earlier sidecar nor the checkpoint's own saved args say the run was ours: a stock run, whose
            # samples the balanced mode continues (one that was ours stopped between Megatron's save and our
            # sidecar, the first checkpoint included: refused below, naming the step)
            log(f"> megatron_wlb: the checkpoint at iteration {iteration} holds no {SIDECAR_NAME} (a stock Megatron "
                "run): --wlb-pieces concat-and-cut continues with Megatron's samples from its consumed_train_samples "
                f"({int(a.consumed_train_samples or 0)})")
            return out
        if payload is None:
            raise RunRefusal(missing_sidecar_refusal(load_dir, iteration, balanced))
        registry.data_stream_resets = int(payload.get("data_stream_resets", 0))
        registry.data_stream_reset = payload.get("data_stream_reset")
        changed = settings_difference(payload.get("settings"), settings(), _seq_len(a))
        if changed:
            raise RunRefusal(f"megatron_wlb: the checkpoint at iteration {iteration} was saved with other "
                               f"WLB settings ({'; '.join(changed)}); resume with the saved --wlb-* flags, or pass "
                               f"{RESET_FLAG} to restart the data stream with the new ones (the optimizer, "
                               "iteration and LR schedule resume)")
        refusal = plan_layout_refusal(payload["data"], a)
        if refusal:
            raise RunRefusal(f"megatron_wlb: {refusal}")
        registry.saved_fingerprint = payload.get("fingerprint")
        registry.set_pending(payload["data"], iteration)
        return out

    return load_checkpoint
