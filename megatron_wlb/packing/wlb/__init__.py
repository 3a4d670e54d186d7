"""``wlb``: variable-length packing with outlier delay (paper Algorithm 1), plus extensions.

Per iteration, over all ``dp * n`` micro-batches of capacity ``max_seq_len`` (paper S_max):

1. New pieces join the waiting pool. A piece is an *outlier* if its length is at least L_1; the
   outliers wait in ``n_q`` queues by level (L_k <= d < L_{k+1}).
2. A queue holding at least R pieces releases R of them (one per micro-batch: they are the
   largest items of the iteration, so the placement below puts them into distinct, empty
   micro-batches). R = dp * n, see extension (c). The paper takes the R oldest (``release="oldest"``
   or ``"paper"``); by default a group of similar work, see (e).
3. Pieces that have waited ``max_delay`` iterations are *forced*: placed before everything else,
   in a pass of their own. A queue whose oldest member is forced releases the members nearest to
   it in length with it (up to R in all), so a forced outlier
   does not run alone; with a cut policy (g) it may be cut instead.
4. The released outliers and the other pieces, by length descending, each go to the micro-batch of
   least workload among those with room for it (the paper: least workload if it fits, else least
   length if it fits; ours picks the least-loaded of all that fit, a superset of both choices);
   what fits nowhere waits for the next iteration.
5. The micro-batches are dealt to DP ranks and ordered within each rank for the pipeline
   schedule (d).

Extensions beyond the paper (docs/packing.md has the measurements):

(a) ``queue_thresholds="auto"`` (default): L_1 is the shortest length whose latency reaches
    ``PackingConfig.outlier_fraction`` (default 0.7) of the latency of ``seq_len`` tokens of
    *ordinary* documents (those below L_1: a fixed point, so outliers do not raise their own
    bar); L_2 < ... < L_n split the outlier lengths seen so far into equal-count quantiles (so
    every queue fills at the same rate), using no more queues than the outlier rate can fill
    with R members each within max_delay / 2 iterations. The statistics (a log-spaced length
    histogram with token and latency sums per bin, the budget count) live in ``state_dict``, so a
    restored packer derives the same thresholds.
(b) ``max_delay``: a hard bound on waiting. Forced pieces are placed first, in their own pass; a
    forced piece that fits in no micro-batch whole is cut into pieces that fill the micro-batches
    with most room (counted in ``forced_splits``) before newer pieces can take that room, so the
    bound holds whenever an iteration can absorb one iteration's intake (the budget plus the
    overshoot of the document crossing it), i.e. whenever no document is longer than
    ``dp * n * (max_seq_len - seq_len)`` (256K tokens at 7b_128k); otherwise it is best effort.
(c) Global balance: the placement balances all ``dp * n`` micro-batches of the global batch
    together (DP ranks wait for each other at the gradient sync), and a queue releases ``dp * n``
    outliers at a time, one per micro-batch of the global batch: an outlier in one DP rank's
    micro-batch would otherwise set the pace for every rank.
(d) ``schedule_order``: ``packing.pipeline.deal_and_order`` assigns the micro-batches to DP ranks
    and orders them within a rank to minimise the slowest rank's (interleaved) 1F1B time; contents
    and delays are unchanged.
(e) ``release="balanced"`` or ``"grouped"``: a queue releases R members of similar length (preferring groups with its
    oldest) only when the iteration's ordinary documents can balance them (``balance.closable``); else
    it waits, within the delay bound.
(f) ``fill="waiting"`` (or ``"full"``): while pieces wait, every iteration holds at least ``fill_target``
    x the token budget unless no waiting piece fits: the intake reads that much even while repaying
    an overshoot (``PackingConfig.intake_fill``), and waiting pieces are released early, shortest first.
    With the read-ahead fill (h) on (``"full"``), the guard tops up from the waiting pieces when the read-ahead
    stopped for lack of room for the outliers it would queue, and then places the whole iteration
    again so the released pieces are balanced with the rest (``fill.fill_guard``).
(g) ``cut="overlong"`` or ``"any"`` (opt-in; ``PackingConfig.cut_policy``): a forced outlier whose group
    cannot be balanced is cut into the fewest pieces that can ("overlong": only pieces of documents
    longer than S_max; "any"), and so are the outliers the fill rule (f) releases early into an iteration whose ordinary
    documents cannot balance them (``cut.cut_early``); counted in ``cut_stats``.
(h) ``fill="full"`` (or ``"read-ahead"``): full iterations. While the iteration holds less than ``fill_target`` x the
    token budget, ordinary documents are read ahead from the stream (arriving now: no delay;
    credited against later budgets) and placed; outliers read on the way are queued, within what
    one iteration can take, so the delay bound holds (``fill.read_ahead_fill``).
(i) ``release="balanced"`` or ``"oldest"``: delay only when it pays. A queued outlier goes out as soon as the
    iteration can still be balanced with it, not only in a group of R (``release.balanced_release``).

``place.place_whole_batch`` is the placement (4) and dealing (5) alone, for one whole global batch that must be
placed now with documents whole (Megatron-LM main's own sequence-packing scheduler API,
``megatron/hooks/main_schedule.py``): no delay, and the number of micro-batches chosen by the 1F1B objective.

With ``PackingConfig.pieces="concat-and-cut"`` the pieces are Megatron's concat-and-cut pieces
(the base class's intake) and are never cut further (``delay_overruns`` counts forced pieces that
had to wait whole).

The code: ``plan.IterationPlan`` is one iteration's state (micro-batches, their work and tokens, the forced,
candidate and waiting pieces, the thresholds, the latency per ordinary token, the counts), and each
policy is a small module of functions over it: ``thresholds`` (a), ``release`` (2, 3, e, i), ``cut`` (g),
``fill`` (f, h), ``place`` (4, 5, b, d), all asking one balance question (``balance.stays_balanced``);
``packer.WlbPacker`` builds the plan and runs them in that order.
"""

from megatron_wlb.packing.wlb.balance import CLOSE_TOLERANCE, stays_balanced
from megatron_wlb.packing.wlb.packer import WlbPacker
from megatron_wlb.packing.wlb.place import deal_micro_batches, place_whole_batch
from megatron_wlb.packing.wlb.plan import IterationPlan, PlanCounts, place_pieces

__all__ = ["CLOSE_TOLERANCE", "IterationPlan", "PlanCounts", "WlbPacker", "deal_micro_batches", "place_pieces",
           "place_whole_batch", "stays_balanced"]
