"""The settings and the figures of the speculative loop: ``SpecConfig`` (method, tree, drafting and planner
options), ``Sampling`` (the sampling settings of a run), ``SpecStats`` (what a run did), and the one place
where their defaults and their validation live (``check_config``; the bounds shared with the command line are
``options.py``'s).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from .. import ops
from .compiled import AUTO, CompileOption, check_compile
from .costs import CostModel
from .jacobi import FRESH_INITS
from .options import OptionError, check_int, check_relaxation, check_tree_sizes
from .plans import Plan, candidate_plans, jacobi_plan, jacobi_plans

STATIC_WIDTHS = (6, 4, 3, 2, 1, 1)  # 56 nodes with the root
TREES = ("auto", "chain", "static", "dynamic")
METHODS = ("spec", "lantern", "sjd")
SELF_DRAFTING = ("sjd",)  # methods that draft from the target itself (no drafter)


@dataclass
class SpecConfig:
    # "spec" (exact, δ = 0) | "lantern" (relaxed) | "sjd" (Jacobi self-drafting, no drafter: exact, or relaxed
    # when given a neighbour table)
    method: str = "lantern"
    tree: str = "auto"  # "auto" (planner) | "chain" | "static" | "dynamic"; sjd: "auto" | "chain" (fixed window)
    # "deterministic" | "sampled"; default: sampled for chains and static trees, top-k for EAGLE-2 dynamic trees
    # (tree="auto": see ``planner.candidate_plans``)
    draft: Optional[str] = None
    depth: int = 5  # draft levels below the root (chain length / EAGLE-2 expansions / static depth from widths)
    top_per_node: int = 10  # EAGLE-2: children per expanded node, and the beam width
    n_nodes: int = 58  # EAGLE-2: drafted nodes kept (plus the root)
    static_widths: Sequence[int] = STATIC_WIDTHS
    k: int = 1000  # neighbours merged at most
    delta: float = 0.1
    lam: Optional[float] = None  # LANTERN++ lambda mode instead of delta
    budget: str = "candidate"
    # tree="auto" only
    cost_model: Optional[CostModel] = None  # default: calibrated on the device (cached, see costs.py)
    plans: Optional[Sequence[Plan]] = None  # candidates; default: candidate_plans(depth)
    # per-level acceptance of a chain before the run's own data, where the cost model has no measured rates
    acceptance_prior: float = 0.5
    acceptance_memory: float = 0.98  # per step, the weight the acceptance data keeps (see AcceptanceModel)
    adapt_costs: bool = True  # correct the cost model by the run's step times (see Planner); False: reproducible
    margin: float = 0.05  # draft only when predicted more than 5 % faster than AR (see Planner)
    # True: target and drafter forwards compiled: on a CPU lantern's own models from AOT packages (aot.py),
    # otherwise torch.compile (inductor; CUDA graphs on a GPU), node counts padded to buckets (compiled.py); a
    # dict: those torch.compile options; "auto": True where compiling works on the device
    # (compile_choice.resolve_compile), with the reason in the stats
    compile: CompileOption = AUTO
    # method "sjd" (docs/sjd.md)
    window: int = 8  # drafts per step (tree="chain"), or the largest window the planner considers (tree="auto")
    coupling: bool = False  # SCD: the draws of one image position share their uniforms across steps
    init: str = "repeat"  # fresh slots: "repeat" (copy the token to the left, one-hot q) | "sample" (draw)

    @property
    def self_drafting(self) -> bool:
        """Whether the method drafts from the target itself (Jacobi windows) rather than with a drafter."""
        return self.method in SELF_DRAFTING

    def relaxed(self, neighbours) -> bool:
        """Whether verify relaxes over latent neighbours: method "lantern", or "sjd" given a neighbour table."""
        return self.method == "lantern" or (self.self_drafting and neighbours is not None)

    def draft_kind(self) -> str:
        """The drafts of an explicit tree: sampled from the drafter's distribution, or its top tokens."""
        if self.draft is not None:
            return self.draft
        return "deterministic" if self.tree == "dynamic" else "sampled"

    def fixed_plan(self) -> Plan:
        """The plan of an explicit tree (every step)."""
        if self.self_drafting:
            return jacobi_plan(self.window)
        if self.tree == "chain":
            return Plan("chain", "chain", depth=self.depth, sampled=self.draft_kind() == "sampled")
        if self.tree == "static":
            return Plan("static", "static", depth=len(self.static_widths), static_widths=tuple(self.static_widths))
        return Plan("dynamic", "dynamic", depth=self.depth, n_nodes=self.n_nodes, top_per_node=self.top_per_node)

    def candidates(self) -> List[Plan]:
        if self.plans is not None:
            return list(self.plans)
        if self.self_drafting:
            return jacobi_plans(self.window)
        return candidate_plans(self.depth, draft=self.draft)


