"""The plans a decoding step can follow: ``Plan`` (AR, a drafter's chain, static tree or EAGLE-2 dynamic tree,
or a Jacobi window of self-drafts) and the bucketed candidate sets ``tree="auto"`` chooses from
(``candidate_plans``, ``jacobi_plans``). Pure Python: the planner and the configuration read plans without
torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

DYNAMIC_BUDGETS = (4, 8, 16, 32, 58)
# static trees of sampled drafts (``trees.static_shape``): 5, 10 and 15 nodes with the root
STATIC_SHAPES = ((2, 1, 1), (2, 2, 1, 1), (3, 2, 1, 1))
DRAFT_KINDS = (None, "deterministic", "sampled")
FAMILIES = ("sampled", "top", "jacobi")  # draft families (``Plan.family``), pooled separately
JACOBI_WINDOWS = (1, 2, 4, 8, 16, 32, 64)  # the windows tree="auto" chooses from (method "sjd")
JACOBI_PREFIX = "sjd"  # a Jacobi window's plan name: the prefix, then W
# EAGLE-2 (depth, top_per_node) per node budget: enough candidates (k + (depth - 1) k^2) for the budget,
# few drafter forwards (depth) for small trees
DYNAMIC_SHAPES = {4: (3, 2), 8: (4, 3), 16: (5, 4), 32: (5, 7), 58: (5, 10)}
WIDTH_EXPONENT = 0.3  # effective width of a tree level: (nodes per level) ** WIDTH_EXPONENT (planner.py's module doc)


@dataclass(frozen=True)
class Plan:
    name: str  # "ar", "chain3", "tree16", or the explicit config's tree kind
    kind: str  # "ar" | "chain" | "dynamic" | "static" | "jacobi" (a window of W = depth self-drafts)
    depth: int = 0  # draft levels below the root
    n_nodes: int = 0  # dynamic: drafted nodes kept
    top_per_node: int = 0  # dynamic: children per expanded node and beam width
    static_widths: Tuple[int, ...] = ()
    sampled: bool = False  # chain: drafts drawn from the drafter's distribution (static trees always are)

    @property
    def is_ar(self) -> bool:
        return self.kind == "ar"

    @property
    def samples(self) -> bool:
        """Whether the drafts are drawn from the drafter's distribution (else its top tokens)."""
        return self.kind == "static" or (self.kind == "chain" and self.sampled)

    @property
    def family(self) -> str:
        """The draft family whose acceptance data the plan shares (``FAMILIES``)."""
        if self.kind == "jacobi":
            return "jacobi"
        return "sampled" if self.samples else "top"

    @property
    def nodes(self) -> int:
        """Nodes of the plan's tree, root included (AR: the root alone)."""
        if self.kind == "static":
            return len(static_shape(self.static_widths))
        if self.kind == "dynamic":
            k = self.top_per_node
            return min(self.n_nodes, k + (self.depth - 1) * k * k) + 1
        return self.depth + 1  # AR, chains and Jacobi windows

    @property
    def beam_nodes(self) -> int:
        """Nodes an EAGLE-2 tree's drafter expansions score over all depths (0 for other plans)."""
        return self.depth * self.top_per_node if self.kind == "dynamic" else 0

    def effective_width(self) -> float:
        """How many alternatives a level offers, for the shared acceptance model (a chain: 1; a static tree:
        its first level's)."""
        if self.kind == "dynamic":
            return max(1.0, self.n_nodes / max(self.depth, 1)) ** WIDTH_EXPONENT
        if self.kind == "static":
            return max(1.0, float(self.static_widths[0] if self.static_widths else 1)) ** WIDTH_EXPONENT
        return 1.0

    def shared_rates(self, chain_rates: Sequence[float]) -> List[float]:
        """P(level d accepts | level d - 1 did) for d = 1..depth, from the draft family's chain-equivalent
        rates b_d (the shared acceptance model, planner.py): a level of effective width e accepts with
        1 - (1 - b_d)^e; a static tree's levels below its first, ``static_level_rates``."""
        if self.kind == "static":
            return static_level_rates(self.static_widths, chain_rates)
        e = self.effective_width()
        return [1.0 - (1.0 - b) ** e for b in chain_rates[: self.depth]]

    def pooled_width(self, level: int) -> Optional[float]:
        """The effective width that turns the plan's acceptance at ``level`` (0-based) back into the chain-
        equivalent rate, or None where that acceptance depends on the levels before: below a static tree's
        first level, how many children the accepted node has depends on which sibling it was."""
        if self.kind == "static" and level > 0:
            return None
        return self.effective_width()


def accept_any(b: float, k: int) -> float:
    """P(one of k sibling drafts is accepted) at a level of chain-equivalent rate b: 1 - (1 - b)^(k^0.3)."""
    return 1.0 - (1.0 - b) ** (k ** WIDTH_EXPONENT) if k > 0 else 0.0


