"""Megatron GPTDataset's training order at piece level: the samples its sampler gives, cut into pieces.

Megatron's ``GPTDataset`` lays its split's documents back to back in ``document_index`` order (a
``numpy.random.RandomState(seed)`` shuffle over the epochs), cuts that stream every ``seq_length``
tokens into samples (``sample_index``: the (document position, offset) where each sample starts; a
sample reads ``seq_length + 1`` tokens, the last one only as the label of its last input) and
visits the samples in ``shuffle_index`` order; ``BlendedDataset`` takes sample ``j`` of a blend
from dataset ``dataset_index[j]``, its sample ``dataset_sample_index[j]``. ``MegatronPretrainingSampler``
gives iteration ``i`` the samples at training positions ``[i * global_batch, (i + 1) * global_batch)``.

The balanced concat-and-cut mode trains exactly those samples. This module turns megatron-core's
own index arrays (read, never rebuilt here) into the samples' *pieces*: the runs of a sample's input
tokens that attend only among themselves (one per document the sample touches). A stream of pieces
in training order is what the packers read (``SamplePieceCursor``, a ``packing.base.StreamSource``):
each sample's pieces sum to ``seq_length`` tokens, so one iteration's budget (``global_batch *
seq_length`` tokens) is exactly one global batch of samples, and the packer only regroups them.

A piece's stream id is ``position * seq_length + start``: the sample's training position and the
piece's first input token in it (``piece_sample``). Pure numpy: no torch, no megatron-core.

    sample j (seq_length 8):  doc 4 [.. a b c] | doc 9 [d e f g h ..]
    inputs   a b c d e f g h      labels  b c <eod> e f g h i   (i: the sample's 9th token)
    pieces   (j*8+0, len 3)  (j*8+3, len 5)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_wlb.data.window import MovingWindow

#: sample positions -> (pieces per sample, every piece's length, in order): how a sample is cut
SegmentFn = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
#: samples a cursor cuts at a time (its window grows by about this many samples' pieces)
SAMPLE_CHUNK = 1024


@dataclass(frozen=True)
class GptIndices:
    """One megatron-core ``GPTDataset``'s three index arrays and its documents' lengths
    (``dataset.sequence_lengths``: GPT datasets split by sequence, one sequence a document)."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    sizes: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.shuffle_index.shape[0])


