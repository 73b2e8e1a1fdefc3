"""The statistical harness: test cases (a tree plus its target's settings), running a verify backend on
B copies of a case in one call, turning results into outcome counts, and the oracle's exact laws.

Backends: every name in ``BACKENDS`` (tests/backends.py: reference, cpu, cuda, triton) runs every statistical
test; tests/stats/conftest.py skips, with the reason, those that cannot run here. Callers pass and get CPU
tensors; a backend on a CUDA device (cuda, and triton with a GPU) gets its inputs moved there and returns
its results to the CPU. Negative controls call the reference directly with ``faults=(name,)``.

Replayed backends. Triton's interpreter (how the "triton" backend runs without a GPU) runs each of a
launch's programs in Python, ~0.05-0.2 s per row, so 10^5 draws per call are out of reach. A backend in
``replayed_backends()`` is therefore checked by replay: each call runs the reference on all rows, and the
backend on the first ``REPLAY_ROWS`` rows, which must equal the reference's rows bit for bit (same inputs,
same Philox counters: row b uses counter word row = b in both); the call returns the reference's rows.
The replayed rows are fixed before any outcome is seen and are i.i.d. draws, so a backend whose outcome
law differs from the reference's by total variation eps disagrees on each of them with probability
>= eps: one call misses such a backend with probability <= (1 - eps)^32 (eps = 0.1: 3.4 %), and the ~100
replayed calls of tests/stats together with probability <= (1 - eps)^3200 (eps = 0.005: 1e-7). The
statistical tests then read reference rows, so a replayed backend's calls use REPLAY_DRAWS = 10^4
draws (the G-test is calibrated for any N: false-failure rate <= 1e-6 per assertion; their power is the
reference's own business, proven at DRAWS by the negative controls). In the replay both sides compute in
float32 (float64 inputs rounded to float32 first: the backend's documented precision).
test_negative_controls.py checks that replay catches every deliberate fault. With a CUDA device,
"triton" runs the full DRAWS like every other backend (and so does "cuda", which needs one).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, List, Optional

import numpy as np
import torch

import backends
import lantern
from lantern.ops.reference import verify as reference_verify_module
from lantern.ops.reference.verify import VerifyResult

from . import oracle
from .target64 import target_distributions

BACKENDS = list(backends.NAMES)
FAULTS = ("wrong_residual", "reused_uniform", "off_by_one")
DRAWS = 100_000  # rows (independent draws) per verify call
REPLAY_ROWS = 32  # rows a replayed backend runs per call
REPLAY_DRAWS = 10_000  # rows per statistical call for a replayed backend (its G-tests read reference rows)
ROW_KWARGS = ("uncond_logits", "draft_probs", "cfg_scale", "temperature", "top_k", "top_p")  # [B, ...] inputs


def replayed_backends() -> set:
    """Backends checked by replay: "triton" under Triton's interpreter (no CUDA device)."""
    return {"triton"} if lantern._backend._triton_interpret() and not torch.cuda.is_available() else set()


def _moved(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def backend_verify(backend: str) -> Callable:
    """lantern.ops.verify run under ``lantern.fused(backend)`` on the backend's device, on and to CPU tensors
    (replayed for backends in replayed_backends())."""
    device = backends.device_for(backend)

    def run(*args, **kwargs):
        args, kwargs = [_moved(a, device) for a in args], {k: _moved(v, device) for k, v in kwargs.items()}
        with lantern.fused(backend):
            result = lantern.ops.verify(*args, **kwargs)
        return VerifyResult(*(t.cpu() for t in result))

    if backend not in replayed_backends():
        return run
    replayed = replayed_verify(run, REPLAY_ROWS)
    replayed.draws = REPLAY_DRAWS
    return replayed


def is_replayed(verify: Callable) -> bool:
    return getattr(verify, "draws", None) is not None


def draws_for(verify: Callable) -> int:
    """Rows per statistical call: DRAWS, or REPLAY_DRAWS for a replayed backend."""
    return getattr(verify, "draws", DRAWS)


class ReplayMismatch(AssertionError):
    """A replayed backend's row differs from the reference's."""


def _narrow(value):
    """float64 tensors to float32 (a replayed backend's compute precision), anything else unchanged."""
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.float64 else value


def _first_rows(value, n: int, B: int):
    is_rows = isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == B
    return value[:n] if is_rows else value


def replayed_verify(under_test: Callable, rows: int) -> Callable:
    """A verify that returns the reference's result on every row, after checking that ``under_test`` equals
    the reference bit for bit on the first ``rows`` rows, both computing in float32 (see the module
    docstring)."""

    def run(logits, tokens, parents, neighbours=None, **kwargs):
        with lantern.fused("reference"):
            want = lantern.ops.verify(logits, tokens, parents, neighbours, **kwargs)
        B = logits.shape[0]
        n = min(rows, B)
        first = lambda k, v: _narrow(_first_rows(v, n, B)) if k in ROW_KWARGS else v
        replay = (_narrow(logits[:n]), tokens[:n], parents[:n], neighbours)
        replay_kwargs = {k: first(k, v) for k, v in kwargs.items()}
        with lantern.fused("reference"):
            expected = lantern.ops.verify(*replay, **replay_kwargs)
        got = under_test(*replay, **replay_kwargs)
        for name, a, b in zip(VerifyResult._fields, expected, got):
            if not torch.equal(a, b):
                off = (a != b).reshape(n, -1).any(1).nonzero().flatten().tolist()
                raise ReplayMismatch(f"replayed rows {off} differ from the reference in {name}: "
                                     f"{a[off].tolist()} vs {b[off].tolist()}")
        return want

    return run


def faulty_verify(fault: str) -> Callable:
    """The reference with one deliberate bug (a negative control)."""
    return functools.partial(reference_verify_module.verify, faults=(fault,))


@dataclass
class Case:
    """One draft tree and everything the target needs; arrays are numpy, logits [T, V] float64."""

    tokens: List[int]
    parents: List[int]
    logits: np.ndarray
    neighbours: np.ndarray  # [V, K] int32
    relax: oracle.Relaxation = oracle.EXACT
    uncond: Optional[np.ndarray] = None
    cfg_scale: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    draft: Optional[np.ndarray] = None  # [T, V] the law each node's children were drawn from
    name: str = "case"

    @property
    def T(self) -> int:
        return len(self.tokens)

    @property
    def V(self) -> int:
        return self.logits.shape[1]

    def targets(self) -> np.ndarray:
        """P_n for every node [T, V] (float64, SPEC §1)."""
        return target_distributions(self.logits, self.uncond, self.cfg_scale, self.temperature,
                                    self.top_k, self.top_p)

    def outcome_law(self) -> np.ndarray:
        """Exact law of (last accepted node, next_token) [T, V]."""
        return oracle.walk_outcome_distribution(self.tokens, self.parents, self.targets(), self.neighbours,
                                                self.relax, self.draft)

    def with_relax(self, **kw) -> "Case":
        return replace(self, relax=replace(self.relax, **kw))


def verify_kwargs(relax: oracle.Relaxation) -> dict:
    kw = dict(k=relax.k, delta=relax.delta, budget=relax.budget)
    if relax.lam is not None:
        kw["lam"] = relax.lam
    return kw


def run_rows(verify: Callable, logits, tokens, parents, neighbours, relax: oracle.Relaxation, *, uncond=None,
             draft=None, seed=0, offset=0, dtype=torch.float64, **settings):
    """One verify call on per-row arrays [B, T(, V)]; logits, uncond and draft in ``dtype``."""
    as_t = lambda a, dt: None if a is None else torch.as_tensor(np.ascontiguousarray(a), dtype=dt)
    return verify(as_t(logits, dtype), as_t(tokens, torch.int64), as_t(parents, torch.int64),
                  as_t(neighbours, torch.int32), uncond_logits=as_t(uncond, dtype),
                  draft_probs=as_t(draft, dtype), seed=seed, offset=offset,
                  **verify_kwargs(relax), **settings)


def run_copies(verify: Callable, case: Case, rows: int = DRAWS, seed: int = 0, offset: int = 0,
               dtype=torch.float64):
    """``rows`` copies of the case's tree in one call (rows draw independent uniforms)."""
    tile = lambda a: None if a is None else np.broadcast_to(np.asarray(a), (rows,) + np.asarray(a).shape)
    return run_rows(verify, tile(case.logits), tile(case.tokens), tile(case.parents), case.neighbours,
                    case.relax, uncond=tile(case.uncond), draft=tile(case.draft), seed=seed, offset=offset,
                    dtype=dtype, cfg_scale=case.cfg_scale, temperature=case.temperature, top_k=case.top_k,
                    top_p=case.top_p)


def last_nodes(result) -> np.ndarray:
    """The last accepted node of each row (0 when nothing was accepted)."""
    path = result.path.numpy()
    n = result.accept_len.numpy()
    if path.shape[1] == 0:
        return np.zeros(len(n), dtype=np.int64)
    return np.where(n > 0, path[np.arange(len(n)), np.maximum(n - 1, 0)], 0)


def outcome_counts(result, T: int, V: int) -> np.ndarray:
    """Counts of (last accepted node, next_token) [T, V]."""
    codes = last_nodes(result) * V + result.next_token.numpy()
    return np.bincount(codes, minlength=T * V).reshape(T, V)


def emitted_tokens(result, tokens: np.ndarray) -> List[tuple]:
    """Each row's emitted sequence: the accepted nodes' tokens, then next_token. tokens: [B, T]."""
    path, n, nxt = result.path.numpy(), result.accept_len.numpy(), result.next_token.numpy()
    return [tuple(tokens[b, path[b, :n[b]]].tolist()) + (int(nxt[b]),) for b in range(len(n))]


def first_token_counts(result, tokens: np.ndarray, V: int) -> np.ndarray:
    """Counts of the first emitted token (first accepted token, else next_token). tokens: [T] or [B, T]."""
    n, nxt = result.accept_len.numpy(), result.next_token.numpy()
    tokens = np.broadcast_to(tokens, (len(n),) + np.shape(tokens)[-1:])
    first_node = result.path.numpy()[:, 0] if result.path.shape[1] else np.zeros(len(n), dtype=np.int64)
    first = np.where(n > 0, tokens[np.arange(len(n)), np.maximum(first_node, 0)], nxt)
    return np.bincount(first, minlength=V)


def cell_labels(T: int, V: int) -> List[str]:
    return [f"(last node {t}, next token {v})" for t in range(T) for v in range(V)]


# ---- random ingredients ------------------------------------------------------------------------------

def random_neighbours(rng: np.random.Generator, V: int, K: int) -> np.ndarray:
    """A valid table: K distinct tokens y != x per row, in random order."""
    table = np.empty((V, K), dtype=np.int32)
    for x in range(V):
        others = np.array([y for y in range(V) if y != x])
        table[x] = rng.permutation(others)[:K]
    return table


def random_logits(rng: np.random.Generator, T: int, V: int, scale: float = 1.5) -> np.ndarray:
    return rng.normal(0.0, scale, size=(T, V))


def random_draft(rng: np.random.Generator, T: int, V: int, like: Optional[np.ndarray] = None) -> np.ndarray:
    """Positive drafter rows (each sums to 1); correlated with the logits ``like`` [T, V] when given,
    as a trained drafter would be."""
    base = 0.0 if like is None else 0.7 * np.asarray(like)
    w = np.exp(base + rng.normal(0.0, 0.8, size=(T, V)))
    return w / w.sum(1, keepdims=True)
