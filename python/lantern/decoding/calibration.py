"""The calibration of ``tree="auto"``: each plan's step time at a few row counts and the drafts' acceptance,
measured on the device by stepping a real decoding state (``state.DecodeState``, the loop's own step) through
the plans; cached per device, models and settings (``costs.py``).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch

from .. import ops
from .ar import check_condition, check_length, generate_ar
from .compiled import CompileChoice, CompiledRun, CompileStats, resolve_compile
from .config import Sampling, SpecConfig, check_config
from .costs import CostModel, cache_key, cached_cost_model
from .exclusive import holds_models, one_backend_per_run
from .options import check_gpt_sampling
from .planner import AR_PLAN, AcceptanceModel, measured_rates
from .plans import Plan
from .proposers import new_state

CALIBRATION_ROWS = (2,)  # rows (2 x images with guidance) at which each plan's step is timed, and the run's
COMPILED_AR = "ar compiled"  # the point of generate_ar's compiled step (``CompileChoice.ar_loop_apart``)


def _mode(config: SpecConfig, sampling: Sampling, L: int, plans: Sequence[Plan], relaxed: bool,
          choice: Optional[CompileChoice] = None) -> dict:
    """What, besides the device and models, changes a step's cost: the verify work, the candidates and
    whether (and how) the forwards are compiled (and, for the acceptance the calibration measures, the
    drafting rules)."""
    jacobi = {"coupling": config.coupling, "init": config.init} if config.self_drafting else {}
    forwards = "ar" if choice is not None and choice.ar_only else "aot" if choice is not None and choice.aot else "all"
    compiled = {} if choice is None or not choice.on else {"compiled": repr(sorted(choice.options.items())),
                                                            "compiled_forwards": forwards}
    return {**jacobi, **compiled, "method": config.method, "k": config.k if relaxed else 0,
            "budget": config.budget if relaxed else "",
            "lam": config.lam if relaxed else None, "guided": sampling.guided, "length": L,
            # the acceptance the calibration measures depends on these (the step costs do not)
            "delta": config.delta if relaxed else 0.0, "cfg_scale": _number(sampling.cfg_scale),
            "temperature": _number(sampling.temperature),
            "draft": config.draft, "top_k": _positive(sampling.top_k), "top_p": _below_one(sampling.top_p),
            "plans": [p.name for p in plans]}


def _number(x):
    """A scalar setting as a float, a per-row tensor as "per-row"."""
    return "per-row" if isinstance(x, torch.Tensor) else float(x)


def _positive(x) -> bool:
    return bool((torch.as_tensor(x) > 0).any())


def _below_one(x) -> bool:
    return bool((torch.as_tensor(x) < 1).any())


@holds_models("target", "drafter")
@one_backend_per_run("target")
def resolve_cost_model(target, drafter, cond_idx, neighbours=None, *, config: SpecConfig = SpecConfig(),
                       cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, seed: int = 0,
                       length: Optional[int] = None, cfg_interval: int = -1, remeasure: bool = False,
                       emb_masks: Optional[torch.Tensor] = None) -> CostModel:
    """The cost model ``tree="auto"`` uses for these models and settings: cached, or calibrated now (a few
    seconds). Call it before timing a run so the calibration is not part of it."""
    L = check_length(length, target.config.block_size)
    check_condition(target, cond_idx)
    check_config(config, neighbours, target.config.vocab_size, drafter)
    device = target.tok_embeddings.weight.device
    check_gpt_sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval, cond_idx.shape[0], device)
    sampling = Sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval)
    with torch.no_grad():
        return cost_model(target, drafter, cond_idx, neighbours, config, sampling, L,
                          resolve_compile(config.compile, device, (target, drafter)), remeasure, emb_masks)


def cost_model(target, drafter, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
               choice: CompileChoice, remeasure: bool = False, emb_masks=None) -> CostModel:
    """``resolve_cost_model`` for checked settings, with the run's compile choice."""
    plans = config.candidates()
    device = target.tok_embeddings.weight.device
    key = cache_key(device, target, drafter, _mode(config, sampling, L, plans, config.relaxed(neighbours), choice))
    rows = cond_idx.shape[0] * sampling.halves
    grid = sorted(set(CALIBRATION_ROWS) | {rows})

    def measure(missing, known):
        return calibrate(target, drafter, cond_idx, neighbours, config, sampling, L, plans, rows_grid=missing,
                         known=known, emb_masks=emb_masks, choice=choice)

    return cached_cost_model(key, measure, rows=grid, remeasure=remeasure)


