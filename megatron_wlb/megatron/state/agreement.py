"""Plan agreement: every rank of the world trains the same global plan, checked every iteration.

Every rank builds its own reader and packer and relies on determinism to plan the same global
batch (``data.plan_digest``). A rank reading other data (a stale node-local copy of the corpus,
another preprocessing run) or other settings would train another plan silently: documents trained
twice, others skipped, or a hang inside a collective. ``check_plan_agreement`` compares a 62-bit
key of the plan over the whole world with one all-reduce (MIN of ``[key, -key]``: the smallest and
the largest key at once); only when they differ does it gather the plans and raise, on every rank,
one message naming the ranks of each plan and the first document that differs.

``wrap_train_step`` runs the check before Megatron's ``train_step``, where every rank is in step:
inside the pipeline schedule a world collective could deadlock against the stages' send/receive
pairs. The iterator plans the iteration there (``WlbDataIterator.prepare``), so the micro-batches
the schedule then reads are the ones agreed on.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_wlb.data.blend import parse_data_path
from megatron_wlb.data.fingerprint import dataset_fingerprint, file_sha256
from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.settings import FLAG_KNOBS, setting_source
from megatron_wlb.megatron.args.validation import RunRefusal
from megatron_wlb.megatron.data.device import training_device
from megatron_wlb.megatron.data.packed import plan_digest
from megatron_wlb.megatron.data.sample_agreement import SampleIdentity
from megatron_wlb.megatron.data.sample_agreement import describe_disagreement as describe_sample_disagreement
from megatron_wlb.megatron.data.sample_agreement import rank_ranges as _ranges
from megatron_wlb.megatron.hooks.rebind import wrapping
from megatron_wlb.packing.types import GlobalBatch

if TYPE_CHECKING:
    from megatron_wlb.megatron.args.settings import WlbSettings

#: keys are the first 62 bits of the plan's sha256: ``-key`` and the "no plan" key fit an int64
KEY_BITS = 62
NO_PLAN_KEY = (1 << KEY_BITS)  # a rank whose stream has ended (larger than every plan's key)

Piece = tuple[int, int, int, int]  # (micro-batch index, document id, offset, length)


def plan_key(batch: GlobalBatch | None) -> int:
    """The plan's agreement key: 62 bits of ``plan_digest`` (``NO_PLAN_KEY`` for no plan)."""
    if batch is None:
        return NO_PLAN_KEY
    return int(plan_digest(batch)[:16], 16) >> (64 - KEY_BITS)


def plan_pieces(batch: GlobalBatch | None) -> list[Piece]:
    """The plan as a flat list of (micro-batch, document, offset, length), in plan order."""
    if batch is None:
        return []
    return [(m, p.doc_id, p.offset, p.length) for m, mb in enumerate(batch.micro_batches) for p in mb.pieces]


def describe_disagreement(plans: Sequence[tuple[int, int, list[Piece]]]) -> str:
    """One line: which ranks planned what, and the first piece where each other plan leaves the
    first rank's. ``plans``: (iteration or -1 for none, key, pieces) per rank, rank order."""
    groups: dict[int, list[int]] = {}
    for rank, (_, key, _) in enumerate(plans):
        groups.setdefault(key, []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: ranks[0])
    reference = ordered[0][0]
    ref_iteration, _, ref_pieces = plans[reference]

    def where(rank: int, at: int) -> str:
        iteration, _, pieces = plans[rank]
        if iteration < 0:
            return f"no plan (its stream ended) on rank {rank}"
        if at >= len(pieces):
            return f"no piece there on rank {rank} (its plan ends)"
        m, doc, offset, length = pieces[at]
        return f"document {doc} (offset {offset}, {length} tokens, micro-batch {m}) on rank {rank}"

    def ranks_text(ranks: list[int]) -> str:
        return f"rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)}"

    parts = []
    for ranks in ordered[1:]:
        other = ranks[0]
        iteration, _, pieces = plans[other]
        at = next((i for i, (a, b) in enumerate(zip(ref_pieces, pieces)) if a != b),
                  min(len(ref_pieces), len(pieces)))
        if iteration != ref_iteration:
            parts.append(f"{ranks_text(ranks)} planned iteration {iteration}, {ranks_text(ordered[0])} "
                         f"iteration {ref_iteration}")
        else:
            parts.append(f"{ranks_text(ranks)} vs {ranks_text(ordered[0])}, first difference at piece {at}: "
                         f"{where(other, at)} vs {where(reference, at)}")
    iteration_text = f"iteration {ref_iteration}" if ref_iteration >= 0 else "the next iteration"
    return (f"megatron_wlb: the ranks planned {len(ordered)} different global batches for {iteration_text}: "
            f"{'; '.join(parts)}. Every rank must read the same data (the same --data-path files, not copies "
            "that differ), --split, --seed and --wlb-* settings")