@dataclass
class SpecStats:
    target_forwards: int = 0  # batched target forwards (prefill + one per verify step)
    draft_forwards: int = 0  # batched drafter forwards
    steps: int = 0  # verify steps (AR steps of tree="auto" included)
    row_steps: int = 0  # sum over rows of the verify steps in which the row was still generating
    emitted: int = 0  # tokens emitted by verify steps (all rows)
    wall_s: float = 0.0
    accept_lens: list = field(default_factory=list)  # per step: accept_len of the rows still generating
    plan_counts: Dict[str, int] = field(default_factory=dict)  # steps per plan ("ar", "chain3", "tree16", ...)
    planner: dict = field(default_factory=dict)  # tree="auto": per plan expected vs achieved tokens/s, cost model
    compile_s: float = 0.0  # compiled: first calls of each new graph (compile included), part of wall_s
    compiled_graphs: int = 0  # compiled: graphs compiled in this run (0 when earlier runs compiled them)
    compile: str = ""  # what config.compile resolved to on the device, and why ("on (auto)", "off (...)")

    @property
    def tau(self) -> float:
        """Mean tokens per target forward per row: accepted drafts + 1."""
        return self.emitted / max(self.row_steps, 1)


@dataclass
class Sampling:
    cfg_scale: object = 1.0
    temperature: object = 1.0
    top_k: object = 0
    top_p: object = 1.0
    seed: int = 0
    cfg_interval: int = -1
    # [B] int64: each image's Philox row key in every draw (verify, the drafts), so an image's tokens follow its
    # id, not its place in the batch; None: the row index b
    rows: Optional[torch.Tensor] = None

    @property
    def guided(self) -> bool:
        return not (isinstance(self.cfg_scale, (int, float)) and self.cfg_scale == 1.0)

    @property
    def halves(self) -> int:
        """Model rows per image: [cond; uncond] with guidance."""
        return 2 if self.guided else 1


DRAFTS = (None, "deterministic", "sampled")


def _check_neighbour_ids(config: SpecConfig, neighbours, vocab: int) -> None:
    """The table's ids, scanned once before the loop and the calibration (inside them the ops' value scans
    are off)."""
    if config.relaxed(neighbours) and config.k > 0 and isinstance(neighbours, torch.Tensor) and \
            neighbours.dim() == 2:
        ops.checks.in_range("neighbours", neighbours[:, : config.k], 0, vocab)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_config(config: SpecConfig, neighbours, vocab: int, drafter=None) -> None:
    """ValueError naming the option for a config the loop cannot run as asked (vocab: the target's V)."""
    if config.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {config.method!r}")
    if config.tree not in TREES:
        raise ValueError(f"tree must be one of {TREES}, got {config.tree!r}")
    check_compile(config.compile)
    if config.self_drafting:
        _check_self_drafting(config, drafter)
    else:
        _check_drafting(config, drafter)
    if config.draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {config.draft!r}")
    if config.draft == "sampled" and config.tree == "dynamic":
        raise ValueError("draft='sampled' does not apply to tree='dynamic' (EAGLE-2 trees take each node's top "
                         "tokens: deterministic drafts); use tree='chain' or 'static' for sampled drafts")
    if not _is_int(config.depth) or config.depth < 1:
        raise ValueError(f"depth must be an int >= 1 (draft levels below the root), got {config.depth!r}")
    if not _is_int(config.n_nodes) or config.n_nodes < 1:
        raise ValueError(f"n_nodes must be an int >= 1 (drafted nodes kept per step; for no drafts use "
                         f"method='ar'), got {config.n_nodes!r}")
    top_max = vocab if config.tree == "dynamic" else None  # other trees do not use it
    if not _is_int(config.top_per_node) or config.top_per_node < 1 or (top_max and config.top_per_node > top_max):
        raise ValueError(f"top_per_node must be an int in [1, {top_max or 'V'}] (children per expanded node; "
                         f"V = {vocab}), got {config.top_per_node!r}")
    widths = config.static_widths
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths or \
            not all(_is_int(w) and w >= 1 for w in widths):
        raise ValueError(f"static_widths must be a non-empty sequence of ints >= 1 (children of a depth's first "
                         f"node), got {widths!r}")
    if config.method == "lantern" and config.k > 0 and neighbours is None:
        raise ValueError("method='lantern' needs the neighbour table (lantern.ops.latent_neighbours)")
    _check_bounds(config, neighbours)
    _check_neighbour_ids(config, neighbours, vocab)


