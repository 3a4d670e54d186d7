"""Full iterations: the fill rule (f, ``PackingConfig.waiting_fill``) and the read-ahead fill (h,
``read_ahead_fill``): the ``fill`` policy's parts, each to ``fill_target`` x the budget.

(f) While pieces wait, every iteration holds at least ``waiting_fill`` x the token budget unless no waiting
piece fits: waiting pieces are released early, shortest first, before the placement
(``release_early``), and after it the guard tops up from the waiting pieces (``fill_guard``).
(h) While the iteration holds less than ``read_ahead_fill`` x the budget, ordinary documents are read
ahead from the stream (arriving now: no delay; credited against later budgets), before the placement
(``read_ahead_ordinary``) and after it (``read_ahead_fill``); outliers read on the way wait, within
what one iteration can take, so the delay bound holds.
"""

from __future__ import annotations

from megatron_wlb.packing.types import DocPiece, oldest_first_key, shortest_first_key, sort_largest_first
from megatron_wlb.packing.wlb.cut import cut_early
from megatron_wlb.packing.wlb.place import replace_all
from megatron_wlb.packing.wlb.plan import IterationPlan


def _held(plan: IterationPlan) -> int:
    """Tokens of the pieces to place this iteration (forced and candidates)."""
    return sum(p.length for p in plan.forced) + sum(p.length for p in plan.candidates)


def early_release(waiting: list[DocPiece], need: float) -> list[DocPiece]:
    """Waiting pieces worth at least ``need`` tokens, shortest first (they are the easiest to balance
    against the few ordinary documents of an under-filled iteration); pieces of one document go out
    together."""
    out: list[DocPiece] = []
    if need <= 0:
        return out
    docs: dict[int, list[DocPiece]] = {}
    for p in sorted(waiting, key=shortest_first_key):
        docs.setdefault(p.doc_id, []).append(p)
    got = 0
    for doc_pieces in docs.values():
        if got >= need:
            break
        out.extend(doc_pieces)
        got += sum(p.length for p in doc_pieces)
    return out


def release_early(plan: IterationPlan) -> None:
    """(f) before the placement: top the iteration up to ``waiting_fill`` x the budget from the waiting pieces
    (``early_release``), so long waiting pieces still find empty micro-batches; with a cut policy the
    released outliers the iteration cannot balance are cut (``cut_early``)."""
    cfg = plan.config
    early = early_release(plan.waiting, cfg.waiting_fill * cfg.tokens_per_iteration - _held(plan))
    if not early:
        return
    picked = set(early)
    plan.waiting = [p for p in plan.waiting if p not in picked]
    plan.counts.fill_releases += len(early)
    if cfg.cut_policy != "none":
        early = cut_early(plan, early, plan.forced + plan.candidates)
    plan.candidates.extend(early)


def read_ahead_ordinary(plan: IterationPlan, tokens: float) -> list[DocPiece]:
    """(h) Read documents ahead from the stream until their ordinary pieces (below L_1) hold ``tokens``
    and return those to be placed; outliers read on the way join ``plan.waiting``. What this iteration's
    arrivals may leave waiting (all it reads, at worst) is kept within what one iteration holds
    (``dp * n * max_seq_len``), so the iteration that forces them can take them (the delay bound (b))."""
    room = plan.cap * plan.m - sum(p.length for p in plan.waiting if p.arrival == plan.iteration)
    ordinary: list[DocPiece] = []
    got = 0
    while got < tokens and room > 0:
        new = plan.read_ahead(int(tokens - got), room)
        if not new:
            break
        plan.observe(new)
        read = sum(p.length for p in new)
        plan.counts.read_ahead_tokens += read
        room -= read
        for p in new:
            if p.length >= plan.l1:
                plan.waiting.append(p)
            else:
                ordinary.append(p)
                got += p.length
    return ordinary


def read_ahead_before(plan: IterationPlan) -> None:
    """(h) before the placement: the ordinary documents a full iteration needs are read now, so they are
    placed with the rest, largest first (read after it, a long one could only land on top of an already
    balanced micro-batch)."""
    cfg = plan.config
    plan.candidates.extend(read_ahead_ordinary(plan, cfg.read_ahead_fill * cfg.tokens_per_iteration - _held(plan)))


def read_ahead_fill(plan: IterationPlan) -> None:
    """(h) after the placement: while the iteration is still short of ``read_ahead_fill`` x the budget, read
    more ordinary documents and place them, least-loaded micro-batch first, until the target, the end of
    the stream, or a piece that fits nowhere (it waits)."""
    need = plan.config.read_ahead_fill * plan.config.tokens_per_iteration
    while (have := plan.tokens) < need:
        ordinary = sort_largest_first(read_ahead_ordinary(plan, need - have))
        if not ordinary:
            return
        unplaced = plan.place(ordinary)
        if unplaced:
            plan.waiting.extend(unplaced)
            return


def fill_guard(plan: IterationPlan, full: bool) -> None:
    """(f) after the placement: while pieces wait, place waiting ones (oldest first, all the waiting
    pieces of a document together) until the iteration holds ``waiting_fill`` x the budget, or
    ``read_ahead_fill`` x when ``full`` (the read-ahead fill is on and ran out of room for the outliers it
    would queue), or nothing more fits. With ``full`` the iteration is then placed again from scratch
    (``replace_all``), so the released pieces are balanced with the others rather than stacked on
    already balanced micro-batches."""
    cfg = plan.config
    need = max(cfg.waiting_fill, cfg.read_ahead_fill if full else 0.0) * cfg.tokens_per_iteration
    if plan.tokens >= need:
        return
    waiting = plan.waiting
    waiting.sort(key=oldest_first_key)
    docs: dict[int, list[DocPiece]] = {}
    for p in waiting:
        docs.setdefault(p.doc_id, []).append(p)
    placed: set[DocPiece] = set()
    for doc_pieces in docs.values():
        if plan.tokens >= need:
            break
        unplaced = plan.place(doc_pieces)
        if unplaced and full and replace_all(plan, unplaced, balanced=True):
            unplaced = []  # fits once the iteration is placed again with it
        placed.update(p for p in doc_pieces if p not in unplaced)
    plan.counts.fill_releases += len(placed)
    waiting[:] = [p for p in waiting if p not in placed]
    if placed and full:
        replace_all(plan)