#: an all-reduce slot no rank writes stays here (larger than every key and every negated key)
UNWRITTEN = (1 << 63) - 1

Layouts = Sequence[tuple[str, int]]  # (layout name, layout digest) per micro-batch of one DP rank


def layouts_key(layouts: Layouts) -> int:
    """A 62-bit key of one DP rank's CP layouts of an iteration (``WlbDataIterator.layouts``)."""
    h = hashlib.blake2b(digest_size=8)
    for name, digest in layouts:
        h.update(f"{name}:{digest};".encode())
    return int.from_bytes(h.digest(), "little") >> (64 - KEY_BITS)


def describe_layout_disagreement(iteration: int, dp_rank: int, every: Sequence[tuple[int, int, list]]) -> str:
    """One line: the first micro-batch the CP ranks of ``dp_rank`` laid out differently, and how each did.
    ``every``: (global rank, dp rank, [(layout name, digest), ...]) per rank of the world."""
    ranks = [(rank, layouts) for rank, dp, layouts in every if dp == dp_rank]
    at = next((m for m in range(max(len(layouts) for _, layouts in ranks))
               if len({tuple(layouts[m]) if m < len(layouts) else None for _, layouts in ranks}) > 1), 0)
    groups: dict[Any, list[int]] = {}
    for rank, layouts in ranks:
        groups.setdefault(tuple(layouts[at]) if at < len(layouts) else None, []).append(rank)
    hows = "; ".join(f"{'none' if key is None else f'{key[0]} (digest {key[1]:x})'} on ranks {_ranges(sorted(r))}"
                     for key, r in groups.items())
    return (f"megatron_wlb: the CP ranks of DP rank {dp_rank} laid out micro-batch {at} of iteration {iteration} "
            f"differently: {hows}. Each CP rank would compute tokens another also computes and skip others; every "
            "rank must use the same --wlb-cp-sharding and cost model (--wlb-cost-profile, --wlb-cost-model)")


def check_plan_agreement(batch: GlobalBatch | None, group: Any = None, device: Any = None, *, dp_rank: int = 0,
                         dp_size: int = 1, layouts: Layouts = (), samples: SampleIdentity | None = None) -> float:
    """Raise RuntimeError on every rank of ``group`` (default: the world) unless all planned ``batch``
    alike, the documents behind its pieces are the same on every rank (``samples``: Megatron's samples'
    ``SampleIdentity``, None for the document reader, whose stream ids are the documents) and the ranks of
    each DP rank laid out its micro-batches alike over CP (``layouts``: this rank's (name, digest) per
    micro-batch of the iteration; empty without CP); returns the seconds the check took. One all-reduce
    (MIN) of ``4 + 2 * dp_size`` int64 on the agreeing path: ``[key, -key]`` of the plan and of its
    samples' documents, then one such pair per DP rank, written by that DP rank's ranks only."""
    start = time.perf_counter()
    if device is None:
        device = training_device()
    key = plan_key(batch)
    content = samples.key(batch) if samples is not None else 0
    values = [UNWRITTEN] * (4 + 2 * dp_size)
    values[0], values[1], values[2], values[3] = key, -key, content, -content
    layout = layouts_key(layouts)
    values[4 + 2 * dp_rank], values[5 + 2 * dp_rank] = layout, -layout
    both = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    reduced = both.tolist()
    if reduced[0] != key or -reduced[1] != key:
        mine = (batch.iteration if batch is not None else -1, key, plan_pieces(batch))
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        raise RunRefusal(describe_disagreement(every))
    if reduced[2] != content or -reduced[3] != content:
        witnesses: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(witnesses, (content, samples.witness(batch) if samples is not None else
                                           {"rows": [], "files": {}, "prefixes": []}), group=group)
        raise RunRefusal(describe_sample_disagreement(batch.iteration if batch is not None else -1, witnesses))
    differing = [d for d in range(dp_size) if reduced[4 + 2 * d] != UNWRITTEN
                 and reduced[4 + 2 * d] != -reduced[5 + 2 * d]]
    if differing:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (dist.get_rank(), dp_rank, [list(x) for x in layouts]), group=group)
        raise RunRefusal(describe_layout_disagreement(batch.iteration if batch is not None else -1, differing[0],
                                                        gathered))
    return time.perf_counter() - start


