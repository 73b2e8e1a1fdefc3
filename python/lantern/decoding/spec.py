"""Speculative decoding of a batch, exact ("spec") or relaxed ("lantern") with a drafter's trees, or drafter-free
with Jacobi self-drafting ("sjd"): the run drivers. The step they repeat is ``state.DecodeState.step``
(propose, one target forward, ``ops.verify``, commit), the drafts come from the method's proposer
(``proposers.py``), the settings from ``config.py``.

Everything hot goes through ``lantern.ops`` (tree_attention inside the model, verify, compact_kv, build_tree),
so ``lantern.enable_fused()`` swaps the kernels without touching the loop; a run resolves them once, at its start
(``exclusive.one_backend_per_run``; ``DecodeState.backends``).

``tree="auto"`` (the default) lets ``planner.Planner`` pick the plan (a tree, a Jacobi window, or plain AR)
from a cost model measured on the device (``calibration.py``, ``costs.py``) and acceptance rates: for a
batch, one plan for the whole run, the fewest predicted seconds until its slowest row is done; for a single
row, each step's plan, with acceptance rates learned from the run's own verify results. The acceptance
rule never depends on the plan, so exact speculative decoding stays exact whatever the planner picks.
docs/sjd.md for the Jacobi windows.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from .. import ops
from .ar import check_condition, check_image_ids, check_length, condition_masks, generate_ar
from .calibration import COMPILED_AR, cost_model
from .compiled import CompileChoice, CompiledRun, CompileStats, resolve_compile
from .config import Sampling, SpecConfig, SpecStats, check_config
from .exclusive import holds_models, one_backend_per_run
from .options import check_gpt_sampling
from .planner import AR_PLAN, AcceptanceModel, Decision, Plan, Planner
from .proposers import drafter_can_compact, new_state
from .state import StepFigures, compacts, progress


@holds_models("target", "drafter")
@one_backend_per_run("target")
@torch.no_grad()
def generate_spec(target, drafter, cond_idx: torch.Tensor, neighbours: Optional[torch.Tensor] = None, *,
                  config: SpecConfig = SpecConfig(), cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0,
                  seed: int = 0, on_step=None, length: Optional[int] = None, cfg_interval: int = -1,
                  emb_masks: Optional[torch.Tensor] = None, image_ids: Optional[torch.Tensor] = None):
    """cond_idx [B] class ids (or t2i caption features [B, C, D] with emb_masks [B, C] or None, as in
    ``generate_ar``) -> (tokens [B, L] int64, SpecStats). The first token is sampled like AR
    (offset 0); verify step s uses offset s. ``length`` (default: the whole image, block_size) stops every
    row after its first ``length`` tokens, a prefix of the image (tests and benchmarks of the first
    positions). Their law is the full run's; the tokens themselves may differ, since trees near the end
    are clipped. ``cfg_interval`` >= 0: tokens past that index are sampled without guidance, as in
    LlamaGen's AR loop (see ``unguided_past_interval``). With ``config.tree == "auto"`` and no
    ``config.cost_model``, the device's cost model is calibrated first (a few seconds, then cached).
    ``image_ids`` [B] (default 0..B-1): each image's Philox row key in every draw, so with a fixed tree an
    image's tokens depend on its id and the settings, not on the batch (docs/sampling.md)."""
    device = target.tok_embeddings.weight.device
    L = check_length(length, target.config.block_size)
    check_condition(target, cond_idx)
    check_config(config, neighbours, target.config.vocab_size, drafter)
    check_gpt_sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval, cond_idx.shape[0], device)
    sampling = Sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval)
    keyed = dataclasses.replace(sampling, rows=check_image_ids(image_ids, cond_idx.shape[0], device))
    condition_masks(target, cond_idx, emb_masks, sampling.guided)  # bad masks fail before any calibration
    choice = resolve_compile(config.compile, device, (target, drafter))
    run = _Run(target, drafter, cond_idx, neighbours, config, keyed, L, emb_masks, choice, on_step)
    if config.tree != "auto":
        return _generate_fixed(run)
    # the calibration steps batches of other sizes: row keys 0..b-1
    costs = config.cost_model or cost_model(target, drafter, cond_idx, neighbours, config, sampling, L, choice,
                                            emb_masks=emb_masks)
    return _generate_auto(run, costs)


@dataclasses.dataclass
class _Run:
    """A run's checked inputs."""
    target: object
    drafter: object
    cond_idx: torch.Tensor
    neighbours: Optional[torch.Tensor]
    config: SpecConfig
    sampling: Sampling  # with the image ids as row keys
    L: int
    emb_masks: Optional[torch.Tensor]
    choice: CompileChoice
    on_step: object

    def start(self, plans, catch_up: bool, stats: SpecStats):
        """The prefilled DecodeState, and the run's CompiledRun (None: eager); stats.compile says which."""
        stats.compile = self.choice.reason
        compiled = CompiledRun(self.choice.options, CompileStats(), self.choice.aot) if self.choice.speculative_on \
            else None
        state = new_state(self.target, self.drafter, self.cond_idx, self.neighbours, self.config, self.sampling,
                          self.L, plans, catch_up, self.emb_masks, compiled)
        stats.target_forwards += 1  # the prefill
        return state, compiled


def _record_step(stats: SpecStats, last: StepFigures, draft_forwards: int, steps: list) -> int:
    """Accounts a step whose figures were read (``DecodeState.sync``) -> its tokens."""
    stats.steps += 1
    stats.target_forwards += 1
    stats.draft_forwards += draft_forwards
    stats.row_steps += last.active_rows
    stats.emitted += last.tokens
    steps.append((last.accept_len, last.active))
    return last.tokens


def _accept_lens(steps: list) -> list:
    """Per step: accept_len of the rows that were generating (host reads after the loop)."""
    return [accept_len[active].cpu() for accept_len, active in steps]


def _record_compile(stats: SpecStats, compiled: Optional[CompiledRun]) -> None:
    if compiled is not None:
        stats.compile_s, stats.compiled_graphs = compiled.stats.compile_s, compiled.stats.graphs


def _generate_fixed(run: _Run, plan: Optional[Plan] = None, planner: Optional[Planner] = None,
                    decision: Optional[Decision] = None):
    """Every step one plan: the config's fixed tree, or ``plan`` (tree="auto" at batch > 1), whose steps
    are then timed into ``planner``'s records against ``decision``."""
    t0 = time.perf_counter()
    stats = SpecStats()
    plan = plan or run.config.fixed_plan()
    state, compiled = run.start([plan], False, stats)
    step, last, forwards, n_emit, steps = 0, None, 0, None, []
    t_step = time.perf_counter()
    with ops.checks.values_checked_by_caller():
        while True:
            counts = state.sync(0, last)  # the step's one host read
            now = time.perf_counter()
            if last is not None:
                tokens = _record_step(stats, last, forwards, steps)
                if planner is not None:
                    planner.record(decision, tokens, now - t_step)
                if run.on_step is not None:
                    run.on_step(n_emit)
            if counts[0] == 0:
                break
            if state.should_compact(counts[0]):
                state.compact()
            t_step = now
            step += 1
            n_emit, forwards = state.step(plan, step)
            last = state.figures
    state.close()
    stats.accept_lens = _accept_lens(steps)
    stats.plan_counts = {plan.name: stats.steps}
    if planner is not None:
        stats.planner = dict(planner.summary(), cost_model=_cost_meta(planner), whole_run=True)
    _record_compile(stats, compiled)
    stats.wall_s = time.perf_counter() - t0
    return state.out, stats


def _cost_meta(planner: Planner) -> dict:
    return {k: v for k, v in planner.cost_model.meta.items() if k != "key"}


PRIOR_STEPS = 8  # tree=auto: the acceptance prior's weight, in steps of the batch


def _planner(run: _Run, costs) -> Planner:
    # the prior weighs PRIOR_STEPS steps of the whole batch: a step of 10 rows is 10 trials, and two
    # unlucky steps must not outweigh a calibration's rates and turn a run to AR for good (AR steps
    # bring no acceptance data)
    config = run.config
    acceptance = AcceptanceModel(prior=config.acceptance_prior, memory=config.acceptance_memory,
                                 prior_rates=costs.acceptance, prior_weight=PRIOR_STEPS * run.cond_idx.shape[0])
    return Planner(costs, config.candidates(), acceptance, adapt_costs=config.adapt_costs, margin=config.margin,
                   compacts=run_compacts(config, run.choice, run.drafter))


def run_compacts(config: SpecConfig, choice: CompileChoice, drafter) -> bool:
    """Whether a run of these settings drops its finished rows from the models' batch (``state.compacts``)."""
    can_compact = not config.self_drafting and drafter_can_compact(drafter)
    return compacts(choice.speculative_on, choice.aot, can_compact)


def _generate_auto(run: _Run, costs):
    t0 = time.perf_counter()
    stats = SpecStats()
    B = run.cond_idx.shape[0]
    planner = _planner(run, costs)
    if B > 1:
        return _generate_planned(run, planner, stats, t0)
    max_depth = planner.max_depth
    # the progress before the first step: every row has its first token
    at_start = progress(torch.ones(B, dtype=torch.int64), run.L, max_depth).tolist()
    first = planner.choose(B * run.sampling.halves, B, at_start[1:])
    if first.plan.is_ar and not first.probe:
        return _generate_all_ar(run, planner, first, stats, t0)
    all_ar = _ar_run_decision(run, planner, first)
    if all_ar is not None:
        return _generate_all_ar(run, planner, all_ar, stats, t0)
    state, compiled = run.start(planner.plans, True, stats)
    compile_stats = compiled.stats if compiled is not None else None
    step, decision, last, forwards, n_emit, steps = 0, None, None, 0, None, []
    t_step, compile_before = time.perf_counter(), 0.0
    with ops.checks.values_checked_by_caller():
        while True:
            counts = state.sync(max_depth, last)  # the step's one host read: the step before is done
            now = time.perf_counter()
            if last is not None:
                tokens = _record_step(stats, last, forwards, steps)
                if not last.plan.is_ar:
                    planner.acceptance.observe(last.plan, last.hits, last.trials)
                # compiled: a step's first calls of new graphs (compile included) are left out of its time
                compiling = compile_stats.compile_s - compile_before if compile_stats is not None else 0.0
                planner.record(decision, tokens, max(now - t_step - compiling, 0.0))
                if run.on_step is not None:
                    run.on_step(n_emit)
            if counts[0] == 0:
                break
            if state.should_compact(counts[0]):
                state.compact()
            t_step = now
            compile_before = compile_stats.compile_s if compile_stats is not None else 0.0
            step += 1
            planner.forget()
            decision = planner.choose(state.forward_rows, counts[0], counts[1:])
            n_emit, forwards = state.step(decision.plan, step)
            last = state.figures
            stats.plan_counts[decision.plan.name] = stats.plan_counts.get(decision.plan.name, 0) + 1
    state.close()
    stats.accept_lens = _accept_lens(steps)
    stats.planner = dict(planner.summary(), cost_model=_cost_meta(planner))
    _record_compile(stats, compiled)
    stats.wall_s = time.perf_counter() - t0
    return state.out, stats


def _generate_planned(run: _Run, planner: Planner, stats: SpecStats, t0: float):
    """tree="auto" at batch > 1: one plan for the whole run, the fewest predicted seconds until the slowest
    row is done (``Planner.plan_run``): a batch steps until its last row finishes, so its time is set by its
    stragglers, which a per-step rate does not see, and a fixed plan's run sizes its caches for that plan
    alone and probes nothing. AR is ``generate_ar``'s loop."""
    rows, B = run.cond_idx.shape[0] * run.sampling.halves, run.cond_idx.shape[0]
    decision = planner.plan_run(rows, B, run.L - 1, _ar_loop_step(run, planner, rows))
    if decision.plan.is_ar:
        return _generate_all_ar(run, planner, decision, stats, t0, whole_run=True)
    tokens, fixed = _generate_fixed(run, decision.plan, planner, decision)
    fixed.wall_s = time.perf_counter() - t0
    return tokens, fixed


def _ar_loop_step(run: _Run, planner: Planner, rows: int) -> float:
    """Predicted seconds of a step of ``generate_ar``'s loop: the planner's AR step, or the calibration's
    compiled AR step (``COMPILED_AR``) where that loop is compiled apart (``CompileChoice.ar_loop_apart``) and
    that is less. Both are a step's cost over the whole image: the compiled step a whole run's mean, the AR
    step the median of the calibration's AR steps, which fall all over the image (the plans' steps are
    timed against the AR step beside them, ``calibration._step_points``)."""
    ar_step = planner.step_seconds(AR_PLAN, rows)
    if run.choice.ar_loop_apart and planner.cost_model.knows(COMPILED_AR):
        return min(ar_step, planner.cost_model.step_seconds(COMPILED_AR, rows))
    return ar_step


def _ar_run_decision(run: _Run, planner: Planner, first: Decision) -> Optional[Decision]:
    """A single row's run as ``generate_ar``'s loop, or None (the speculative loop): AR's L - 1 steps against
    ``first``'s plan (the runner-up when ``first`` probes AR) held for the run (``Planner.run_seconds``),
    which must be faster by the planner's margin."""
    rows, B, remaining = first.rows, run.cond_idx.shape[0], run.L - 1
    plan = first.runner_up if first.probe else first.plan
    if plan is None or plan.is_ar or remaining <= 0:
        return None
    ar_step = _ar_loop_step(run, planner, rows)
    spec_s = planner.run_seconds(plan, rows, B, remaining)
    if remaining * ar_step > spec_s * (1.0 + planner.margin):
        return None
    return Decision(AR_PLAN, B, ar_step, B / ar_step, rows, plan, B * remaining / spec_s)


def _generate_all_ar(run: _Run, planner: Planner, decision, stats: SpecStats, t0: float, whole_run: bool = False):
    """tree="auto" when the run is AR: at batch > 1 the whole-run choice (``whole_run``: the decision's
    figures are whole-run rates); for one row, AR as the plan of the first step, which is then the plan of
    every step (AR steps give the acceptance model no data, their measured time corrects every plan's
    predicted time alike, and the rows' remaining tokens only shrink, which favours AR further), or a
    whole-run prediction (``_ar_run_decision``). The run is ``generate_ar``'s loop: the
    same tokens as AR steps of the speculative loop (one stream, offset = token index), without its
    drafter, tree bookkeeping and per-step host read."""
    B, L, s, device = run.cond_idx.shape[0], run.L, run.sampling, run.cond_idx.device
    on_token = None if run.on_step is None else (
        lambda step: run.on_step(torch.ones(B, dtype=torch.int64, device=device)) if step >= 1 else None)
    compile_stats: dict = {}
    # generate_spec holds the target already
    tokens = generate_ar.unguarded(run.target, run.cond_idx, cfg_scale=s.cfg_scale, temperature=s.temperature,
                                   top_k=s.top_k, top_p=s.top_p, cfg_interval=s.cfg_interval, seed=s.seed,
                                   on_token=on_token, length=L, emb_masks=run.emb_masks, compile=run.choice,
                                   stats=compile_stats, image_ids=s.rows)
    stats.wall_s = time.perf_counter() - t0
    steps = L - 1
    stats.steps = steps
    stats.target_forwards = L
    stats.row_steps = stats.emitted = B * steps
    stats.accept_lens = [torch.zeros(B, dtype=torch.int64) for _ in range(steps)]
    stats.plan_counts = {AR_PLAN.name: steps} if steps else {}
    for _ in range(steps):  # the steps' time, shared out evenly (no step was timed alone)
        planner.record(decision, B, stats.wall_s / steps)
    stats.planner = dict(planner.summary(), cost_model=_cost_meta(planner), all_ar=True)
    if whole_run:  # the decision's figures are whole-run rates (``Planner.plan_run``)
        stats.planner["whole_run"] = True
    stats.compile_s = compile_stats.get("compile_s", 0.0)
    stats.compiled_graphs = compile_stats.get("compiled_graphs", 0)
    stats.compile = compile_stats.get("compile", "")
    return tokens, stats
