"""The opt-in cut policy (extension (g), ``cut``: ``PackingConfig.cut_policy``): outliers the iteration
cannot balance are cut.

A forced outlier whose group cannot be balanced is cut into the fewest pieces that can (``cut``), and so
are the outliers the fill rule (f) releases early into an iteration whose ordinary documents cannot
balance them (``cut_early``). Scope: ``"overlong"`` cuts only pieces of documents longer than S_max,
``"any"`` any piece. Every cut is counted in ``PlanCounts.cut_stats``. (Megatron's concat-and-cut, the
``original`` packer's intake, is ``data/cut.py``.)
"""

from __future__ import annotations

from megatron_wlb.packing.types import DocPiece
from megatron_wlb.packing.wlb.balance import balanceable, closable
from megatron_wlb.packing.wlb.plan import IterationPlan


def may_cut(plan: IterationPlan, p: DocPiece) -> bool:
    """The cut policy's scope: ``any`` piece, or (``overlong``) pieces of documents over S_max."""
    policy = plan.config.cut_policy
    return policy == "any" or (policy == "overlong" and p.doc_id in plan.overlong)


def equal_sizes(length: int, k: int) -> list[int]:
    """``length`` tokens as ``k`` near-equal sizes, the longer first."""
    return [length // k + (1 if i < length % k else 0) for i in range(k)]


def cut_into(plan: IterationPlan, p: DocPiece, k: int) -> list[DocPiece]:
    """``p`` as ``k`` contiguous pieces of near-equal length (``p`` itself for k = 1), counted. Never more
    pieces than tokens: a piece of one token (an outlier when L_1 = 1) stays whole."""
    k = min(k, p.length)
    if k <= 1:
        return [p]
    out, off = [], p.offset
    for size in equal_sizes(p.length, k):
        out.append(DocPiece(p.doc_id, off, size, p.arrival))
        off += size
    stats = plan.counts.cut_stats
    stats["cut_points"] += k - 1
    stats["tokens"] += p.length
    stats["pieces"] += k
    return out


def cut(plan: IterationPlan, p: DocPiece) -> list[DocPiece]:
    """``p`` into the fewest equal pieces that the ordinary documents can balance (``closable``), or that
    are ordinary (below L_1)."""
    k = 2
    while True:
        size = -(-p.length // k)
        if size < plan.l1 or size <= 1 or closable(plan, [size] * k):
            break
        k += 1
    return cut_into(plan, p, k)


def cut_early(plan: IterationPlan, early: list[DocPiece], others: list[DocPiece]) -> list[DocPiece]:
    """The cut policy on the fill rule's early releases: when the iteration (``others`` plus ``early``)
    holds outliers its ordinary documents cannot balance (``balanceable``), cut the released outliers the
    policy may cut, heaviest piece first, one more piece at a time, into the fewest pieces that can be
    balanced (or until they are ordinary, below L_1). Nothing is cut when even that would not balance
    the iteration."""
    l1 = plan.l1
    cuttable = [p for p in early if p.length >= l1 and may_cut(plan, p)]
    if not cuttable:
        return early
    chosen = set(cuttable)
    pieces = others + early
    fixed = [p.length for p in pieces if p.length >= l1 and p not in chosen]
    ordinary = sum(p.length for p in pieces if p.length < l1)

    def balanced(ks: list[int]) -> bool:
        big, small = list(fixed), ordinary
        for p, k in zip(cuttable, ks):
            for x in equal_sizes(p.length, k):
                if x >= l1:
                    big.append(x)
                else:
                    small += x
        return balanceable(plan, big, small)

    ks = [1] * len(cuttable)
    if balanced(ks):
        return early
    floor = [max(1, -(-p.length // max(1, l1 - 1))) for p in cuttable]  # pieces below L_1
    while not balanced(ks):
        i = max((i for i in range(len(cuttable)) if ks[i] < floor[i]),
                key=lambda i: (-(-cuttable[i].length // ks[i]), -i), default=-1)
        if i < 0:
            break
        ks[i] += 1
    cuts = {p: k for p, k in zip(cuttable, ks) if k > 1}
    return [q for p in early for q in (cut_into(plan, p, cuts[p]) if p in cuts else [p])]