# -- the start-up agreement: settings, cost model and datasets, before the first plan ---------------------
#: Megatron's flags that shape what is trained beside ours (the data flags are also in the plan); the training
#: length too: ranks that stop at different iterations would leave the others waiting in the next agreement
MEGATRON_PARTS = ("seed", "split", "seq_length", "global_batch_size", "micro_batch_size", "padded_vocab_size",
                  "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "dataloader_inter_document_masking",
                  "train_iters", "train_samples")
#: Megatron's flags naming datasets, in the order their parts are listed
DATA_PATH_ARGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
#: lengths of probe documents the cost model's fingerprint prices (one token to 128K)
COST_PROBE = (1, 64, 1024, 8192, 65536, 131072)


def _short(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def cost_fingerprint(cost: Any) -> str:
    """16 hex digits of what the cost model prices (its description and its prices of probe documents,
    bit for bit): equal exactly when the ranks balance and lay out with the same model."""
    if cost is None:
        return "none"

    probe = np.asarray(COST_PROBE, dtype=np.int64)
    hw = cost.hardware
    prices = np.concatenate([cost.workload(probe), cost.attention_run(probe, probe), cost.linear_compute(probe),
                             cost.size_cost(probe, probe),
                             [cost.microbatch_overhead, hw.bwd_attention, hw.bwd_linear]]).astype(np.float64)
    return _short(cost.describe().encode() + prices.tobytes())


#: the name of a dataset's ``.idx`` digest (sampled pages since issue 57; the whole file was ``.idx``)
IDX_PART = ".idx-pages"


def dataset_parts(args: Any) -> list[tuple[str, str, str]]:
    """``(part name, digest, file name)`` for every dataset Megatron's data flags name: the sampled ``.idx`` and
    ``.bin`` digests of each (``data.fingerprint``), named by flag and position (each rank may read its own copy
    at its own path, under its own name: only the digests are compared). The ``.idx`` part is ``IDX_PART``: a
    checkpoint whose sidecar holds the whole-file digest of before (part ``.idx``) is not compared on it."""
    parts: list[tuple[str, str, str]] = []
    a = MegatronArgs.of(args)
    for attr in DATA_PATH_ARGS:
        given = getattr(a, attr)
        if not given:
            continue
        for i, (prefix, _) in enumerate(parse_data_path(given)):
            where = f"--{attr.replace('_', '-')} #{i + 1}"
            if a.sft:  # a jsonl of conversations (Megatron's SFT data): the whole file's digest
                parts.append((f"{where} .jsonl", file_sha256(prefix)[:16], os.path.basename(prefix)))
                continue
            found, name = dataset_fingerprint(prefix), os.path.basename(prefix)
            parts += [(f"{where} {IDX_PART}", found["idx"][:16], name), (f"{where} .bin", found["bin"][:16], name)]
    return parts


@dataclass(frozen=True)
class RunFingerprint:
    """What every rank of a job must start with alike, as named parts: ``--wlb-*`` settings and the packer's
    resolved config, Megatron's flags that shape the samples, the cost model and its profile's content, and
    every dataset's digests. ``key`` is what the ranks compare; the parts name what differs; ``files`` names
    the file each dataset part read (shown, not compared)."""
    parts: tuple[tuple[str, str], ...]
    files: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> int:
        return int(_short(json.dumps(self.parts)), 16) >> (64 - KEY_BITS)

    def datasets(self) -> dict[str, str]:
        """The dataset parts (what a resume compares against the checkpoint's)."""
        return {name: value for name, value in self.parts if name.startswith(tuple(f"--{a.replace('_', '-')} #"
                                                                                    for a in DATA_PATH_ARGS))}


def run_fingerprint(args: Any, settings: WlbSettings, config: Any, cost: Any,
                    datasets: Sequence[tuple[str, str, str]]) -> RunFingerprint:
    """This rank's ``RunFingerprint`` (``config``: the resolved ``PackingConfig``; ``datasets``: ``dataset_parts``)."""
    parts = [("--wlb-packer", settings.packer), ("--wlb-cp-sharding", settings.cp_sharding),
             ("--wlb-log-interval", str(settings.log_interval)), ("--wlb-trace", "on" if settings.trace else "off"),
             ("sft.samples", settings.sft_samples)]
    for name, value in sorted(asdict(config).items()):
        flag = setting_source(name) if name in FLAG_KNOBS else f"packing {name}"
        parts.append((flag, repr(value)))
    a = MegatronArgs.of(args)
    for name in MEGATRON_PARTS:
        parts.append((f"--{name.replace('_', '-')}", repr(getattr(a, name))))
    profile = settings.cost_profile
    parts.append(("--wlb-cost-profile (content)", _short(Path(profile).read_bytes()) if profile else "none"))
    parts.append(("cost model", cost_fingerprint(cost)))
    parts += [(name, digest) for name, digest, _ in datasets]
    return RunFingerprint(tuple(parts), tuple((name, file) for name, _, file in datasets))


def describe_fingerprint_disagreement(every: Sequence[RunFingerprint]) -> str:
    """One line naming each part that differs between the ranks (``every``: each rank's fingerprint, rank
    order) and which ranks hold which value (with the file it read, for a dataset)."""
    tables = [dict(f.parts) for f in every]
    files = [dict(f.files) for f in every]
    names = [name for name, _ in every[0].parts] + sorted({n for t in tables[1:] for n in t} - set(tables[0]))
    clauses = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, table in enumerate(tables):
            shown = table.get(name, "(none)") + (f" ({files[rank][name]})" if name in files[rank] else "")
            holders.setdefault(shown, []).append(rank)
        if len({table.get(name) for table in tables}) > 1:  # the values differ (not only the files' names)
            clauses.append(f"{name}: " + ", ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {_ranges(r)}"
                                                    for value, r in holders.items()))
    datasets = any(" .bin" in c or " .idx" in c or " .jsonl" in c for c in clauses)
    hint = (" A dataset's digests differ where a rank reads another copy (a stale or re-tokenised one, or a copy "
            "interrupted midway): give every rank identical files." if datasets else "")
    return (f"megatron_wlb: the ranks start with different settings or data, so they would train different plans, "
            f"lay them out differently or wait in different collectives: {'; '.join(clauses)}. Every rank must get "
            f"the same flags and files.{hint}")