def static_level_rates(widths: Sequence[int], chain_rates: Sequence[float]) -> List[float]:
    """P(level d accepts | level d - 1 did) of the static tree of ``widths`` (``static_shape``: a node that is
    its parent's r-th child gets widths[d] - r children), chain-equivalent rates b_d. Verify tries a node's
    children in order (SPEC 3.2), so the first k of m siblings accept with ``accept_any(b_d, k)``: the r-th
    with accept_any(b_d, r + 1) - accept_any(b_d, r). The level below then offers the accepted child's own
    children: (2, 1, 1) accepts its first level with 1 - (1 - b_1)^(2^0.3), its second with b_1 b_2 over that
    (only the first child has a child)."""
    reached = {0: 1.0}  # the accepted node's rank among its siblings -> P(the walk accepted it)
    before, rates = 1.0, []
    for width, b in zip(widths, chain_rates):
        below: Dict[int, float] = {}
        for rank, p in reached.items():
            for r in range(max(0, width - rank)):
                below[r] = below.get(r, 0.0) + p * (accept_any(b, r + 1) - accept_any(b, r))
        now = sum(below.values())
        rates.append(now / before if before > 0 else 0.0)
        before, reached = now, below
    return rates


AR_PLAN = Plan("ar", "ar")


def candidate_plans(max_depth: int = 5, budgets: Sequence[int] = DYNAMIC_BUDGETS, draft: Optional[str] = None,
                    static_shapes: Sequence[Tuple[int, ...]] = STATIC_SHAPES) -> List[Plan]:
    """AR; chains of depth 1..max_depth; static trees of sampled drafts (``static_shapes`` no deeper than
    max_depth); EAGLE-2 trees of the bucketed node budgets (depth <= max_depth).

    draft: None (the default) samples the chains' drafts and keeps both tree kinds; "sampled" drops the
    EAGLE-2 trees (their drafts are each node's top tokens); "deterministic" takes the chains' top-1 drafts
    and drops the static trees (their drafts are sampled)."""
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if draft not in DRAFT_KINDS:
        raise ValueError(f"draft must be one of {DRAFT_KINDS}, got {draft!r}")
    sampled = draft != "deterministic"
    prefix = "chain" if sampled else "top1chain"
    plans = [AR_PLAN] + [Plan(f"{prefix}{d}", "chain", depth=d, sampled=sampled) for d in range(1, max_depth + 1)]
    if draft != "deterministic":
        for widths in static_shapes:
            if len(widths) <= max_depth:
                plans.append(Plan("static" + "-".join(map(str, widths)), "static", depth=len(widths),
                                  static_widths=tuple(widths)))
    if draft != "sampled":
        for n in budgets:
            depth, top = DYNAMIC_SHAPES.get(n, (max_depth, 10))
            plans.append(Plan(f"tree{n}", "dynamic", depth=min(depth, max_depth), n_nodes=n, top_per_node=top))
    return plans


def jacobi_plan(window: int) -> Plan:
    """A Jacobi self-drafting step over a window of ``window`` drafts (one target forward, no drafter)."""
    return Plan(f"{JACOBI_PREFIX}{window}", "jacobi", depth=window)


def checked_rates(what: str, rates: Optional[Mapping[str, Sequence[float]]]) -> Dict[str, List[float]]:
    """Acceptance rates per level keyed by a draft family of ``FAMILIES`` or a Jacobi window's plan name
    (``jacobi_plan``), each in [0, 1), as floats; else a ValueError naming ``what``."""
    checked = {}
    for key, values in (rates or {}).items():
        known = key in FAMILIES or (isinstance(key, str) and re.fullmatch(JACOBI_PREFIX + r"[1-9][0-9]*", key))
        if not known or not all(0.0 <= float(r) < 1.0 for r in values):
            raise ValueError(f"{what} must map a family of {FAMILIES} or a Jacobi window's name "
                             f"('{JACOBI_PREFIX}<W>') to rates in [0, 1), got {key!r}: {values!r}")
        checked[key] = [float(r) for r in values]
    return checked


def jacobi_plans(max_window: int = 8, windows: Sequence[int] = JACOBI_WINDOWS) -> List[Plan]:
    """AR and the Jacobi windows of ``windows`` up to ``max_window``, ``max_window`` itself included."""
    if max_window < 1:
        raise ValueError(f"max_window must be >= 1, got {max_window}")
    sizes = sorted({w for w in windows if 1 <= w <= max_window} | {max_window})
    return [AR_PLAN] + [jacobi_plan(w) for w in sizes]


def static_shape(widths: Sequence[int]) -> List[int]:
    """Parents of the fixed static tree: a node at depth d that is its parent's r-th child gets
    max(0, widths[d] - r) children (the root is depth 0, rank 0). (6, 4, 3, 2, 1, 1) -> 56 nodes."""
    parents, ranks, depths = [-1], [0], [0]
    frontier = [0]
    for d, width in enumerate(widths):
        nxt = []
        for node in frontier:
            for r in range(max(0, width - ranks[node])):
                parents.append(node)
                ranks.append(r)
                depths.append(d + 1)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents
