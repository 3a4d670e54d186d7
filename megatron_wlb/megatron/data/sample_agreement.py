"""What fills Megatron's samples, agreed every step (the balanced concat-and-cut intake, issue 49 item 1).

The plan agreement (``agreement.check_plan_agreement``) compares each piece's stream id, offset and
length. With Megatron's own samples a piece's stream id is the sample's training position, not the
document in it: ranks whose GPTDataset index caches differ (a copied ``--data-cache-path`` whose
``shuffle_index.npy`` swaps two one-document samples) plan the same pieces, pass every check and train
other samples. ``SampleIdentity`` keys, per step, the documents megatron-core's index arrays put at
the step's training positions (dataset, ``.idx`` document, offset, length of every piece, from this
rank's ``document_index`` / ``sample_index`` / ``shuffle_index``: a blend's ``dataset_index`` /
``dataset_sample_index`` too): a cost of a global batch's samples per step, none at start-up, whatever
the corpus size. When the keys differ every rank gathers each rank's view of the first position that
differs and stops with one line naming the ranks, the index array that differs and each rank's cache file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_wlb.data.samples import SampleOrder, piece_sample
from megatron_wlb.megatron.data.gpt_samples import sample_order
from megatron_wlb.packing.types import GlobalBatch

#: bits of a key (as the plan agreement's: ``-key`` fits an int64)
KEY_BITS = 62
#: the index arrays a position's documents come from, in the order a lookup reads them
BLEND_ARRAYS = ("dataset_index", "dataset_sample_index")
GPT_ARRAYS = ("shuffle_index", "sample_index", "document_index")


def index_cache_files(dataset: Any) -> dict[str, list[str]]:
    """Each index array's ``.npy`` file per dataset of ``dataset`` (a ``GPTDataset``, or a ``BlendedDataset``
    of them), where megatron-core reads it: ``--data-cache-path`` (or ``PREFIX``'s ``cache/`` folder without
    one) / ``<description hash>-<class>-<split>-<array>.npy``."""
    def files(d: Any, arrays: Sequence[str]) -> dict[str, str]:
        folder = d.config.path_to_cache or os.path.join(getattr(getattr(d, "dataset", None), "path_prefix", "."),
                                                        "cache", f"{type(d).__name__}_indices")
        base = f"{d.unique_description_hash}-{type(d).__name__}-{d.index_split.name}"
        return {name: os.path.join(folder, f"{base}-{name}.npy") for name in arrays}

    parts = list(dataset.datasets) if hasattr(dataset, "dataset_index") else [dataset]
    out: dict[str, list[str]] = {name: [files(p, GPT_ARRAYS)[name] for p in parts] for name in GPT_ARRAYS}
    if hasattr(dataset, "dataset_index"):
        out.update({name: [path] for name, path in files(dataset, BLEND_ARRAYS).items()})
    return out


class SampleIdentity:
    """Keys and witnesses of what megatron-core's index arrays put at a plan's training positions."""

    def __init__(self, dataset: Any, seq_len: int):
        self.dataset = dataset
        self.seq_len = int(seq_len)
        self._order: SampleOrder | None = None

    @property
    def order(self) -> SampleOrder:
        if self._order is None:
            self._order = sample_order(self.dataset)
        return self._order

    def positions(self, batch: GlobalBatch | None) -> np.ndarray:
        """The training positions of the samples ``batch``'s pieces come from (sorted, once each)."""
        if batch is None:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.asarray([piece_sample(p.doc_id, self.seq_len)[0] for mb in batch.micro_batches
                                     for p in mb.pieces], dtype=np.int64))

    def key(self, batch: GlobalBatch | None) -> int:
        """62 bits of the documents (dataset, ``.idx`` document, offset, length of every piece) that this rank's
        index arrays put at ``batch``'s positions."""
        return self.positions_key(self.positions(batch))

    def positions_key(self, positions: np.ndarray) -> int:
        """62 bits of the documents this rank's index arrays put at training ``positions``."""
        h = hashlib.blake2b(np.ascontiguousarray(positions, dtype=np.int64).tobytes(), digest_size=8)
        for part in self.order.document_pieces(positions):
            h.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little") >> (64 - KEY_BITS)

    def order_witness(self, sample: int) -> dict[str, int]:
        """What a checkpoint saved at ``sample`` records of the sample order up to it (JSON-ready): the key of
        ``witness_positions(sample + 1)``, a fixed number of positions whatever the run's length."""
        end = min(int(sample) + 1, len(self.order))
        return {"end": end, "key": self.positions_key(witness_positions(end))}

    def same_order(self, witness: dict[str, int]) -> bool:
        """Whether this run's samples at a checkpoint's ``order_witness`` positions are the checkpoint's (a run
        extended with a larger ``--train-iters`` keeps megatron-core's order while its epochs do not change)."""
        end = int(witness["end"])
        return end <= len(self.order) and self.positions_key(witness_positions(end)) == int(witness["key"])


    def witness(self, batch: GlobalBatch | None) -> dict[str, Any]:
        """This rank's view of ``batch``'s positions (what ``describe_disagreement`` compares), JSON-ready:
        per position the index arrays' entries that decide its documents, and its documents."""
        order, rows = self.order, []
        positions = self.positions(batch)
        datasets, samples = order.locate(positions)
        counts, _, docs, offsets, _ = order.document_pieces(positions)
        at = np.concatenate([[0], np.cumsum(counts)])
        for k, (j, d, s) in enumerate(zip(positions.tolist(), datasets.tolist(), samples.tolist(), strict=True)):
            idx = order.datasets[d]
            shuffled = int(idx.shuffle_index[s])
            first, last = (int(v) for v in idx.sample_index[shuffled:shuffled + 2, 0])
            rows.append({"position": j, "dataset_index": d, "dataset_sample_index": s, "shuffle_index": shuffled,
                         "sample_index": [int(v) for v in np.ravel(idx.sample_index[shuffled:shuffled + 2])],
                         "document_index": [int(v) for v in idx.document_index[first:last + 1]],
                         "documents": [[int(a), int(b)] for a, b in zip(docs[at[k]:at[k + 1]],
                                                                        offsets[at[k]:at[k + 1]], strict=True)]})
        return {"rows": rows, "files": index_cache_files(self.dataset),
                "prefixes": [str(getattr(p.dataset, "path_prefix", "?")) for p in
                             (self.dataset.datasets if hasattr(self.dataset, "dataset_index") else [self.dataset])]}