def _check_drafting(config: SpecConfig, drafter) -> None:
    """A drafter's method: the drafter given, none of the Jacobi options."""
    if drafter is None:
        raise ValueError(f"method={config.method!r} needs a drafter (lantern.models.drafter.EagleDrafter or "
                         f"GPTDrafter); method='sjd' drafts without one")
    if config.coupling:
        raise ValueError("coupling (coupled Jacobi drafts) applies to method='sjd' only")
    if config.plans is not None and any(p.kind == "jacobi" for p in config.plans):
        raise ValueError("plans: Jacobi windows need method='sjd'")


def _check_self_drafting(config: SpecConfig, drafter) -> None:
    """The options of method "sjd", and that no drafter is given."""
    if drafter is not None:
        raise ValueError("method='sjd' drafts from the target itself: drafter must be None")
    if config.tree not in ("auto", "chain"):
        raise ValueError(f"method='sjd' verifies its window as a chain: tree must be 'auto' (the planner picks the "
                         f"window) or 'chain' (every step the whole window), got {config.tree!r}")
    if config.draft is not None:
        raise ValueError(f"draft does not apply to method='sjd' (its drafts are the target's own samples), "
                         f"got {config.draft!r}")
    if not _is_int(config.window) or config.window < 1:
        raise ValueError(f"window must be an int >= 1 (Jacobi drafts per step), got {config.window!r}")
    if not isinstance(config.coupling, bool):
        raise ValueError(f"coupling must be a bool, got {config.coupling!r}")
    if config.init not in FRESH_INITS:
        raise ValueError(f"init must be one of {FRESH_INITS} (fresh window slots), got {config.init!r}")
    if config.plans is not None and any(p.kind not in ("ar", "jacobi") for p in config.plans):
        raise ValueError("method='sjd' plans must be AR or Jacobi windows (planner.jacobi_plans)")


def _check_bounds(config: SpecConfig, neighbours) -> None:
    """The bounds the command line shares (``options.py``) and the options the method ignores that differ
    from SpecConfig's defaults: the tree sizes; delta, lam and k of a relaxed run (k at most the neighbour
    table's width); a relaxation asked of sjd without a table; sjd's window options elsewhere."""
    defaults = {name: f.default for name, f in SpecConfig.__dataclass_fields__.items()}
    check_tree_sizes(config.depth, config.n_nodes, config.window, config.static_widths)
    if config.relaxed(neighbours):
        check_relaxation(config.delta, config.lam)
        width = neighbours.shape[1] if hasattr(neighbours, "shape") and len(neighbours.shape) == 2 else None
        check_int("k", config.k, 0, width, " (neighbours merged at most; the neighbour table's width)")
    elif config.self_drafting and (config.lam is not None or config.delta not in (0, defaults["delta"])):
        raise OptionError("lam" if config.lam is not None else "delta",
                          "applies to relaxed acceptance; method='sjd' relaxes only with a neighbour table "
                          "(neighbours=...), and without it is exact")
    if not config.self_drafting:
        for name in ("window", "init"):
            if getattr(config, name) != defaults[name]:
                raise OptionError(name, "applies to method='sjd' only")