def check_startup_agreement(fingerprint: RunFingerprint, group: Any = None, device: Any = None) -> float:
    """Raise RuntimeError on every rank of ``group`` (default: the world) unless every rank's
    ``fingerprint`` is the same, naming each part that differs; returns the seconds the check took (one
    all-reduce of two int64 on the agreeing path)."""
    start = time.perf_counter()
    if device is None:
        device = training_device()
    key = fingerprint.key
    both = torch.tensor([key, -key], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    lowest, highest = both.tolist()
    if lowest != key or -highest != key:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, fingerprint, group=group)
        raise RunRefusal(describe_fingerprint_disagreement(every))
    return time.perf_counter() - start


def resume_data_refusal(saved: dict[str, str] | None, now: RunFingerprint, iteration: int) -> str | None:
    """Why this run's datasets are not the ones the checkpoint at ``iteration`` trained on (None if they are, or
    the checkpoint predates fingerprints): the parts present in both that differ."""
    if not saved:
        return None
    mine, files = now.datasets(), dict(now.files)
    changed = [f"{name}: {saved[name]} -> {mine[name]} ({files.get(name, '?')})" for name in saved
               if name in mine and mine[name] != saved[name]]
    if not changed:
        return None
    kinds = {name.rsplit(" ", 1)[-1] for name in saved if name in mine and mine[name] != saved[name]}
    legend = "; ".join(text for kind, text in ((".jsonl", ".jsonl: the whole file"),
                                                 (IDX_PART, f"{IDX_PART}: its size and sampled pages"),
                                                 (".bin", ".bin: sampled pages")) if kind in kinds)
    return (f"megatron_wlb: the data differs from what the checkpoint at iteration {iteration} trained on "
            f"({'; '.join(changed)}; {legend}): resume on the same files (a copy of them must be identical), or pass "
            "--wlb-reset-data-stream to restart the data stream on these")


def wrap_train_step(original: Callable, first_iterator: Callable[[], Any],
                    on_checked: Callable[[float], None] = lambda seconds: None) -> Callable:
    """Megatron's ``train_step``, after planning this iteration (``first_iterator()``: the first
    training ``WlbDataIterator`` of this rank, or None) and checking the plan over the world."""

    @wrapping(original)
    def train_step(*args, **kwargs):
        iterator = first_iterator()
        if iterator is not None:
            batch = iterator.prepare()
            on_checked(check_plan_agreement(batch, dp_rank=iterator.dp_rank, dp_size=iterator.dp_size,
                                            layouts=iterator.layouts if batch is not None else (),
                                            samples=iterator.sample_identity))
        return original(*args, **kwargs)

    return train_step


__all__ = ["RunFingerprint", "check_plan_agreement", "check_startup_agreement", "cost_fingerprint", "dataset_parts",
           "describe_disagreement", "describe_fingerprint_disagreement", "describe_layout_disagreement", "layouts_key",
           "plan_key", "plan_pieces", "resume_data_refusal", "run_fingerprint", "wrap_train_step"]
