"""Which options of ``lantern.generate`` apply to which model and method, and the bounds of the settings: one
place, so that the API and the command line (``lantern generate``, ``lantern sample``) refuse the same things
for the same reasons, before any work.

Every refusal is an ``OptionError`` (a ValueError) carrying the option's name and the problem; the API shows
it as "name problem", the command line as "--flag problem" (``cli_message``).

An option that does not apply to the chosen model family, method or tree is refused when it is given, i.e.
when its value differs from its default: the default asks for nothing, so it is never refused (the command
line compares with the command's own defaults).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

FLOAT32_MAX = 3.4028234663852886e38
SEED_END = 2**64  # seeds are the Philox key: 64 bits
CFG_INTERVAL_END = 2**31  # a token index
# tree nodes per verify step (root included) at most: the tree mask and verify's work grow as T^2 per row, and
# the project's plans use at most 59 nodes (EAGLE-2's 58) and Jacobi windows of 64
MAX_TREE_NODES = 1024
# MAR: temperature scales the head's noise std, cfg_scale the guidance on its eps. The released models sample
# at about 1 and 3; these bounds are far beyond any useful setting and keep the head's arithmetic well inside
# float32
MAR_MAX_TEMPERATURE = 1000.0
MAR_MAX_CFG = 1000.0

GPT_METHODS = ("ar", "spec", "lantern", "sjd")
MAR_METHODS = ("ar", "cspd")
# the speculative loop's options (SpecConfig's fields, and the drafter and neighbour table)
AUTO_ONLY = ("cost_model", "plans", "acceptance_prior", "acceptance_memory", "adapt_costs", "margin")
RELAXED_ONLY = ("neighbours", "k", "delta", "lam", "budget")
JACOBI_ONLY = ("window", "coupling", "init")
DRAFTER_ONLY = ("drafter", "draft", "depth", "n_nodes", "top_per_node", "static_widths")
SPECULATIVE = ("tree", *DRAFTER_ONLY, *RELAXED_ONLY, *JACOBI_ONLY, *AUTO_ONLY, "no_ar_baseline")
# options of the discrete (GPT) models that a MAR model has no use for
GPT_ONLY = tuple(o for o in SPECULATIVE if o not in ("drafter", "no_ar_baseline")) + (
    "compile", "dtype", "top_k", "top_p", "cfg_interval", "length", "emb_masks")
CSPD_ONLY = ("gamma", "rule", "bandwidth", "sigma_ratio", "prefill", "max_tries", "align", "mar_drafter",
             "mar_drafter_name")
MAR_ONLY = ("num_iter", "cfg_schedule", "last_step_noise", "head_stats", "batch", *CSPD_ONLY)

# API name -> command-line flag, where they differ by more than "_" -> "-"
FLAGS = {"n_nodes": "--nodes", "cfg": "--cfg-scale", "neighbours": "--delta / --lam (the neighbour table)"}


class OptionError(ValueError):
    """An option that is out of bounds or does not apply: ``name`` (the API's) and ``problem``."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def cli_message(error: OptionError) -> str:
    """The error in the command line's words: the flag, then the problem."""
    return f"{flag(error.name)} {error.problem}"


# -- bounds ------------------------------------------------------------------------------------------------

def _plain(x):
    """A numpy scalar as the Python number it holds (as the ops read settings: ``ops.checks.plain``)."""
    from ..ops.checks import plain

    return plain(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value, lo: int, hi: Optional[int] = None, why: str = "") -> None:
    """value must be an int in [lo, hi] (hi None: no upper bound)."""
    value = _plain(value)
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise OptionError(name, f"must be an int {span}{why}, got {value!r}")


def check_seed(seed) -> None:
    seed = _plain(seed)
    if not _is_int(seed) or not 0 <= seed < SEED_END:
        raise OptionError("seed", f"must be an int in [0, 2^64) (the Philox key), got {seed!r}")


def check_cfg_interval(cfg_interval) -> None:
    cfg_interval = _plain(cfg_interval)
    if not _is_int(cfg_interval) or not -1 <= cfg_interval < CFG_INTERVAL_END:
        raise OptionError("cfg_interval", f"must be an int in [-1, 2^31) (-1: guidance at every token), "
                                          f"got {cfg_interval!r}")


def check_tree_sizes(depth, n_nodes, window, static_widths) -> None:
    """The tree options of the speculative loop, each bounded by MAX_TREE_NODES nodes per step."""
    top = MAX_TREE_NODES - 1
    check_int("depth", depth, 1, top, " (draft levels below the root)")
    check_int("n_nodes", n_nodes, 1, top, " (drafted nodes kept per step; for no drafts use method ar)")
    check_int("window", window, 1, top, " (Jacobi drafts per step)")
    try:
        nodes = sum(math.prod(static_widths[: d + 1]) for d in range(len(static_widths)))
    except TypeError:
        return  # not a sequence of ints: SpecConfig's check names it
    if nodes > top:
        raise OptionError("static_widths", f"make a tree of {nodes + 1} nodes; at most {MAX_TREE_NODES} per step")


def check_relaxation(delta, lam) -> None:
    """delta: a total-variation budget in [0, 1]; lam: a multiplicative cap >= 1 (None: delta mode)."""
    delta, lam = _plain(delta), _plain(lam)
    if not _is_number(delta) or not 0 <= delta <= 1:
        raise OptionError("delta", f"must be a total-variation budget in [0, 1], got {delta!r}")
    if lam is not None and (not _is_number(lam) or not 1 <= lam or not (lam - 1) < FLOAT32_MAX):
        raise OptionError("lam", f"must be a number >= 1 with lam - 1 finite in float32 (or None for delta "
                                 f"mode), got {lam!r}")


def check_mar_settings(cfg, temperature, seed, num_iter=None, seq_len: Optional[int] = None) -> None:
    """MAR's sampling settings: guidance finite with |cfg| <= MAR_MAX_CFG, temperature in (0,
    MAR_MAX_TEMPERATURE], the seed, num_iter an int in [1, seq_len] (a step more predicts nothing)."""
    cfg, temperature = _plain(cfg), _plain(temperature)
    if not _is_number(cfg) or not abs(cfg) <= MAR_MAX_CFG:  # NaN fails the comparison
        raise OptionError("cfg_scale", f"must be a finite number with |cfg_scale| <= {MAR_MAX_CFG:g} for MAR, got "
                                       f"{cfg!r}")
    if not _is_number(temperature) or not 0 < temperature <= MAR_MAX_TEMPERATURE:
        raise OptionError("temperature", f"must be a number in (0, {MAR_MAX_TEMPERATURE:g}] for MAR (it scales the "
                                         f"diffusion head's noise), got {temperature!r}")
    check_seed(seed)
    if num_iter is not None:
        check_int("num_iter", num_iter, 1, seq_len, " (MAR steps; at most one per token)" if seq_len else
                  " (MAR steps)")


# -- which options apply -----------------------------------------------------------------------------------

def _method(method: str, cli: bool) -> str:
    return f"--method {method}" if cli else f"method={method!r}"


def _tree(tree: str, cli: bool) -> str:
    return f"--tree {tree}" if cli else f"tree={tree!r}"


def check_applicable(family: str, method: str, given: Mapping[str, object], *, tree: str = "auto",
                     relaxed: bool = False, cli: bool = False) -> None:
    """Refuses (OptionError) the first option in ``given`` (name -> value, the options set to something other
    than their default) that does not apply to the model family ("gpt" | "mar"), the method, the tree and
    whether the acceptance is relaxed (method lantern, or sjd with a neighbour table). cli: the messages
    name flags and --method / --tree values."""
    if family == "mar":
        _check_mar(method, given, cli)
        return
    if method not in GPT_METHODS:
        if method == "cspd":
            raise OptionError("method", "'cspd' (continuous speculative decoding) is for MAR models")
        raise OptionError("method", f"must be one of {GPT_METHODS} for a GPT model, got {method!r}")
    for name in MAR_ONLY:
        if name in given:
            raise OptionError(name, "applies to MAR models only")
    if method == "ar":
        for name in SPECULATIVE:
            if name in given:
                raise OptionError(name, f"does not apply to {_method('ar', cli)} (plain autoregressive decoding)")
        return
    _check_relaxation_options(method, given, relaxed, cli)
    _check_drafting_options(method, given, tree, cli)


def _check_mar(method: str, given: Mapping[str, object], cli: bool) -> None:
    if method not in MAR_METHODS:
        raise OptionError("method", f"must be 'ar' (MAR's own loop) or 'cspd' (continuous speculative decoding) "
                                    f"for a MAR model, got {method!r}")
    for name in GPT_ONLY:
        if name in given:
            raise OptionError(name, "does not apply to MAR models (it is for the discrete GPT models)")
    if method != "cspd":
        for name in CSPD_ONLY + ("no_ar_baseline",):
            if name in given:
                raise OptionError(name, f"applies to {_method('cspd', cli)} only")


def _check_relaxation_options(method: str, given, relaxed: bool, cli: bool) -> None:
    if relaxed:
        if given.get("lam") is not None and given.get("budget", "candidate") != "candidate":
            raise OptionError("budget", "'node' applies to delta mode; lambda mode (lam given) takes the budget "
                                        "per candidate")
        return
    for name in RELAXED_ONLY:
        if name not in given or (name == "delta" and given[name] == 0):
            continue  # delta 0: exact, what a run without relaxation does
        if method == "sjd":
            how = "--delta > 0 or --lam" if cli else "a neighbour table (neighbours=...)"
            raise OptionError(name, f"applies to relaxed acceptance; {_method('sjd', cli)} relaxes only with "
                                    f"{how}, and without it is exact")
        raise OptionError(name, f"applies to relaxed acceptance ({_method('lantern', cli)}, or sjd relaxed), "
                                f"not to the exact {_method(method, cli)}")


def _check_drafting_options(method: str, given, tree: str, cli: bool) -> None:
    if method == "sjd":
        for name in DRAFTER_ONLY:
            if name in given:
                window = flag('window') if cli else 'window'
                raise OptionError(name, f"does not apply to {_method('sjd', cli)}: it has no drafter, its drafts "
                                        f"are the target's own (the window size is {window})")
    else:
        for name in JACOBI_ONLY:
            if name in given:
                raise OptionError(name, f"applies to {_method('sjd', cli)} only")
    if tree == "static" and "depth" in given:
        raise OptionError("depth", f"does not apply to {_tree('static', cli)} (its depth is the number of "
                                   f"static_widths)")
    for name in ("n_nodes", "top_per_node"):
        if name in given and tree != "dynamic":
            raise OptionError(name, f"applies to {_tree('dynamic', cli)} (EAGLE-2) only")
    if "static_widths" in given and tree != "static":
        raise OptionError("static_widths", f"applies to {_tree('static', cli)} only")
    for name in AUTO_ONLY:
        if name in given and tree != "auto":
            raise OptionError(name, f"applies to {_tree('auto', cli)} (the planner) only")
    if tree == "auto" and "plans" in given:
        for name in ("depth", "draft", "window"):
            if name in given:
                raise OptionError(name, "does not apply when plans are given: the planner's candidates are the "
                                        "plans")


def check_gpt_sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval, B: int, device) -> None:
    """The sampling settings of a GPT decoding call, checked as ``ops.verify`` checks them (numbers, or [B]
    tensors on the model's device; finite in float32, ...), but before the call's first forward."""
    from ..ops import checks

    checks.check_sampling_settings(checks.plain(cfg_scale), checks.plain(temperature), checks.plain(top_k),
                                   checks.plain(top_p), B, device)
    checks.check_counter("seed", checks.plain(seed), 64)  # an int, or a one-element tensor, as ops.verify takes
    check_cfg_interval(checks.plain(cfg_interval))