class _StepTimer:
    """Steps one decoding state of B images (labels cycled from cond_idx) through the plans it is given, as
    ``tree="auto"`` would switch between them, and times each step; a fresh state starts when every row has
    finished its image. Drafting steps add their acceptance figures to ``counts`` (plan -> hits, trials per depth)."""

    def __init__(self, target, drafter, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
                 plans: Sequence[Plan], B: int, counts: dict, emb_masks=None,
                 compiled: Optional[CompiledRun] = None):
        pick = torch.arange(B, device=cond_idx.device) % cond_idx.shape[0]
        self.labels, self.masks = cond_idx[pick], None if emb_masks is None else emb_masks[pick]
        self.models, self.settings = (target, drafter), (neighbours, config, sampling, L, plans)
        self.counts, self.compiled, self.L = counts, compiled, L
        self.max_depth = max(p.depth for p in plans)
        device = target.tok_embeddings.weight.device
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.state, self.step = None, 0

    def _ready_state(self):
        state = self.state
        if state is None or bool((state.n_done >= self.L).all()):  # one host read, outside any timing
            if state is not None:
                state.close()
            state = self.state = new_state(*self.models, self.labels, *self.settings, catch_up=True,
                                           emb_masks=self.masks, compiled=self.compiled)
        return state

    def __call__(self, plan: Plan) -> float:
        """One step of ``plan`` -> its seconds, host read included (``DecodeState.sync``)."""
        state = self._ready_state()
        self.step += 1
        self.sync()
        compile_stats = self.compiled.stats if self.compiled is not None else None
        compiling = compile_stats.compile_s if compile_stats is not None else 0.0
        t0 = time.perf_counter()
        with ops.checks.values_checked_by_caller():  # as in the decoding loop
            state.step(plan, self.step)
            state.sync(self.max_depth, state.figures)
        self.sync()
        seconds = time.perf_counter() - t0
        if compile_stats is not None:  # a first call of a new graph: its compile is not the step's cost
            seconds = max(seconds - (compile_stats.compile_s - compiling), 0.0)
        if plan in self.counts:
            hits, trials = self.counts[plan]
            for d, (h, t) in enumerate(zip(state.figures.hits, state.figures.trials)):
                hits[d] += h
                trials[d] += t
        return seconds

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