@dataclass(frozen=True)
class SampleOrder:
    """The training order of a Megatron train split: its datasets' indices and, for a blend,
    ``BlendedDataset``'s ``dataset_index`` / ``dataset_sample_index`` (None: one dataset)."""

    datasets: tuple[GptIndices, ...]
    seq_len: int
    dataset_index: np.ndarray | None = None
    dataset_sample_index: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if not self.datasets:
            raise ValueError("SampleOrder needs at least one dataset's indices")
        if (self.dataset_index is None) != (self.dataset_sample_index is None):
            raise ValueError("a blend needs both dataset_index and dataset_sample_index")
        if self.dataset_index is None and len(self.datasets) != 1:
            raise ValueError(f"{len(self.datasets)} datasets without a blend's dataset_index")

    def __len__(self) -> int:
        if self.dataset_index is not None:
            return int(self.dataset_index.shape[0])
        return self.datasets[0].num_samples

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Training positions -> (dataset, that dataset's sample index before its shuffle)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= len(self)):
            raise ValueError(f"sample positions {int(positions.min())}..{int(positions.max())} are outside the "
                             f"{len(self)} samples Megatron built")
        if self.dataset_index is None:
            return np.zeros(positions.size, dtype=np.int64), positions
        assert self.dataset_sample_index is not None
        return (np.asarray(self.dataset_index[positions], dtype=np.int64),
                np.asarray(self.dataset_sample_index[positions], dtype=np.int64))

    def document_pieces(self, positions: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The input tokens of the samples at ``positions``, cut at document boundaries, as GPTDataset
        reads them: (pieces per sample, then each piece's dataset, document (sequence id in its
        ``.idx``), offset in the document and length), sample after sample. Each sample's pieces
        hold ``seq_len`` tokens (train samples are whole: Megatron drops the last partial one)."""
        datasets, samples = self.locate(positions)
        counts = np.zeros(datasets.size, dtype=np.int64)
        parts: list[tuple[np.ndarray, ...]] = []
        order = np.zeros(0, dtype=np.int64)
        for d, idx in enumerate(self.datasets):
            mine = np.flatnonzero(datasets == d)
            if not mine.size:
                continue
            shuffled = np.asarray(idx.shuffle_index[samples[mine]], dtype=np.int64)
            beg = np.asarray(idx.sample_index[shuffled], dtype=np.int64)
            end = np.asarray(idx.sample_index[shuffled + 1], dtype=np.int64)
            n_docs = end[:, 0] - beg[:, 0] + 1
            which = np.repeat(np.arange(mine.size), n_docs)
            at = np.arange(int(n_docs.sum())) - np.repeat(np.cumsum(n_docs) - n_docs, n_docs)
            pos = beg[which, 0] + at
            doc = np.asarray(idx.document_index[pos], dtype=np.int64)
            first, last = at == 0, pos == end[which, 0]
            start = np.where(first, beg[which, 1], 0)
            stop = np.where(last, end[which, 1], np.asarray(idx.sizes[doc], dtype=np.int64))
            keep = stop > start  # a sample ending at a document's first token reads it only as a label
            counts[mine] = np.bincount(which[keep], minlength=mine.size)
            parts.append((np.full(int(keep.sum()), d, dtype=np.int64), doc[keep], start[keep], (stop - start)[keep]))
            order = np.concatenate([order, np.repeat(mine, np.bincount(which[keep], minlength=mine.size))])
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return counts, empty, empty, empty, empty
        # back to training order (stable: a sample's pieces keep their order)
        perm = np.argsort(order, kind="stable")
        flat = [np.concatenate([p[k] for p in parts])[perm] for k in range(4)]
        return counts, flat[0], flat[1], flat[2], flat[3]

    def segments(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``SegmentFn`` at document boundaries (GPTDataset's ``--dataloader-inter-document-masking``)."""
        counts, _, _, _, lengths = self.document_pieces(positions)
        return counts, lengths


def piece_sample(stream_id: int, seq_len: int) -> tuple[int, int]:
    """A piece's stream id -> (training position of its sample, its first input token in the sample)."""
    position, start = divmod(int(stream_id), int(seq_len))
    return position, start


class SamplePieceCursor(MovingWindow):
    """The pieces of samples ``first_sample .. end_sample - 1``, in training order, as a
    ``StreamSource`` (``window(start, stop)`` by piece position). ``skip`` drops the first pieces
    of ``first_sample`` and ``position`` is the stream position of the first piece kept (a resumed
    packer reads on from its saved position). Samples are cut a chunk at a time."""

    def __init__(self, segment: SegmentFn, seq_len: int, first_sample: int, end_sample: int, *,
                 position: int = 0, skip: int = 0, chunk: int = SAMPLE_CHUNK, fingerprint: str = ""):
        super().__init__(position)
        self.segment = segment
        self.fingerprint = fingerprint
        self.seq_len = int(seq_len)
        self.next_sample = int(first_sample)
        self.end_sample = int(end_sample)
        self.chunk = int(chunk)
        self._skip = int(skip)
        self.piece_in_sample = np.zeros(0, dtype=np.int64)

    def generate(self) -> bool:
        """Cut the next chunk of samples into the window; False past the last sample."""
        if self.next_sample >= self.end_sample:
            return False
        positions = np.arange(self.next_sample, min(self.end_sample, self.next_sample + self.chunk), dtype=np.int64)
        counts, lengths = self.segment(positions)
        counts, lengths = np.asarray(counts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if counts.size != positions.size or int(counts.sum()) != lengths.size:
            raise ValueError(f"the segment function cut {counts.size} samples into {lengths.size} pieces for "
                             f"{positions.size} samples and {int(counts.sum())} pieces counted")
        sums = np.bincount(np.repeat(np.arange(counts.size), counts), weights=lengths, minlength=counts.size)
        bad = np.flatnonzero((counts < 1) | (sums != self.seq_len))
        if bad.size:
            raise ValueError(f"sample {int(positions[bad[0]])} cuts into pieces of {int(sums[bad[0]])} tokens, not "
                             f"--seq-length {self.seq_len}: the sample source is not Megatron's train split")
        sums = sums.astype(np.int64)
        sample = np.repeat(positions, counts)
        k = np.arange(lengths.size) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = np.cumsum(lengths) - lengths - np.repeat(np.cumsum(sums) - sums, counts)
        ids = sample * self.seq_len + starts
        if self._skip:
            ids, lengths, k = ids[self._skip:], lengths[self._skip:], k[self._skip:]
            self._skip = 0
        self.ids = np.concatenate([self.ids, ids])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.piece_in_sample = np.concatenate([self.piece_in_sample, k])
        self.next_sample = int(positions[-1]) + 1
        return True

    def _drop(self, count: int) -> None:
        super()._drop(count)
        self.piece_in_sample = self.piece_in_sample[count:].copy()

    def anchor(self, position: int) -> tuple[int, int]:
        """(training position of the sample, index of the piece in it) of the piece at stream
        ``position`` (the next sample's first piece when ``position`` is past every piece cut)."""
        self.window(position, position + 1)
        at = position - self.start
        if at >= self.ids.size:
            return self.next_sample, 0
        return int(self.ids[at]) // self.seq_len, int(self.piece_in_sample[at])

    def digest(self, position: int) -> str:
        """Where stream ``position`` lies: ``samples:<fingerprint>:<position>:<sample>:<piece>``
        (``SampleStream.resume_cursor`` opens a cursor there)."""
        sample, piece = self.anchor(position)
        return f"samples:{self.fingerprint}:{int(position)}:{sample}:{piece}"


class SampleStream:
    """Megatron's train samples from ``first_sample`` on, as a stream of pieces (what
    ``megatron.data.WlbDataIterator`` reads instead of a ``reader.DocumentStream``).

    ``fingerprint`` names the sample order (megatron-core's ``unique_description_hash`` of the
    dataset); ``digest(position)`` of a cursor is that fingerprint with the sample and piece at
    ``position``, so a checkpoint resumes by opening a cursor there (``resume_cursor``) without
    cutting the samples before it again."""

    def __init__(self, segment: SegmentFn, seq_len: int, first_sample: int, end_sample: int, fingerprint: str,
                 chunk: int = SAMPLE_CHUNK):
        if not 0 <= first_sample <= end_sample:
            raise ValueError(f"first sample {first_sample} is outside the {end_sample} samples Megatron built; "
                             "resume with the data flags and --train-iters / --train-samples of the saved run")
        self.segment = segment
        self.seq_len = int(seq_len)
        self.first_sample = int(first_sample)
        self.end_sample = int(end_sample)
        self.fingerprint = fingerprint
        self.chunk = int(chunk)

    @property
    def requested_tokens(self) -> int:
        return (self.end_sample - self.first_sample) * self.seq_len

    def cursor(self) -> SamplePieceCursor:
        return SamplePieceCursor(self.segment, self.seq_len, self.first_sample, self.end_sample, chunk=self.chunk,
                                 fingerprint=self.fingerprint)

    def digest(self, position: int) -> str:
        """``SamplePieceCursor.digest`` from the stream's start (cuts the samples before ``position``)."""
        return self.cursor().digest(position)

    def resume_cursor(self, position: int, digest: str,
                      same_order: Callable[[int], bool | None] | None = None) -> SamplePieceCursor:
        """A cursor whose piece ``position`` is the one ``digest`` names. A checkpoint of another dataset
        description (megatron-core names its samples by their number too: a longer ``--train-iters`` is another
        description) resumes when ``same_order(sample)`` says that this run's samples before the saved one are
        the checkpoint's (None: the checkpoint cannot tell); else it is refused."""
        parts = str(digest).split(":")
        if len(parts) != 5 or parts[0] != "samples" or int(parts[2]) != int(position):
            raise ValueError(f"the checkpoint's data position {digest!r} was not saved from Megatron's samples "
                             "(--wlb-pieces concat-and-cut); resume with the --wlb-pieces it was saved with")
        sample, piece = int(parts[3]), int(parts[4])
        if parts[1] != self.fingerprint:
            same = same_order(sample) if same_order is not None and sample <= self.end_sample else None
            if not same:
                why = ("its samples before the saved one (sample " + str(sample) + ") are not this run's" if same
                       is not None else "it recorded no witness of its sample order to compare with")
                raise ValueError(f"the checkpoint trained Megatron samples of dataset {parts[1]}, this run builds "
                                 f"{self.fingerprint}, and {why} (megatron-core orders the samples anew when the "
                                 "files, --split, --seed, --seq-length, tokenizer or the epochs that --train-iters / "
                                 "--train-samples need change): resume with the saved flags, or pass "
                                 "--wlb-reset-data-stream (Megatron's samples then continue at consumed_train_samples "
                                 "of this run's order)")
        return SamplePieceCursor(self.segment, self.seq_len, sample, self.end_sample, position=int(position),
                                 skip=piece, chunk=self.chunk, fingerprint=self.fingerprint)


def order_fingerprint(*parts: object) -> str:
    """A short stable name for a sample order built from ``parts`` (tests, length-only orders)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]
