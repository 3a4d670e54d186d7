"""Fine-tuning batches three ways, priced alike: Megatron's SFT grouping, KK by c*L + L^2, and a packer.

- Megatron's own grouping (``SFTDataset``): one jsonl line a sample of ``seq_len`` tokens, its conversations
  back to back (each padded to a multiple of 2*CP when CP > 1), the window padded at the end (the padding
  is part of the last conversation's ``cu_seqlens`` segment, so it is computed on), a line cut at the
  window (its later conversations dropped); ``MegatronPretrainingSampler`` deals sample ``k * dp + r`` of
  an iteration to DP rank ``r`` as its ``k``-th micro-batch (micro-batch size 1).
- KK (verl's ``get_seqlen_balanced_partitions``, slime): each iteration takes the next conversations up to
  the packer's token budget (``dp * n * seq_len``), splits them over the DP ranks by Karmarkar-Karp largest
  differencing on the work ``c * L + L^2`` (verl: ``c = 24576 = 6 * 4096``; here ``6 * hidden``), then each
  rank's over its ``n`` micro-batches the same way. No capacity: a micro-batch may exceed it (reported).
- A packer of ``packing`` (wlb, fixed-greedy, ...), over the same conversations in the same order.

Every method's batches are ``GlobalBatch`` es priced by the same cost model (``packing.metrics.summarize``):
the slowest DP rank's pipeline-schedule time over the balanced one, and trained tokens per second of it.
Pure: numpy and heapq.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_wlb.costmodel import CostModel
from megatron_wlb.packing import PackingConfig, make_packer
from megatron_wlb.packing.metrics import schedule_times, summarize
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch


def sft_window(conversations: Sequence[int], seq_len: int, cp: int = 1) -> tuple[list[int], int]:
    """(``cu_seqlens`` segment lengths, conversation tokens trained) of one ``SFTDataset`` sample holding a
    line's conversations of these lengths, as its ``__getitem__`` lays them out."""
    granule = 2 * cp if cp > 1 else 1
    segments: list[int] = []
    used = trained = 0
    for n in conversations:
        padded = -(-int(n) // granule) * granule
        if used + padded >= seq_len + 1:  # cut on the right; the line's later conversations are dropped
            trained += min(int(n), seq_len - used)
            segments.append(seq_len - used)
            return segments, trained
        segments.append(padded)
        used += padded
        trained += int(n)
    segments[-1] += seq_len - used  # the window's end padding joins the last segment
    return segments, trained


def megatron_sft_batches(lines: Sequence[Sequence[int]], seq_len: int, dp: int, n: int, cp: int = 1
                         ) -> tuple[list[GlobalBatch], int]:
    """Megatron's SFT samples (one a line, in order) as global batches of ``dp * n``, and the conversation
    tokens they train (padding excluded); a last partial global batch is left out."""
    batches: list[GlobalBatch] = []
    trained = 0
    per = dp * n
    for it in range(len(lines) // per):
        slots: list[MicroBatch | None] = [None] * per
        for j in range(per):
            segments, got = sft_window(lines[it * per + j], seq_len, cp)
            trained += got
            k, r = divmod(j, dp)  # the sampler deals micro-batch k of DP rank r
            slots[r * n + k] = MicroBatch(tuple(DocPiece(it * per + j, 0, s, it) for s in segments), seq_len)
        batches.append(GlobalBatch(it, tuple(mb for mb in slots if mb is not None), dp, n))
    return batches, trained


def karmarkar_karp(weights: Sequence[float] | np.ndarray, k: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` groups of near-equal sums by largest differencing (Karmarkar-Karp,
    as verl's ``karmarkar_karp`` with ``equal_size=False``): every item starts as a k-tuple with itself in one
    group; the two tuples of largest spread merge, heaviest group with lightest, until one is left."""
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(weights):
        groups = [(float(w), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(w), i, groups))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, tie, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda g: -g[0])
        b = sorted(b, key=lambda g: g[0])
        merged = [(a[j][0] + b[j][0], a[j][1] + b[j][1]) for j in range(k)]
        sums = [g[0] for g in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, merged))
    return sorted((sorted(g[1]) for g in heap[0][2]), key=lambda g: g[0] if g else -1)


def kk_batches(lengths: np.ndarray, seq_len: int, dp: int, n: int, coefficient: float, budget: int,
               iterations: int) -> list[GlobalBatch]:
    """KK by ``coefficient * L + L^2``: each iteration the next conversations up to ``budget`` tokens, over DP
    ranks, then over each rank's ``n`` micro-batches (capacity: the largest one's tokens, none enforced)."""
    batches: list[GlobalBatch] = []
    at = 0
    lengths = np.asarray(lengths, dtype=np.int64)
    for it in range(iterations):
        stop = at
        total = 0
        while stop < lengths.size and total + int(lengths[stop]) <= budget:
            total += int(lengths[stop])
            stop += 1
        if stop == at:
            break
        ids = np.arange(at, stop)
        work = coefficient * lengths[ids] + lengths[ids].astype(np.float64) ** 2
        micro: list[MicroBatch] = []
        for rank in karmarkar_karp(work, dp):
            for group in karmarkar_karp(work[rank], n):
                docs = ids[np.asarray(rank, dtype=np.int64)[group]] if group else np.zeros(0, dtype=np.int64)
                pieces = tuple(DocPiece(int(d), 0, int(lengths[d]), it) for d in docs)
                micro.append(MicroBatch(pieces, max(seq_len, sum(p.length for p in pieces))))
        batches.append(GlobalBatch(it, tuple(micro), dp, n))
        at = stop
    return batches


@dataclass(frozen=True)
class SftMethod:
    """One method's iterations, priced: the slowest DP rank's schedule time over the balanced one (summed
    over iterations), its seconds, the conversation tokens trained, and the largest micro-batch."""

    name: str
    iterations: int
    schedule_ratio: float
    slowest_seconds: float
    trained_tokens: int
    largest_micro_batch: int

    @property
    def tokens_per_second(self) -> float:
        return self.trained_tokens / self.slowest_seconds if self.slowest_seconds > 0 else float("nan")


def _priced(name: str, batches: list[GlobalBatch], trained: int, cost: CostModel, stages: int,
            virtual_stages: int) -> SftMethod:
    m = summarize(batches, cost, None, stages=stages, virtual_stages=virtual_stages)
    slowest = float(sum(schedule_times(cost, b, stages, virtual_stages).max() for b in batches))
    largest = max(mb.tokens for b in batches for mb in b.micro_batches)
    return SftMethod(name, len(batches), float(m.schedule_ratio), slowest, int(trained), int(largest))


def price_megatron(lines: Sequence[Sequence[int]], packing: PackingConfig, cost: CostModel, cp: int = 1,
                   stages: int | None = None, virtual_stages: int = 1) -> SftMethod | None:
    """Megatron's SFT grouping of ``lines`` priced (None: fewer lines than one global batch)."""
    batches, trained = megatron_sft_batches(lines, packing.seq_len, packing.dp, packing.n, cp)
    if not batches:
        return None
    return _priced("Megatron SFTDataset grouping", batches, trained, cost, packing.n if stages is None else stages,
                   virtual_stages)


def compare_sft(lines: Sequence[Sequence[int]], packing: PackingConfig, cost: CostModel, packer: str = "wlb",
                cp: int = 1, stages: int | None = None, virtual_stages: int = 1,
                documents: Sequence[int] | np.ndarray | None = None) -> list[SftMethod]:
    """Megatron's SFT grouping of ``lines`` (each a jsonl line's conversation lengths, in training order), and
    KK by ``6 * hidden * L + L^2`` and ``packer`` on ``documents`` (the document lengths the balanced run
    trains, in order: ``data.sft.planned_documents``; None: each conversation cut to ``seq_len``), KK and the
    packer over the iterations in which the stream is full."""
    seq, dp, n = packing.seq_len, packing.dp, packing.n
    stages = n if stages is None else stages
    if documents is None:
        lengths = np.minimum(np.asarray([c for line in lines for c in line], dtype=np.int64), seq)
    else:
        lengths = np.asarray(documents, dtype=np.int64)
        if lengths.size and (lengths.min() < 1 or lengths.max() > seq):
            raise ValueError(f"document lengths {int(lengths.min())}..{int(lengths.max())}: each must be 1..seq_len "
                             f"{seq}")
    budget = packing.tokens_per_iteration
    iterations = max(1, int(lengths.sum()) // budget)  # the packer's last iterations only drain its queues
    packed: list[GlobalBatch] = []
    for batch in make_packer(packer, packing, cost).pack(lengths):
        packed.append(batch)
        if len(packed) == iterations:
            break
    kk = kk_batches(lengths, seq, dp, n, 6.0 * cost.model.hidden, budget, iterations)
    mega = price_megatron(lines, packing, cost, cp, stages, virtual_stages)
    return ([mega] if mega is not None else []) + [
        _priced("KK by c*L + L^2 (verl, slime)", kk, sum(b.tokens for b in kk), cost, stages, virtual_stages),
        _priced(f"{packer} (megatron-wlb)", packed, sum(b.tokens for b in packed), cost, stages, virtual_stages)]


def prepacked_lines(lengths: Sequence[int], seq_len: int, cp: int = 1) -> list[list[int]]:
    """Conversations grouped into jsonl lines in order, each line filled while its conversations (padded to
    2*CP) fit ``seq_len``: how a jsonl is prepared for ``SFTDataset`` to waste little window (a conversation
    longer than the window alone on its line)."""
    granule = 2 * cp if cp > 1 else 1
    lines: list[list[int]] = []
    used = seq_len + 1
    for n in lengths:
        padded = -(-int(n) // granule) * granule
        if used + padded > seq_len:
            lines.append([])
            used = 0
        lines[-1].append(int(n))
        used += padded
    return lines


def lognormal_conversations(count: int, median: float, sigma: float, seed: int = 0, smallest: int = 16
                            ) -> np.ndarray:
    """A synthetic heavy-tailed conversation-length stream: log-normal token counts (``median``, ``sigma``)."""
    rng = np.random.default_rng(seed)
    return np.maximum(smallest, rng.lognormal(np.log(median), sigma, int(count))).astype(np.int64)