def calibrate(target, drafter, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
              plans: Sequence[Plan], rows_grid: Sequence[int] = CALIBRATION_ROWS, reps: int = 2,
              max_point_s: float = 0.3, known: Optional[CostModel] = None,
              emb_masks: Optional[torch.Tensor] = None, choice: Optional[CompileChoice] = None) -> dict:
    """{"points": seconds per step of the plans at each row count of ``rows_grid`` (labels cycled from
    cond_idx), "acceptance": the chain-equivalent acceptance per level that the drafting steps measured
    (``planner.measured_rates``; the planner's prior)}. ``known``: a cost model already measured at other row
    counts, which this calibration extends.

    At one row count every plan steps the same decoding state in turn, round after round, as ``tree="auto"``
    would switch between them: the steps run at the cache lengths of a real image, the drafter catches up
    after AR steps as it does in a run, and a change of the device's load during the calibration hits
    every plan alike; an AR step runs before each drafting plan's, so AR, the reference, is timed often and
    next to every plan. A step's time includes its host read (``DecodeState.sync``). The first round is not timed
    (first calls, caches); a point is AR's median step, times a drafting plan's median ratio to the AR step
    just before its steps (``_step_points``). After ``reps`` timed rounds, the plans that could beat AR
    (``_could_beat_ar``) get CONFIRM_ROUNDS more. A fresh state starts when every row has finished its image, so
    the steps fall all over the image, as a run's do (its rows run on, uncompacted, until the last is done).

    At the smallest row count every plan is timed. At a larger one AR is timed first, and then only the
    plans that could pay there (``_could_pay``: their time at the largest smaller row count grown by AR's
    growth times their nodes, and the acceptance measured so far); an untimed step longer than 4
    ``max_point_s`` drops a plan too. A plan left out gets, as its point there, the time that left it out
    (the prediction, or that untimed step): extrapolating its smaller row counts' slope could make it look
    cheaper than the bound that said it cannot pay, and the planner would choose it.

    A Jacobi window's acceptance depends on the windows the steps before it used (docs/sjd.md), so the
    interleaved steps say little about it: each window's acceptance is measured on a run of that window alone
    instead (``_jacobi_counts``; once per cost model, not when extending ``known``)."""
    choice = choice or resolve_compile(config.compile, target.tok_embeddings.weight.device, (target, drafter))
    halves = sampling.halves
    points: Dict[str, Dict[int, float]] = {p.name: dict(known.points.get(p.name, {})) if known else {} for p in plans}
    # hits, trials per depth of the drafter's plans; a window's acceptance: _jacobi_counts
    counts = {p: ([0] * p.depth, [0] * p.depth) for p in plans if not p.is_ar and p.family != "jacobi"}
    drafter_counts = dict(counts)
    if known is None or not known.acceptance:
        counts.update(_jacobi_counts(target, cond_idx, neighbours, config, sampling, L, plans, emb_masks))
    # the run's speculative forwards
    compiled = CompiledRun(choice.options, CompileStats(), choice.aot) if choice.speculative_on else None
    if choice.ar_loop_apart:
        points[COMPILED_AR] = dict(known.points.get(COMPILED_AR, {})) if known else {}
    new_rows = set()
    for rows in sorted(rows_grid):
        B = max(rows // halves, 1)
        rows = B * halves
        timer = _StepTimer(target, drafter, cond_idx, neighbours, config, sampling, L, plans, B, drafter_counts,
                           emb_masks, compiled)
        # the graph of tree="auto"'s all-AR runs (generate_ar's), compiled here too, and timed where it
        # competes with the plans (``CompileChoice.ar_loop_apart``): half its pairs before the plans' rounds,
        # half after, so that a drift of the device's speed meets it as it meets them
        pairs = max(reps, COMPILED_AR_PAIRS) if choice.on and choice.ar_loop_apart else 0
        ar_steps = _compiled_ar_steps(target, timer.labels, timer.masks, sampling, L, choice, pairs // 2,
                                      timer.sync, warm_up=True) if choice.on else []
        times, ratios, bounds = _time_plans(timer, plans, points, rows, halves, counts, known, reps, max_point_s)
        timer.close()  # (the runs below take the target's cache)
        ar_steps += _compiled_ar_steps(target, timer.labels, timer.masks, sampling, L, choice, pairs - pairs // 2,
                                       timer.sync)
        if ar_steps:
            times[COMPILED_AR] = [statistics.median(ar_steps)]
        timed = _step_points(times, ratios)
        for name in times:
            if name in timed:
                points[name][rows] = timed[name]
                new_rows.add(rows)
            elif name in bounds:
                points[name][rows] = bounds[name]
    _nested_min(points, plans)
    fresh = {name: {r: s for r, s in by_rows.items() if r in new_rows} for name, by_rows in points.items()}
    return {"points": {name: by_rows for name, by_rows in fresh.items() if by_rows},
            "acceptance": measured_rates(counts, max(p.depth for p in plans))}


def _step_points(times: Dict[str, List[float]], ratios: Dict[str, List[float]]) -> Dict[str, float]:
    """The seconds of a step of each timed plan at one row count: AR's, the median of its timed steps; a
    drafting plan's, the median of its steps' ratios to the AR step just before each, times AR's median
    (the plan's own median where AR has no timed step). A step's cost grows with its position in the image
    (its attention reads more keys: the tiny model's AR step at batch 10 takes 8 ms near the image's start,
    10-11 ms past its middle), and a plan's few timed steps fall where the shared state happens to be; next
    to the AR step at the same position and moment, position and a passing load cancel out."""
    ar_steps = times.get(AR_PLAN.name) or []
    ar_typical = statistics.median(ar_steps) if ar_steps else None
    out = {}
    for name, measured in times.items():
        if ratios.get(name) and ar_typical is not None:
            out[name] = statistics.median(ratios[name]) * ar_typical
        elif measured:
            out[name] = statistics.median(measured)
    return out


def _compiled_ar_steps(target, labels, masks, sampling: Sampling, L: int, choice: CompileChoice, pairs: int,
                       sync, warm_up: bool = False) -> List[float]:
    """Seconds per token of ``generate_ar``'s compiled loop over ``labels``, one per timed pair: (a run of the
    whole image's L tokens - a run of one, the prefill's, just after it) / the L - 1 tokens between (none when
    the image has a single token). The calibration's point is their median (``calibrate``), as the plans'
    points are medians (the fastest of a few would hold AR to its luckiest run and the plans to their typical
    ones). ``warm_up``: a first, untimed run compiles the graph. The whole image, since a step's attention
    grows with its position: the first tokens' steps are cheaper than the image's mean (at batch 10 on a
    2-core CPU, 7.5 ms over the first 10 tokens against 9.2 ms)."""
    s = sampling

    def seconds(length: int) -> float:
        sync()
        t0 = time.perf_counter()
        generate_ar.unguarded(target, labels, cfg_scale=s.cfg_scale, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, cfg_interval=s.cfg_interval, seed=s.seed, length=length,
                              emb_masks=masks, compile=choice)
        sync()
        return time.perf_counter() - t0

    if warm_up:
        seconds(min(L, 2))
    if L < 2:
        return []
    return [max(seconds(L) - seconds(1), 1e-6) / (L - 1) for _ in range(pairs)]


COMPILED_AR_PAIRS = 4  # calibrate: timed pairs of generate_ar's runs (a whole image, a prefill), at least


def _time_plans(timer: _StepTimer, plans: Sequence[Plan], points, rows: int, halves: int, counts: dict,
                known: Optional[CostModel], reps: int, max_point_s: float):
    """The timed steps of the plans at one row count (see ``calibrate``) -> (seconds per plan name, each
    drafting plan's seconds over those of the AR step just before it, the bounds of the plans left out)."""
    times: Dict[str, List[float]] = {p.name: [] for p in plans}
    ratios: Dict[str, List[float]] = {p.name: [] for p in plans if not p.is_ar}
    bounds: Dict[str, float] = {}
    smaller = [r for r in points[AR_PLAN.name] if r < rows]
    todo = list(plans)
    if smaller:  # AR first, then the plans that could pay at this row count
        times[AR_PLAN.name] = [timer(AR_PLAN) for _ in range(reps + 1)][1:]
        ar_seconds = statistics.median(times[AR_PLAN.name])
        rates = _rates_so_far(counts, timer.max_depth, known)
        todo = [p for p in plans if p.is_ar or _could_pay(p, points, max(smaller), rows, ar_seconds, halves, rates,
                                                         max_point_s)]
        for p in plans:  # a plan left out gets the bound that left it out: never a cheaper extrapolation
            if p not in todo and max(smaller) in points[p.name]:
                bounds[p.name] = _predicted(p, points, max(smaller), ar_seconds)
    # AR, the reference every plan is compared with, before each drafting plan's step
    for plan in [q for p in todo if not p.is_ar for q in (AR_PLAN, p)] or [AR_PLAN]:  # untimed
        seconds = timer(plan)
        if smaller and seconds > 4 * max_point_s and not plan.is_ar:
            todo.remove(plan)  # its untimed step already says it is too slow: that step is its point
            bounds[plan.name] = seconds
    for _ in range(reps):
        _timed_round(timer, todo, times, ratios)
    # the plans that could beat AR, timed more: the planner picks the fastest of noisy points, so the plan
    # it picks is the one its few steps flattered most, unless the contenders' points rest on more steps
    rates = _rates_so_far(counts, timer.max_depth, known)
    B = max(rows // halves, 1)
    contenders = [p for p in todo if not p.is_ar and ratios[p.name]
                  and _could_beat_ar(p, statistics.median(ratios[p.name]), B, rates)]
    for _ in range(CONFIRM_ROUNDS if contenders else 0):
        _timed_round(timer, [AR_PLAN, *contenders], times, ratios)
    return times, ratios, bounds


CONFIRM_ROUNDS = 10  # calibrate: more timed rounds of the plans that could beat AR at a row count


def _timed_round(timer: _StepTimer, plans: Sequence[Plan], times: Dict[str, List[float]],
                 ratios: Dict[str, List[float]]) -> None:
    """One timed step of each plan, an AR step before each drafting plan's (AR alone when there is none):
    appends to times, and to ratios each drafting step's seconds over those of the AR step before it."""
    for plan in [p for p in plans if not p.is_ar] or [None]:
        ar_seconds = timer(AR_PLAN)
        times[AR_PLAN.name].append(ar_seconds)
        if plan is not None:
            seconds = timer(plan)
            times[plan.name].append(seconds)
            ratios[plan.name].append(seconds / max(ar_seconds, 1e-9))


def _rates_so_far(counts: dict, max_depth: int, known: Optional[CostModel]):
    """The acceptance per level the calibration's drafting steps measured so far (``known``'s without any)."""
    if any(sum(t) for _, t in counts.values()):
        return measured_rates(counts, max_depth)
    return known.acceptance if known else {}


def _could_beat_ar(plan: Plan, ratio: float, B: int, rates) -> bool:
    """Whether ``plan``, whose step takes ``ratio`` AR steps, could be faster than AR, with PRUNE_SLACK to
    spare: a row's expected tokens per step of it (every row drafting every level, at ``rates``) against
    AR's one."""
    tokens = AcceptanceModel(prior_rates=rates).expected_tokens(plan, B, [B] * plan.depth) / B
    return tokens * (1.0 + PRUNE_SLACK) >= ratio


JACOBI_CALIBRATION_IMAGES = 2  # images of each Jacobi window's acceptance run
JACOBI_CALIBRATION_TOKENS = 32  # tokens per image it generates (at most the image)


def _jacobi_counts(target, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
                   plans: Sequence[Plan], emb_masks=None) -> Dict[Plan, tuple]:
    """Per Jacobi window of ``plans``: (hits, trials) per depth over a run of that window alone, from the image's
    start, of JACOBI_CALIBRATION_IMAGES images (labels cycled from cond_idx) and JACOBI_CALIBRATION_TOKENS
    tokens each."""
    counts = {}
    pick = torch.arange(JACOBI_CALIBRATION_IMAGES, device=cond_idx.device) % cond_idx.shape[0]
    labels, masks = cond_idx[pick], None if emb_masks is None else emb_masks[pick]
    length = min(L, JACOBI_CALIBRATION_TOKENS)
    for plan in plans:
        if plan.family != "jacobi":
            continue
        hits, trials = [0] * plan.depth, [0] * plan.depth
        state = new_state(target, None, labels, neighbours, config, sampling, length, [plan], catch_up=False,
                          emb_masks=masks)
        step, last = 0, None
        with ops.checks.values_checked_by_caller():
            while True:
                active = state.sync(0, last)[0]  # reads the last step's figures
                if last is not None:
                    for d, (h, t) in enumerate(zip(last.hits, last.trials)):
                        hits[d] += h
                        trials[d] += t
                if active == 0:
                    break
                step += 1
                state.step(plan, step)
                last = state.figures
        state.close()
        counts[plan] = (hits, trials)
    return counts


PRUNE_SLACK = 0.25  # calibrate: a plan predicted this much slower than AR at a row count is still timed there


def _predicted(plan: Plan, points: Dict[str, Dict[int, float]], at: int, ar_seconds: float) -> float:
    """A plan's step where an AR step takes ``ar_seconds``, from its time at ``at`` rows: plus AR's growth
    since ``at`` rows times its nodes (the target's forward grows with its tokens, rows x nodes)."""
    ar_growth = max(ar_seconds - points[AR_PLAN.name][at], 0.0)
    return points[plan.name][at] + ar_growth * plan.nodes


def _could_pay(plan: Plan, points: Dict[str, Dict[int, float]], at: int, rows: int, ar_seconds: float,
               halves: int, acceptance, max_point_s: float) -> bool:
    """Whether to time ``plan`` at ``rows`` rows, where an AR step took ``ar_seconds`` (see ``calibrate``):
    measured at ``at`` rows, predicted (``_predicted``) within 4 max_point_s and at most PRUNE_SLACK slower
    than AR in tokens per second, every row drafting every level at the acceptance measured so far."""
    if at not in points[plan.name]:
        return False
    seconds = _predicted(plan, points, at, ar_seconds)
    if seconds > 4 * max_point_s:
        return False
    return _could_beat_ar(plan, seconds / ar_seconds, max(rows // halves, 1), acceptance)


def _contains(big: Plan, small: Plan) -> bool:
    """Whether a step of ``big`` does all the work of a step of ``small`` and more (same kind of drafts, a
    tree that holds small's, at least as many drafter calls); every step contains an AR step."""
    if small.is_ar:
        return True
    if big.kind != small.kind or big.family != small.family or big.depth < small.depth:
        return False
    if big.kind == "dynamic":
        return big.n_nodes >= small.n_nodes and big.top_per_node >= small.top_per_node
    if big.kind == "static":
        return all(b >= w for b, w in zip(big.static_widths, small.static_widths))
    return True  # chains and Jacobi windows


def _nested_min(points: Dict[str, Dict[int, float]], plans: Sequence[Plan]) -> None:
    """Load on a shared device only adds time, and a step never costs more than a step that does all of its
    work and more (``_contains``), nor more than itself at a larger row count: ``points`` is lowered in
    place to the least such bound of the measured times."""
    measured = {p.name: dict(points[p.name]) for p in plans}
    for p in plans:
        for rows in points[p.name]:
            points[p.name][rows] = min(measured[q.name][r] for q in plans if _contains(q, p)
                                       for r in measured[q.name] if r >= rows)