#: training positions an order witness compares: spread over the samples read, and the last ones before the save
WITNESS_SPREAD, WITNESS_TAIL = 64, 64


def witness_positions(end: int) -> np.ndarray:
    """The positions below ``end`` an order witness keys: ``WITNESS_SPREAD`` evenly spaced from 0 and the last
    ``WITNESS_TAIL`` (a reshuffle moves nearly every sample, a changed split or seed every one)."""
    if end <= 0:
        return np.zeros(0, dtype=np.int64)
    spread = np.linspace(0, end - 1, min(end, WITNESS_SPREAD)).astype(np.int64)
    return np.union1d(spread, np.arange(max(0, end - WITNESS_TAIL), end, dtype=np.int64))

def describe_disagreement(iteration: int, every: Sequence[tuple[int, dict[str, Any]]]) -> str:
    """One line: the first training position whose documents differ, which ranks read which, the index array
    that decides it and each rank's cache file of that array. ``every``: (key, witness) per rank, rank order."""
    groups: dict[int, list[int]] = {}
    for rank, (key, _) in enumerate(every):
        groups.setdefault(key, []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: ranks[0])
    reference = every[ordered[0][0]][1]

    def who(ranks: list[int]) -> str:
        return f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}"

    def reads(row: dict[str, Any], witness: dict[str, Any]) -> str:
        prefix = os.path.basename(witness["prefixes"][row["dataset_index"]])
        return ", ".join(f"document {doc} (offset {off})" for doc, off in row["documents"]) + f" of {prefix}"

    parts, files = [], []
    for ranks in ordered[1:]:
        other = every[ranks[0]][1]
        found = next(((a, b) for a, b in zip(reference["rows"], other["rows"], strict=False) if a != b), None)
        if found is None:
            parts.append(f"{who(ranks)} planned other training positions than {who(ordered[0])}")
            continue
        a, b = found
        array = next((name for name in (*BLEND_ARRAYS, *GPT_ARRAYS) if a[name] != b[name]), "document_index")
        parts.append(f"at training position {a['position']} {who(ranks)} read {reads(b, other)}, "
                     f"{who(ordered[0])} {reads(a, reference)}: their GPTDataset {array} differs")
        for row, witness, holders in ((b, other, ranks), (a, reference, ordered[0])):
            paths = witness["files"].get(array, ["?"])
            shown = f"{paths[row['dataset_index'] if len(paths) > 1 else 0]} on {who(holders)}"
            if shown not in files:
                files.append(shown)
    where = f" (the cache files: {'; '.join(files)})" if files else ""
    return (f"megatron_wlb: the ranks planned the same pieces for iteration {iteration} but Megatron's samples "
            f"behind them differ: {'; '.join(parts)}{where}. Every rank must read the same GPTDataset index cache: "
            "give every rank the job's --data-cache-path, or remove the differing copy so that it is rebuilt")


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)
