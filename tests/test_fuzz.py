"""Differential fuzzer (issue 16): every public op on every backend that runs here, on random inputs.

The property, for every input: **every backend returns the same result, or raises the same class of error
with the same message (ValueError or TypeError: the shared checks of lantern.ops), and an input the op does
not write is never changed** (compact_kv, which writes its cache, leaves it untouched when it raises). Any
other exception (an internal RuntimeError, IndexError, ...) fails the test, and so would a crash.

Inputs (hypothesis draws, on top of the op case builders of tests/op_cases.py): random shapes (empty
batches included), every float dtype, layouts (contiguous, non-contiguous, expanded with stride 0, a
strided last dimension), edge values (+-inf, NaN, -0, denormals, values near the float32 / float16
limits), overflow-prone settings (tiny temperatures, huge guidance scales, top_k past int64, ...), settings
given as Python numbers, numpy scalars, 0-d or per-row tensors of several dtypes, autograd leaves, invalid
trees and ids, and compact_kv inputs that alias the cache's memory.

"The same result":
- verify: equal, except in a greedy row with a near-tie (two guided logits of a node within 2^-20 of the
  largest: whether their probabilities round to a tie depends on the backend's exp; ``verify_agree``).
- philox_uniform, compact_kv (the new lengths and every byte of the cache), ancestor_mask,
  build_tree, process_logits: equal (NaN equal to NaN). Triton computes float64 logits in float32
  (docs/semantics.md "Precision"), so it is compared with the reference run on the float32-rounded inputs.
- latent_neighbours: the reference's table, or one SPEC §2's tie-aware checker accepts (backends may
  differ only between codes whose float32 distances are equal within rounding).
- tree_attention: the same NaN rows; elsewhere within float rounding, relative to the largest value in
  the output's column of V (float32 math everywhere; float16 / bfloat16 outputs within their rounding).
  Finite q / K values stay below 8 in magnitude: softmax amplifies a score's rounding by its size, so
  scores near float32's range would differ between summation orders without any bug.
- continuous_verify: decisions and tries equal, an accepted token the draft bit for bit, a proposal within
  float32 rounding of its scale (1 + |mu_p| + 7 sigma_p; docs/cspd.md). Finite means and stds stay below
  1e30, so that no proposal is near float32's overflow.
Backends: reference, cpu, cuda (on a GPU) and triton; under Triton's interpreter (no GPU) triton gets few,
tiny cases.

The cost-model cache's reader (lantern.decoding.costs) is fuzzed at the end of the file: whatever an entry
holds (a well-formed, stale or broken JSON table, any JSON value anywhere in it, mangled or random bytes; a
regular file, a folder, a FIFO, a symlink, an oversized file), the cache never raises or hangs, and it either
uses the entry, which the planner can then cost at any row count, or measures again, with a "corrupt"
warning unless the entry was only stale.

Profiles (tests/conftest.py): "ci", the default (derandomized: the same cases every run), and "long":
``python -m pytest tests/test_fuzz.py --hypothesis-profile=long`` (docs/hardening.md).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

import backends
import lantern
from lantern import ops
from lantern.decoding import costs
from lantern.decoding.planner import FAMILIES, AcceptanceModel, Planner, candidate_plans, jacobi_plans
from lantern.guidance import guide
from op_cases import (
    attention_inputs,
    compact_case,
    continuous_block,
    integer_codebook,
    random_case,
    random_codebook,
    random_expansion,
    random_parents,
)

# numpy's floating-point warnings (overflow / invalid value encountered in ...): the edge values are
# meant to overflow, in the interpreter's numpy arithmetic and in numpy scalars alike
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

USABLE = backends.usable(backends.NAMES)  # "reference" first
FAST = [b for b in USABLE if not backends.interpreted(b)]
INTERPRETED = [b for b in USABLE if backends.interpreted(b)]
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# examples per test, from the profile's max_examples (ci: 100, long: 2000): compiled backends 10x, the
# interpreter (about 0.1-0.5 s a case) 1/3, at least 4
COMPILED_FACTOR, INTERPRETED_SHARE = 10, 3


def _test_on(names):
    def test(case):
        check_everywhere(case, names)
    return test


def fuzz_tests(strategy):
    """Two tests of one case strategy: on the compiled backends with the profile's examples, and on the
    interpreted ones (a GPU-less triton) with a few tiny cases; each is skipped when its group has no fused
    backend here."""
    tests = []
    for fast in (True, False):
        names = FAST if fast else ["reference"] + INTERPRETED
        profile = settings.default.max_examples
        examples = profile * COMPILED_FACTOR if fast else max(4, profile // INTERPRETED_SHARE)

        test = _test_on(names)
        test = settings(max_examples=examples)(given(case=strategy(tiny=not fast))(test))
        test = pytest.mark.skipif(len(names) < 2, reason="no fused backend in this group runs here")(test)
        tests.append(test)
    return tests


# ---- running one case on every backend ------------------------------------------------------------------

class Raised(NamedTuple):
    kind: type
    message: str


class Case(NamedTuple):
    """``make(device)`` builds fresh inputs (args, kwargs), the same on every call; ``narrow`` the same with
    float64 tensors rounded to float32 (what triton computes from), or None when nothing is float64."""
    op: str
    make: Callable
    narrow: Callable = None


def tensors_in(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as comparable bits (NaN payloads and -0 included), on the CPU."""
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def run(backend: str, case: Case, make=None):
    """The op's outcome on ``backend`` (its result on the CPU, or Raised), after checking that no input it
    must not write was changed."""
    args, kwargs = (make or case.make)(backends.device_for(backend))
    inputs = tensors_in((args, kwargs))
    before = [bits(t) for t in inputs]
    with lantern.fused(backend):
        try:
            out = getattr(ops, case.op)(*args, **kwargs)
        except (ValueError, TypeError) as e:
            out = Raised(type(e), str(e))
    written = args[0] if case.op == "compact_kv" and not isinstance(out, Raised) else None
    for t, old in zip(inputs, before):
        if t is not written:
            assert torch.equal(bits(t), old), f"{backend}: {case.op} changed an input it does not write"
    if written is not None:
        out = (out, written)
    return out if isinstance(out, Raised) else tuple(t.detach().cpu() for t in tensors_in(out))


def check_everywhere(case: Case, names) -> None:
    reference = run("reference", case)
    note(f"reference: {reference if isinstance(reference, Raised) else 'a result'}")
    event(f"{case.op}: " + (f"{reference.kind.__name__} ({' '.join(reference.message.split()[:3])} ...)"
                             if isinstance(reference, Raised) else "result"))
    narrowed = None
    for backend in names[1:]:
        want = reference
        if backend == "triton" and case.narrow is not None and not isinstance(reference, Raised):
            # the checks judge the inputs as given; triton's results are the reference's on narrowed inputs
            narrowed = narrowed or run("reference", case, case.narrow)
            want = narrowed
        got = run(backend, case)
        if isinstance(want, Raised) or isinstance(got, Raised):
            assert isinstance(want, Raised) and isinstance(got, Raised), f"{backend}: {got} vs reference {want}"
            assert got.kind is want.kind and got.message == want.message, (
                f"{backend} raised {got}, the reference {want}")
            continue
        COMPARE.get(case.op, equal)(want, got, backend, case)
    report = lantern.self_check_report()
    assert all(v is None for v in report.values()), report  # every fused kernel really ran


def equal(want, got, backend, case) -> None:
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, (backend, i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(bits(a), bits(b)), f"{backend}: output {i} differs\n{a}\n{b}\ninputs: {case.make('cpu')}"


def attention_close(want, got, backend, case) -> None:
    """The same NaN elements; elsewhere |got - want| <= tol (1 + the largest |V| in the column)."""
    (a,), (b,) = want, got
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan()), f"{backend}: NaN rows differ\n{a.isnan().any(-1)}\n{b.isnan().any(-1)}"
    q, k, v, cache_len, _ = case.make(torch.device("cpu"))[0]
    B, H, T, Dh = q.shape
    vf = v.detach().float()
    used = torch.arange(v.shape[2])[None, :] < (cache_len + T)[:, None]  # [B, Lmax]
    vf = torch.where(used[:, None, :, None] & torch.isfinite(vf), vf.abs(), 0.0)
    scale = 1 + vf.amax(2).repeat_interleave(H // v.shape[1], dim=1)[:, :, None, :]  # [B, H, 1, Dh]
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(a.dtype, 2e-5)
    ok = a.isnan() | ((a.double() - b.double()).abs() <= tol * scale.double())
    assert bool(ok.all()), f"{backend}: max error {((a.double() - b.double()).abs() / scale).nan_to_num().max()}"


def neighbours_agree(want, got, backend, case) -> None:
    """The reference's table, or one that SPEC §2's tie-aware checker accepts (backends may order codes
    differently where their distances are equal within float32 rounding, e.g. another normalisation)."""
    from neighbour_check import assert_neighbours_valid

    (a,), (b,) = want, got
    if a.shape == b.shape and torch.equal(a, b):
        return
    (codebook, K, normalize), _ = case.make(torch.device("cpu"))
    assert_neighbours_valid(codebook, int(K), bool(normalize), b)


NEAR_TIE = 2.0 ** -20  # guided logits this close (relative to max(1, |l|)) round to equal probabilities or not


def verify_agree(want, got, backend, case) -> None:
    """Equal, except in the rows where greedy verification meets a near-tie: a greedy row (temperature 0)
    one of whose nodes has two different guided logits within NEAR_TIE of its largest. SPEC §4 compares
    probabilities, ties going to the lower index, and two backends' exp may round such logits' probabilities
    to a tie or not (torch's vectorised exp against the cpu kernel's std::exp: logits 0 and 6e-8, a float16
    denormal, gave the probabilities 1 and 1 - 2^-24 in one and equal ones in the other)."""
    exempt = greedy_near_ties(*case.make(torch.device("cpu")))
    if not bool(exempt.any()):
        equal(want, got, backend, case)
        return
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, (backend, i, a.dtype, b.dtype, a.shape, b.shape)
        same = (bits(a) == bits(b)).reshape(len(exempt), -1).all(-1)  # [B]: every output has a row per row
        assert bool(same[~exempt].all()), f"{backend}: output {i} differs\n{a}\n{b}\ninputs: {case.make('cpu')}"


def greedy_near_ties(args, kwargs) -> torch.Tensor:
    """[B] bool: the rows of a verify call that are greedy and meet a near-tie (``verify_agree``)."""
    logits = args[0].detach().double()  # [B, T, V]
    B = logits.shape[0]
    if B == 0 or logits.shape[-1] < 2:
        return torch.zeros(B, dtype=torch.bool)
    uncond = kwargs.get("uncond_logits")
    if uncond is not None:
        logits = guide(logits, uncond.detach().double(), per_row(kwargs.get("cfg_scale", 1.0)))
    top2 = torch.nan_to_num(logits, nan=-math.inf).topk(2, dim=-1).values  # [B, T, 2]
    gap = top2[..., 0] - top2[..., 1]
    near = (gap > 0) & (gap <= NEAR_TIE * top2[..., 0].abs().clamp(min=1.0))  # [B, T]
    return (per_row(kwargs.get("temperature", 1.0)).expand(B) == 0) & near.any(-1)


def per_row(value) -> torch.Tensor:
    """A setting as given (a number, a numpy scalar, a 0-d or [B] tensor) -> float64 [1] or [B]."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().reshape(-1)
    return torch.as_tensor(np.asarray(value, dtype=np.float64)).reshape(-1)


COMPARE = {"tree_attention": attention_close, "latent_neighbours": neighbours_agree, "verify": verify_agree}


def greedy_near_tie_case(temperature: float) -> Case:
    """A verify call the fuzzer found: row 0's root has the logits 6e-8 (a float16 denormal) and 0, which the
    cpu kernel's probabilities tell apart and the reference's round to a tie (row 1 has no near-tie)."""
    h = 0.5
    logits = torch.tensor([[[-1, -h, 0, -h, 5.9605e-08, 0, -0.0, -h], [h, 0, -0.0, -h, -1, h, -0.0, -h],
                            [-0.0, h, -1, 0, -h, 0, -0.0, -1], [-1, h, -h, -h, h, -h, h, h]],
                           [[-0.0, -h, -h, -h, -0.0, -h, -h, h], [h, 0, -h, -h, -0.0, -h, 0, h],
                            [h, h, -h, -h, -0.0, -h, h, -h], [-0.0, -h, 0, -0.0, -h, 0, -h, -1]]],
                          dtype=torch.float16)
    args = (logits, torch.tensor([[1, 4, 0, 2], [0, 7, 0, -1]]), torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, -1]]),
            torch.tensor([[3], [7], [0], [2], [2], [0], [0], [6]], dtype=torch.int32))
    kwargs = dict(cfg_scale=2.0, temperature=torch.tensor([temperature, 0.0], dtype=torch.float64),
                  top_k=torch.tensor([6, 0]), top_p=torch.tensor([0.2, 0.99], dtype=torch.float64), k=1,
                  seed=6769442066901142775, offset=2148998348, delta=0.0, budget="node")
    return case_from("verify", args, kwargs)


@pytest.mark.skipif("cpu" not in FAST, reason="needs the cpu kernels")
def test_verify_comparison_exempts_only_the_greedy_rows_with_a_near_tie():
    """The fuzzer's case: the cpu kernel and the reference differ in row 0 (a greedy near-tie), which
    verify_agree exempts and ``equal`` does not. Negative controls: row 1 (greedy, no near-tie) is still
    compared, and so is row 0 once it samples (temperature 1: no exemption)."""
    case = greedy_near_tie_case(0.0)
    want, got = run("reference", case), run("cpu", case)
    assert not torch.equal(want[0], got[0])  # the divergence this comparison exists for
    with pytest.raises(AssertionError):
        equal(want, got, "cpu", case)
    assert greedy_near_ties(*case.make("cpu")).tolist() == [True, False]
    verify_agree(want, got, "cpu", case)
    changed = tuple(t.clone() for t in got)
    changed[0][1] += 1  # a difference in row 1
    with pytest.raises(AssertionError, match="output 0 differs"):
        verify_agree(want, changed, "cpu", case)
    assert greedy_near_ties(*greedy_near_tie_case(1.0).make("cpu")).tolist() == [False, False]


# ---- values, layouts, argument kinds ------------------------------------------------------------------

EDGES = {  # per dtype: values that stress conversions and range checks (finite ones, then the rest)
    torch.float32: [-0.0, 1e-45, 1e-40, 3.3e38, -3.3e38, 1e30, -1e30],
    torch.float64: [-0.0, 5e-324, 1e-40, 3.3e38, -3.3e38, 1e300, -1e300, 3.5e38],
    torch.float16: [-0.0, 6e-8, 65504.0, -65504.0, 1e4],
    torch.bfloat16: [-0.0, 1e-40, 3.3e38, -3.3e38, 1e30],
}
NON_FINITE = [math.inf, -math.inf, math.nan]


def pick(draw, valid, invalid=(), rare: float = 0.05):
    """A drawn value: from ``invalid`` with probability ``rare``, else from ``valid``, so that most cases
    pass the checks and reach the kernels (an invalid setting is tried about once in 1 / rare cases)."""
    if invalid and draw(st.integers(0, 999)) >= 1000 - rare * 1000:  # shrinks towards the valid values
        return draw(st.sampled_from(list(invalid)))
    return draw(st.sampled_from(list(valid)))


def rarely(draw, one_in: int) -> bool:
    """True once in ``one_in`` draws (False is the simplest, so failures shrink towards ordinary cases)."""
    return draw(st.integers(0, one_in - 1)) == one_in - 1


def edges(draw, dtype, extra=()):
    """Values to poke into a float tensor: its dtype's edges and ``extra``, non-finite ones rarely."""
    return EDGES[dtype] + list(extra) + ([pick(draw, [0.0], NON_FINITE, 0.3)])
LAYOUTS = ["contiguous", "contiguous", "transposed", "expanded", "strided"]


def poke(draw, t: torch.Tensor, values, max_hits=3) -> torch.Tensor:
    """t with a few elements replaced by drawn values (a contiguous copy)."""
    t = t.contiguous().clone()
    if t.numel() == 0:
        return t
    for _ in range(draw(st.integers(0, max_hits))):
        flat = draw(st.integers(0, t.numel() - 1))
        t.view(-1)[flat] = draw(st.sampled_from(values))
    return t


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``t`` (``expanded``: t's first row is repeated, see ``expandable``) in a layout."""
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "expanded" and t.dim() >= 1 and t.shape[0] > 0:
        return t[:1].expand(t.shape)
    if layout == "strided" and t.dim() >= 1:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t.clone()


def expandable(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The data an ``expanded`` layout will show: every row equal to the first."""
    return t[:1].expand(t.shape).clone() if layout == "expanded" and t.dim() >= 1 and t.shape[0] > 0 else t


def setting(draw, value, B: int):
    """A setting in one of the forms the ops accept (or, now and then, a bool, which they refuse): the Python
    number, a numpy scalar, a 0-d tensor or a [B] tensor of one of several dtypes. A value the form cannot
    hold (an int past int64, a float past float16) stays a Python number."""
    kind = draw(st.sampled_from(["python"] * 5 + ["numpy", "0d", "rows", "rows"] + ["bool"] * rarely(draw, 10)))
    integer = isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return True
    if kind == "python" or (integer and not -2**63 <= value < 2**63):
        return value
    if kind == "numpy":
        return np.int64(value) if integer else np.float32(value)
    if kind == "0d":
        return torch.tensor(value, dtype=torch.int64 if integer else torch.float64)
    halves = [torch.float16] * (abs(value) < 6e4)  # float16 only where the value fits
    dtypes = [torch.int64, torch.int32] if integer else [torch.float32, torch.float64] + halves
    chosen = draw(st.sampled_from(dtypes))
    if chosen == torch.int32 and not -2**31 <= value < 2**31:
        return value
    return torch.full((B,), value, dtype=torch.int64 if integer else torch.float64).to(chosen)


def to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to(v, device) for v in value)
    return value


def narrowing(args, kwargs):
    """float64 tensors of (args, kwargs) rounded to float32, or None if there are none."""
    def narrow(v):
        return v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.dim() == 3 else v
    if not any(t.dtype == torch.float64 and t.dim() == 3 for t in tensors_in((args, kwargs))):
        return None
    return tuple(narrow(a) for a in args), {k: narrow(v) for k, v in kwargs.items()}


def case_from(op, args, kwargs, layouts=None, grads=()) -> Case:
    """A Case that rebuilds (args, kwargs) on a device, each named tensor in its layout, the float ones in
    ``grads`` as autograd leaves."""
    layouts = layouts or {}

    def build(a, kw):
        def make(device):
            def place(name, v):
                if not isinstance(v, torch.Tensor):
                    return v
                t = laid_out(v, layouts.get(name, "contiguous")).to(device)
                if name in grads and t.is_floating_point():
                    t = t.detach().requires_grad_(True) if t.is_contiguous() else t  # a leaf
                return t
            names = [f"arg{i}" for i in range(len(a))]
            return (tuple(place(n, v) for n, v in zip(names, a)), {k: place(k, v) for k, v in kw.items()})
        return make

    narrow = narrowing(args, kwargs) if op == "verify" else None  # the one op triton computes narrower
    return Case(op, build(args, kwargs), build(*narrow) if narrow else None)


# ---- verify --------------------------------------------------------------------------------------------

@st.composite
def verify_cases(draw, tiny):
    V = draw(st.integers(1, 10 if tiny else 40))
    T = draw(st.integers(1, 4 if tiny else 7))
    B = draw(st.integers(0, 2 if tiny else 5))
    dtype = draw(st.sampled_from(FLOATS))
    args, kwargs = random_case(draw(st.integers(0, 2**31)), V=V, T=T, B=max(B, 1), dtype=torch.float64)
    logits, tokens, parents, nbrs = args
    logits, tokens, parents = logits[:B], tokens[:B], parents[:B]
    layouts = {name: draw(st.sampled_from(LAYOUTS)) for name in ("arg0", "arg1", "arg2", "uncond_logits")}
    logits = expandable(logits, layouts["arg0"])
    tokens, parents = expandable(tokens, layouts["arg1"]), expandable(parents, layouts["arg2"])
    if layouts["arg1"] == "expanded" or layouts["arg2"] == "expanded":
        tokens, parents = expandable(tokens, "expanded"), expandable(parents, "expanded")
        layouts["arg1"] = layouts["arg2"] = "expanded"
    if draw(st.booleans()):
        logits = poke(draw, logits, edges(draw, dtype, [-math.inf] * 3))
    if rarely(draw, 16):  # a node with every token masked
        if B:
            logits[draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))] = -math.inf
    for name in ("uncond_logits", "draft_probs"):
        if kwargs[name] is not None:
            kwargs[name] = kwargs[name][:B]
            if name == "uncond_logits":
                kwargs[name] = expandable(kwargs[name], layouts[name])
            if rarely(draw, 4):
                kwargs[name] = poke(draw, kwargs[name], edges(draw, dtype) if name == "uncond_logits"
                                    else [0.0, 1e-30, 1e30, pick(draw, [1.0], [math.nan, math.inf, -1.0], 0.2)])
            kwargs[name] = kwargs[name].to(dtype)
    if rarely(draw, 16) and B:  # an invalid tree or token
        which = draw(st.sampled_from(["root", "order", "token", "pad"]))
        b, i = draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))
        if which == "root":
            parents[b, 0] = 0
        elif which == "order":
            parents[b, i] = i
        elif which == "token":
            tokens[b, i] = draw(st.sampled_from([V, -2, 2**40]))
        else:
            parents[b, i], tokens[b, i] = -1, 3
    settings_drawn = dict(
        cfg_scale=pick(draw, [2.0, 2.0, 0.0, -1.5, 1e30], [1e39, math.nan, math.inf]),
        temperature=pick(draw, [1.0, 1.0, 0.5, 0.0, 0.0, 1e-30, 1e-44, 1e30], [1e-46, 1e39, -1.0, math.inf]),
        top_k=pick(draw, [0, 0, 1, 2, V - 1, V, V + 1, 2**62, 2**63 - 1], [2**63, -1]),
        top_p=pick(draw, [1.0, 1.0, 0.9, 0.5, 1e-300], [0.0, 1.5, math.nan]),
    )
    for name, value in settings_drawn.items():
        if rarely(draw, 3):
            kwargs[name] = value
        if not isinstance(kwargs[name], torch.Tensor) or draw(st.booleans()):
            base = kwargs[name] if not isinstance(kwargs[name], torch.Tensor) else value
            kwargs[name] = setting(draw, base, B)
        elif isinstance(kwargs[name], torch.Tensor):
            kwargs[name] = kwargs[name][:B] if kwargs[name].dim() == 1 else kwargs[name]
    K = 0 if nbrs is None else nbrs.shape[1]
    k = pick(draw, [kwargs["k"], kwargs["k"], 0, K], [K + 1, -1])
    kwargs["k"] = setting(draw, k, B) if rarely(draw, 10) else k
    if nbrs is not None and rarely(draw, 16):
        nbrs = poke(draw, nbrs, [V, -1, 2**31 - 1])
    if "lam" in kwargs:
        kwargs["lam"] = pick(draw, [kwargs["lam"], 1.0, 1e30, np.float32(1.5)], [1e39, 0.5, math.nan])
    else:
        kwargs["delta"] = pick(draw, [kwargs["delta"], 0.0, 1.0, 1e30, np.float64(0.1)], [1e39, -0.1, math.nan])
    kwargs["seed"] = pick(draw, [kwargs["seed"], 0, 2**64 - 1, np.uint64(2**63 + 5), torch.tensor(-5),
                                 torch.tensor([7], dtype=torch.int32)], [2**64, -1, torch.tensor(1.0)])
    kwargs["offset"] = pick(draw, [kwargs["offset"], 0, 2**32 - 1, np.int64(9), torch.tensor(3)], [2**32, -1])
    args = (logits.to(dtype), tokens, parents, nbrs)
    grads = ("arg0", "uncond_logits") if rarely(draw, 6) else ()
    note(f"verify B={B} T={T} V={V} {dtype} layouts={layouts} grads={grads}")
    return case_from("verify", args, kwargs, layouts, grads)


test_fuzz_verify, test_fuzz_verify_interpreted = fuzz_tests(verify_cases)


# ---- process_logits (reference only: every backend runs it; the checks are what differ if anything) ------

@st.composite
def process_logits_cases(draw, tiny):
    dtype = draw(st.sampled_from(FLOATS))
    shape = draw(st.sampled_from([(5,), (2, 6), (3, 2, 4), (0, 4), (2, 1)]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = poke(draw, torch.randn(shape, generator=g, dtype=torch.float64) * 3, edges(draw, dtype, [-math.inf] * 3))
    uncond = poke(draw, torch.randn(shape, generator=g, dtype=torch.float64), edges(draw, dtype)) \
        if draw(st.booleans()) else None
    rows = shape[0] if len(shape) >= 2 else 1
    kwargs = dict(uncond_logits=None if uncond is None else uncond.to(dtype),
                  cfg_scale=setting(draw, pick(draw, [1.5, 0.0, 1e30], [1e39]), rows),
                  temperature=setting(draw, pick(draw, [1.0, 0.0, 1e-30, 0.7], [1e-46, 1e39]), rows),
                  top_k=setting(draw, pick(draw, [0, 1, 3], [2**63]), rows),
                  top_p=setting(draw, pick(draw, [1.0, 0.5, 1e-300, 0.95], [0.0]), rows))
    layout = draw(st.sampled_from(LAYOUTS))
    return case_from("process_logits", (expandable(logits, layout).to(dtype),), kwargs, {"arg0": layout})


test_fuzz_process_logits, test_fuzz_process_logits_interpreted = fuzz_tests(process_logits_cases)


# ---- tree_attention ------------------------------------------------------------------------------------

ATTENTION_EDGES = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, 1e-30, 7.5, -7.5]  # finite ones < 8


@st.composite
def attention_cases(draw, tiny):
    B = draw(st.integers(1, 2 if tiny else 3))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2 if tiny else 3))
    T = draw(st.integers(1, 3 if tiny else 6))
    Dh = draw(st.sampled_from([1, 3, 8, 16] if tiny else [1, 3, 8, 16, 20, 32, 64]))
    cache_len = [draw(st.integers(0, 4 if tiny else 70)) for _ in range(B)]
    Lmax = max(cache_len) + T + draw(st.integers(0, 2))
    dtype = draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**31))
    layout = draw(st.sampled_from(["contiguous", "strided"]))
    q, k, v, lengths = attention_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed, torch.float64, layout)
    q, k, v = (poke(draw, t, ATTENTION_EDGES) if rarely(draw, 3) else t for t in (q, k, v))
    v = poke(draw, v, [1e30, -1e30, 65504.0]) if rarely(draw, 5) else v
    parents = random_parents(random.Random(seed), B, T, 0.2)
    mask = ops.ancestor_mask(parents)
    if rarely(draw, 16):  # invalid lengths or mask bits
        lengths[0] = draw(st.sampled_from([-1, Lmax - T + 1]))
    if rarely(draw, 16):
        mask[0, 0, 0] = 0
    same_kv = rarely(draw, 6)  # k and v one tensor (inputs may alias each other)
    layouts = {"arg0": pick(draw, ["contiguous", "contiguous", "transposed", "expanded"], ["strided"], 0.1)}
    q = expandable(q, layouts["arg0"])
    grads = ("arg0", "arg1", "arg2") if rarely(draw, 6) else ()
    args = (q.to(dtype), k.to(dtype), (k if same_kv else v).to(dtype), lengths, mask)
    note(f"tree_attention B={B} H={H} Hkv={Hkv} T={T} Dh={Dh} len={cache_len} Lmax={Lmax} {dtype} {layout} "
         f"layouts={layouts} same_kv={same_kv} grads={grads}")
    case = case_from("tree_attention", args, {}, layouts, grads)
    if layout == "strided":  # k / v as [B, Lmax, Hkv, Dh] buffers viewed [B, Hkv, Lmax, Dh]
        make = case.make

        def strided(device):
            (q_, k_, v_, *rest), kw = make(device)
            k_, v_ = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)
                      for t in (k_, v_))
            return (q_, k_, v_, *rest), kw
        case = Case(case.op, strided, None)
    return case


test_fuzz_tree_attention, test_fuzz_tree_attention_interpreted = fuzz_tests(attention_cases)


# ---- compact_kv ----------------------------------------------------------------------------------------

@st.composite
def compact_cases(draw, tiny):
    lead = draw(st.sampled_from([(), (2,), (2, 2)] if not tiny else [(), (2,)]))
    B, Hkv = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    Lmax, Dh, P = draw(st.integers(2, 9)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(FLOATS))
    rng = random.Random(draw(st.integers(0, 2**31)))
    cache, cache_len, path, n_keep = compact_case(rng, lead, B, Hkv, Lmax, Dh, P, torch.float64,
                                                  any_order=draw(st.booleans()))
    cache = poke(draw, cache, edges(draw, dtype)).to(dtype)
    fault = pick(draw, [None, None, None, "neighbour"],
                 ["len", "keep", "node", "pad", "alias", "alias", "grad", "noncontiguous", "int32"], 0.35)
    if fault == "len":
        cache_len[0] = draw(st.sampled_from([-1, Lmax + 1]))
    elif fault == "keep":
        n_keep[0] = draw(st.sampled_from([-1, P + 1, Lmax]))
    elif fault == "node":
        path[0, 0] = draw(st.sampled_from([-2, Lmax]))
    elif fault == "pad" and n_keep[0] > 0:
        path[0, 0] = -1
    note(f"compact_kv lead={lead} B={B} Hkv={Hkv} Lmax={Lmax} Dh={Dh} P={P} {dtype} fault={fault}")
    which = draw(st.sampled_from(["cache_len", "path_nodes", "n_keep"]))
    offset = draw(st.integers(0, 3))

    def make(device):
        c = cache.clone().to(device)
        lengths, nodes, keep = cache_len.to(device), path.to(device), n_keep.to(device)
        if fault == "alias":  # one index tensor inside the cache's bytes, holding its own values
            target = {"cache_len": lengths, "path_nodes": nodes, "n_keep": keep}[which]
            raw = c.view(-1).view(torch.uint8)
            need = target.numel() * 8
            start = min(offset * 8, (raw.numel() - need) // 8 * 8)
            if start >= 0:
                alias = raw[start:start + need].view(torch.int64).view(target.shape)
                alias.copy_(target)
                lengths, nodes, keep = (alias if n == which else t for n, t in
                                        (("cache_len", lengths), ("path_nodes", nodes), ("n_keep", keep)))
        elif fault == "neighbour":  # the lengths right after the cache in one buffer: allowed
            raw = torch.zeros(c.numel() * c.element_size() + 8 * B, dtype=torch.uint8, device=device)
            raw[:c.numel() * c.element_size()] = c.view(-1).view(torch.uint8)
            c = raw[:c.numel() * c.element_size()].view(c.dtype).view(c.shape)
            tail = raw[c.numel() * c.element_size():]
            if tail.data_ptr() % 8 == 0:
                lengths = tail.view(torch.int64).copy_(lengths)
        elif fault == "grad":
            c = c.requires_grad_(True)
        elif fault == "noncontiguous" and c.dim() >= 2:
            c = c.transpose(-1, -2).contiguous().transpose(-1, -2) if c.shape[-1] > 1 and c.shape[-2] > 1 else c
        elif fault == "int32":
            lengths = lengths.to(torch.int32)
        return (c, lengths, nodes, keep), {}
    return Case("compact_kv", make)


test_fuzz_compact_kv, test_fuzz_compact_kv_interpreted = fuzz_tests(compact_cases)


# ---- latent_neighbours ---------------------------------------------------------------------------------

@st.composite
def neighbour_cases(draw, tiny):
    V, d = draw(st.integers(1, 12 if tiny else 40)), draw(st.integers(1, 4 if tiny else 8))
    dtype = draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**31))
    if draw(st.booleans()):
        codebook = integer_codebook(V, d, seed).double()
    else:
        codebook = random_codebook(V, d, seed, torch.float64)
    if rarely(draw, 3):
        codebook = poke(draw, codebook, edges(draw, dtype, [1e20, -1e20, 0.0]))
    if rarely(draw, 6) and V > 1:
        codebook[draw(st.integers(0, V - 1))] = 0.0  # a zero row (normalisation's eps)
    K = pick(draw, [1, max(V - 1, 1), min(3, max(V - 1, 1)), np.int64(1)], [0, V, -1, True, 1.0], 0.15)
    normalize = pick(draw, [False, True, True], [1])
    layout = draw(st.sampled_from(LAYOUTS))
    grads = ("arg0",) if rarely(draw, 6) else ()
    note(f"latent_neighbours V={V} d={d} K={K!r} normalize={normalize!r} {dtype} {layout}")
    return case_from("latent_neighbours", (expandable(codebook, layout).to(dtype), K, normalize), {},
                     {"arg0": layout}, grads)


test_fuzz_latent_neighbours, test_fuzz_latent_neighbours_interpreted = fuzz_tests(neighbour_cases)


# ---- philox_uniform, ancestor_mask, build_tree -----------------------------------------------------------

@st.composite
def philox_cases(draw, tiny):
    seed = pick(draw, [0, 42, 2**64 - 1, np.uint64(5), torch.tensor(9), torch.tensor([2**63 - 1]), torch.tensor(-3)],
                [2**64, -1, torch.tensor(1.5), torch.tensor([1, 2]), True], 0.1)
    counters = []
    for _ in range(4):
        kind = pick(draw, ["int", "int", "tensor", "tensor"], ["float", "bad"], 0.05)
        if kind == "int":
            counters.append(pick(draw, [0, 1, 2**32 - 1, np.uint32(7), np.int64(3)], [2**32, -1, True], 0.1))
        elif kind == "tensor":
            shape = draw(st.sampled_from([(), (3,), (2, 1), (1, 3), (0,)]))
            dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.int16]))
            values = torch.tensor(draw(st.lists(st.integers(0, 2**32 - 1), min_size=6, max_size=6)))
            t = values[:int(np.prod(shape))].reshape(shape)
            counters.append(t.to(dtype) if dtype != torch.int64 else t)
        elif kind == "float":
            counters.append(torch.tensor([1.0]))
        else:
            counters.append(torch.tensor([2**32, -1]))  # outside [0, 2^32)
    return case_from("philox_uniform", (seed, *counters), {})


test_fuzz_philox_uniform, test_fuzz_philox_uniform_interpreted = fuzz_tests(philox_cases)


@st.composite
def tree_op_cases(draw, tiny):
    seed = draw(st.integers(0, 2**31))
    rng = random.Random(seed)
    B, T = draw(st.integers(0, 3)), draw(st.integers(0, 40))
    if draw(st.booleans()):
        parents = random_parents(rng, B, max(T, 1), draw(st.sampled_from([0.0, 0.3])))
        if rarely(draw, 6) and B:
            parents = poke(draw, parents, [-2, T, 0, 5])
        return case_from("ancestor_mask", (parents,), {}, {"arg0": draw(st.sampled_from(LAYOUTS))})
    M = draw(st.integers(0, 6))
    tokens, cand_parents, scores, root = random_expansion(rng, max(B, 1), M)
    tokens, cand_parents, scores, root = tokens[:B], cand_parents[:B], scores[:B], root[:B]
    if rarely(draw, 4):
        scores = poke(draw, scores, [-math.inf, 5.0, -0.0, pick(draw, [0.0], [math.nan, math.inf])])
    n_nodes = pick(draw, [0, M, min(2, M), np.int64(min(1, M))], [M + 1, -1, 1.0])
    return case_from("build_tree", (tokens, cand_parents, scores.to(draw(st.sampled_from(FLOATS))), root, n_nodes), {})


test_fuzz_tree_ops, test_fuzz_tree_ops_interpreted = fuzz_tests(tree_op_cases)


# ---- continuous_verify ---------------------------------------------------------------------------------

CONTINUOUS_BLOCK = ("draft", "mu_p", "sigma_p", "mu_q", "sigma_q")
CONTINUOUS_EDGES = {  # finite edges stay below 1e30: a proposal mu_p + sigma_p xi (|xi| < 6.7) then stays finite
    "mean": [-0.0, 1e-40, 1e-30, 1e30, -1e30, 1e4, -1e4],
    "std": [1e-40, 1e-30, 1e-6, 1e6, 1e30, 1.0],
    "sums": [-0.0, 80.0, -80.0, 1e30, -1e30],
}
CONTINUOUS_INVALID = {"mean": [math.nan, math.inf, -math.inf], "std": [0.0, -0.0, -1.0, math.nan, math.inf],
                      "sums": [math.nan, math.inf, -math.inf]}
CONTINUOUS_RULES = [("exact", 1.0, "paper"), ("exact", 1, "paper"), ("paper", 1.0, "paper"), ("paper", 42.0, "code"),
                    ("paper", 0.5, "paper"), ("paper", 1e-30, "code"), ("paper", 1e30, "paper"),
                    ("paper", np.float64(3.0), "code"), ("paper", np.float32(2.0), "paper"), ("paper", 7, "code")]
CONTINUOUS_BAD_RULES = [("lossy", 1.0, "paper"), ("exact", 2.0, "paper"), ("exact", 1.0, "code"),
                        ("paper", 0.0, "paper"), ("paper", -1.0, "code"), ("paper", math.nan, "paper"),
                        ("paper", math.inf, "paper"), ("paper", True, "paper"), ("paper", "1", "paper"),
                        ("paper", 1.0, "sideways")]


def _continuous_values(draw, t: torch.Tensor, kind: str) -> torch.Tensor:
    """t with a few edge values of its kind (a mean, a std or a log-std sum), invalid ones rarely."""
    if not rarely(draw, 3):
        return t
    return poke(draw, t, CONTINUOUS_EDGES[kind] + [pick(draw, [1.0], CONTINUOUS_INVALID[kind], 0.15)])


def _continuous_key(draw, shape):
    """rows [B] / positions [B, N]: None (the defaults), an integer tensor of keys in [0, 2^32), or rarely
    one the checks refuse (out of range, a float or bool tensor, another shape)."""
    if draw(st.booleans()):
        return None
    dtype = pick(draw, [torch.int64, torch.int64, torch.int32], [torch.uint8, torch.int16], 0.05)
    high = {torch.int64: 2**32, torch.int32: 2**31, torch.uint8: 2**8, torch.int16: 2**15}[dtype]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    keys = torch.randint(0, high, shape, generator=g, dtype=torch.int64)
    if keys.numel() and rarely(draw, 4):
        keys.view(-1)[0] = draw(st.sampled_from([0, high - 1]))
    fault = pick(draw, [None], ["range", "float", "bool", "shape"], 0.1)
    if fault == "range" and keys.numel():
        keys.view(-1)[0] = draw(st.sampled_from([-1, 2**32]))
        dtype = torch.int64
    elif fault == "float":
        return keys.to(torch.float32)
    elif fault == "bool":
        return keys > 0
    elif fault == "shape":
        return keys.reshape(-1)[:1] if keys.dim() == 2 else keys[:, None]
    return keys.to(dtype)


@st.composite
def continuous_cases(draw, tiny):
    B, N = draw(st.integers(0, 2 if tiny else 4)), draw(st.integers(0, 3 if tiny else 6))
    C = pick(draw, list(range(1, 4 if tiny else 9)), [0], 0.02)
    block = continuous_block(draw(st.integers(0, 2**31)), B, N, max(C, 1), gap=draw(st.sampled_from([0.1, 0.5, 3.0])),
                             spread=draw(st.sampled_from([0.0, 0.5, 2.0])))
    if C == 0:
        block = {k: v[..., :0] if v.dim() == 3 else v for k, v in block.items()}
    if rarely(draw, 5):  # the drafter far from the target: drafts rejected, the residual sampler at work
        block["mu_q"] = block["mu_p"] + draw(st.sampled_from([5.0, 50.0])) * block["sigma_p"]
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        block["draft"] = block["mu_q"] + block["sigma_q"] * torch.randn(block["draft"].shape, generator=g)
    if rarely(draw, 6):  # equal heads: every draft accepted
        block["mu_q"], block["sigma_q"] = block["mu_p"].clone(), block["sigma_p"].clone()
    for name, kind in (("draft", "mean"), ("mu_p", "mean"), ("mu_q", "mean"), ("sigma_p", "std"),
                       ("sigma_q", "std"), ("logsig_p", "sums"), ("logsig_q", "sums")):
        block[name] = _continuous_values(draw, block[name], kind)
    fault = pick(draw, [None], ["dtype", "shape", "rank"], 0.06)
    if fault:
        name = draw(st.sampled_from(list(block)))
        t = block[name]
        block[name] = (t.to(draw(st.sampled_from([torch.float64, torch.float16, torch.bfloat16, torch.int64])))
                       if fault == "dtype" else t[:, :1] if fault == "shape" and t.dim() >= 2 else t[..., None])
    rule, bandwidth, sigma_ratio = pick(draw, CONTINUOUS_RULES, CONTINUOUS_BAD_RULES, 0.08)
    kwargs = dict(rule=rule, bandwidth=bandwidth, sigma_ratio=sigma_ratio,
                  max_tries=pick(draw, [1, 2, 3] if tiny else [1, 2, 3, 10, 50, np.int64(4)],
                                 [0, -1, 2**31 - 1, 1.5, True, np.bool_(True)], 0.05),
                  seed=pick(draw, [0, 7, 2**64 - 1, np.uint64(2**63 + 5), torch.tensor(9), torch.tensor([2**63 - 1]),
                                   torch.tensor(-3)], [2**64, -1, torch.tensor(1.5), torch.tensor([1, 2]), True], 0.05),
                  offset=pick(draw, [0, 1, 2**32 - 1, 2**32 - 2, np.int64(9), torch.tensor(3)],
                              [2**32, -1, 1.0], 0.05),
                  rows=_continuous_key(draw, (B,)), positions=_continuous_key(draw, (B, N)))
    layouts = {name: draw(st.sampled_from(LAYOUTS)) if rarely(draw, 3) else "contiguous" for name in block}
    block = {name: expandable(t, layouts[name]) for name, t in block.items()}
    grads = tuple(name for name in block if rarely(draw, 12))
    note(f"continuous_verify B={B} N={N} C={C} fault={fault} layouts={layouts} grads={grads} "
         f"{ {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)} }")
    return case_from("continuous_verify", (), dict(block, **kwargs), layouts, grads)


def continuous_agree(want, got, backend, case) -> None:
    """Decisions and tries equal; an accepted token is the draft bit for bit; a proposal within float32
    rounding of log1p / cos / sqrt (docs/cspd.md): |got - want| <= 1e-5 (1 + |mu_p| + 7 sigma_p), the
    Box-Muller normal being below 6.7 in magnitude."""
    (tokens_a, accepted_a, tries_a), (tokens_b, accepted_b, tries_b) = want, got
    assert (tokens_b.dtype, accepted_b.dtype, tries_b.dtype) == (torch.float32, torch.bool, torch.int32)
    assert tokens_a.shape == tokens_b.shape and accepted_a.shape == accepted_b.shape == tries_b.shape
    assert torch.equal(accepted_a, accepted_b), f"{backend}: decisions differ\n{accepted_a}\n{accepted_b}"
    assert torch.equal(tries_a, tries_b), f"{backend}: tries differ\n{tries_a}\n{tries_b}"
    kwargs = case.make(torch.device("cpu"))[1]
    draft, mu_p, sigma_p = (kwargs[name].detach() for name in ("draft", "mu_p", "sigma_p"))
    assert torch.equal(bits(tokens_b[accepted_b]), bits(draft[accepted_b])), f"{backend}: an accepted token moved"
    scale = 1 + mu_p.double().abs() + 7 * sigma_p.double()
    error = (tokens_a.double() - tokens_b.double()).abs()
    ok = (tokens_a == tokens_b) | (error <= 1e-5 * scale)
    assert bool(ok.all()), f"{backend}: a proposal differs by {(error / scale).nan_to_num(0.0).max()} of its scale"


COMPARE["continuous_verify"] = continuous_agree
test_fuzz_continuous_verify, test_fuzz_continuous_verify_interpreted = fuzz_tests(continuous_cases)


# ---- the cost-model cache's reader (lantern.decoding.costs) ---------------------------------------------
# Not a backend op: the property is that whatever a cache entry holds, cached_cost_model neither raises nor
# hangs, and either uses the entry (then the planner can cost every plan from it, at any row count) or
# measures again: with a "corrupt" warning for an entry the schema refuses, silently for a stale one.

CACHE_FACTOR = 4  # examples: 4x the profile's (ci: 400, long: 8 000), about 15 ms each
CACHE_KEY = {"device": "fuzz", "mode": {"plans": ["ar", "chain2", "sjd4"]}}
CACHE_PLANS = {p.name: p for p in candidate_plans(4) + candidate_plans(4, draft="deterministic") + jacobi_plans(4)}
CACHE_FAMILIES = list(FAMILIES) + ["sjd2", "sjd4", "sjd17"]
MEASURED = {"ar": {2: 0.01, 16: 0.02}, "chain2": {2: 0.015, 16: 0.05}}
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3),
                           max_leaves=8)
BAD_SECONDS = [math.inf, -math.inf, math.nan, 0, 0.0, -1e-3, 1e-300, 5e-324, 1e300, 2e4, 5e-8, "0.01", None, True,
               [0.01], {"s": 0.01}, 10**400]
BAD_ROWS = ["0", "-1", "01", " 2", "2 ", "2.0", "1e3", "\u0662", "+2", str(2**31), "", "x", "0x10"]
BAD_RATES = [1.0, -0.1, math.nan, math.inf, "0.5", None, True, 1.5, [0.5]]


PLAN_NAMES = st.lists(st.sampled_from(sorted(CACHE_PLANS)) | st.text(max_size=6), max_size=4)
ROW_LISTS = st.lists(st.sampled_from([1, 2, 16, 80, costs.MAX_ROWS]) | st.integers(1, costs.MAX_ROWS), min_size=1,
                     max_size=4, unique=True)
STEP_SECONDS = st.floats(costs.MIN_STEP_S, costs.MAX_STEP_S) | st.integers(1, int(costs.MAX_STEP_S))
RATE_TABLES = st.dictionaries(st.sampled_from(CACHE_FAMILIES), st.lists(st.floats(0.0, 1.0, exclude_max=True),
                                                                         max_size=6), max_size=3)


@st.composite
def valid_cost_entries(draw) -> dict:
    """A fresh, well-formed cache file for CACHE_KEY, as the JSON value to_json writes."""
    names = ["ar"] + draw(PLAN_NAMES)
    points = {name: {str(r): draw(STEP_SECONDS) for r in draw(ROW_LISTS)} for name in names}
    acceptance = draw(RATE_TABLES)
    meta = {"key": json.loads(json.dumps(CACHE_KEY)), "stamp": costs.staleness_stamp(),  # copies: mutated later
            "created": time.time() - draw(st.floats(60.0, (costs.MAX_AGE_DAYS - 1) * 86400.0)),
            "calibration_s": draw(st.floats(0.0, 1e4) | st.just(0))}
    return {"format": costs.FORMAT, "meta": meta, "acceptance": acceptance, "points": points}


def _containers(value, path=()):
    """(path, container) of every list and dict inside ``value``, itself included."""
    if isinstance(value, (dict, list)):
        yield path, value
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from _containers(v, path + (k,))


def _break_schema(draw, entry: dict) -> str:
    """One change the schema refuses, made in place; its label."""
    plan = draw(st.sampled_from(sorted(entry["points"])))
    row = draw(st.sampled_from(sorted(entry["points"][plan])))
    which = draw(st.sampled_from(["seconds", "rows", "missing", "extra", "container", "rate", "family", "meta",
                                  "key", "no ar", "no points", "deep"]))
    if which == "seconds":
        entry["points"][plan][row] = draw(st.sampled_from(BAD_SECONDS))
    elif which == "rows":
        entry["points"][plan][draw(st.sampled_from(BAD_ROWS))] = entry["points"][plan].pop(row)
    elif which == "missing":
        where = draw(st.sampled_from([entry, entry["meta"]]))
        del where[draw(st.sampled_from(sorted(where)))]
    elif which == "extra":
        draw(st.sampled_from([entry, entry["meta"]]))["extra"] = draw(JSON_VALUES)
    elif which == "container":  # a table of the wrong type
        path = draw(st.sampled_from([("points",), ("meta",), ("acceptance",), ("points", plan)]
                                    + [("acceptance", f) for f in entry["acceptance"]]))
        *parent, last = path
        target = entry
        for k in parent:
            target = target[k]
        wanted = list if path[0] == "acceptance" and len(path) == 2 else dict
        target[last] = draw(JSON_VALUES.filter(lambda v: not isinstance(v, wanted)))
    elif which == "rate":
        family = draw(st.sampled_from(CACHE_FAMILIES))
        entry["acceptance"].setdefault(family, [0.5]).append(draw(st.sampled_from(BAD_RATES)))
    elif which == "family":
        entry["acceptance"][draw(st.sampled_from(["greedy", "sjd0", "sjd", "Top", ""]))] = [0.5]
    elif which == "meta":
        field = draw(st.sampled_from(["created", "calibration_s", "stamp"]))
        bad = {"created": ["yesterday", None, True, math.nan, math.inf, [], {}, 10**400],
               "calibration_s": [-1.0, math.nan, "1", None, False], "stamp": ["fresh", None, [], 2]}[field]
        entry["meta"][field] = draw(st.sampled_from(bad))
    elif which == "key":
        entry["meta"]["key"] = draw(st.sampled_from([{"device": "another"}, {}, "fuzz", None, [CACHE_KEY]]))
    elif which == "no ar":
        entry["points"].pop("ar")
    elif which == "no points":
        entry["points"][plan] = {}
    else:  # nested too deep for the parser, somewhere inside
        depth = draw(st.sampled_from([10_000, 100_000]))
        entry["meta"]["key"] = "DEEP"
        return f"deep {depth}"
    return which


def _make_stale(draw, entry: dict) -> str:
    which = draw(st.sampled_from(["stamp", "old", "future", "format"]))
    if which == "stamp":
        entry["meta"]["stamp"] = dict(entry["meta"]["stamp"], torch="0.0")
    elif which == "old":
        entry["meta"]["created"] = time.time() - (costs.MAX_AGE_DAYS + draw(st.floats(0.1, 1e6))) * 86400.0
    elif which == "future":
        entry["meta"]["created"] = time.time() + draw(st.floats(3600.0, 1e12))
    else:  # another lantern's format: stale whatever else the file holds
        entry["format"] = draw(st.sampled_from([1, 3, 0, -2, 10**30]))
    return which


def _wild(draw, entry: dict) -> None:
    """Any container's entry replaced by any JSON value (or a new entry added)."""
    path, container = draw(st.sampled_from(list(_containers(entry))))
    if isinstance(container, dict):
        value = draw(JSON_VALUES)  # the value is drawn before the key
        key = draw(st.sampled_from(sorted(container)) | st.text(max_size=5)) if container else "x"
        container[key] = value
    elif container:
        container[draw(st.integers(0, len(container) - 1))] = draw(JSON_VALUES)


@st.composite
def cost_cache_entries(draw):
    """(kind of file, its bytes, the outcome expected: "load", "stale", "corrupt" or "any")."""
    entry = draw(valid_cost_entries())
    category = draw(st.sampled_from(["load", "corrupt", "stale", "corrupt", "wild", "bytes", "corrupt", "wild"]))
    expect, label = category, category
    if category == "stale":
        label = _make_stale(draw, entry)
    elif category == "corrupt":
        label = _break_schema(draw, entry)
    elif category == "wild":
        for _ in range(draw(st.integers(1, 3))):
            _wild(draw, entry)
        expect = "any"
    text = json.dumps(entry, indent=draw(st.sampled_from([None, 1])), sort_keys=draw(st.booleans()))
    if label.startswith("deep"):
        depth = int(label.split()[1])
        text = text.replace('"DEEP"', "[" * depth + "]" * depth)
    data = text.encode()
    if category == "bytes":
        expect = "any"
        how = draw(st.sampled_from(["truncate", "flip", "insert", "random"]))
        at = draw(st.integers(0, 2**20))  # a place in the text (whose length depends on the clock: "created")
        if how == "truncate":
            data, expect = data[:at % len(data)], "corrupt"
        elif how == "flip":
            i = at % len(data)
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
        elif how == "insert":
            i = at % (len(data) + 1)
            data = data[:i] + draw(st.binary(min_size=1, max_size=8)) + data[i:]
        else:
            data = draw(st.binary(max_size=64))
    kind = pick(draw, ["file"], ["oversized", "folder", "fifo", "symlink", "dangling", "endless"], 0.1)
    if kind != "file":
        expect = "corrupt"
    note(f"cost cache entry: {category} ({label}), {kind}, {len(data)} bytes, expect {expect}: {data[:300]!r}")
    event(f"cost cache: {category}, {kind}")
    return kind, data, expect


def _place(path: Path, kind: str, data: bytes) -> None:
    if kind == "file":
        path.write_bytes(data)
    elif kind == "oversized":
        path.write_bytes(data + b" " * (costs.MAX_FILE_BYTES + 1 - len(data)))
    elif kind == "folder":
        path.mkdir()
        (path / "inside").write_bytes(data)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (path.parent / "target.json").write_bytes(data)
        path.symlink_to(path.parent / "target.json")
    elif kind == "dangling":
        path.symlink_to(path.parent / "nowhere.json")
    else:
        path.symlink_to("/dev/zero")


def assert_plannable(model) -> None:
    """Every plan's seconds at any row count are finite and positive (at least MIN_STEP_S, but for the
    rounding of an interpolation), and a planner over the candidate plans the model knows chooses with a
    positive, finite rate."""
    assert model.knows("ar")
    for name, points in model.points.items():
        measured = sorted(points)
        for rows in {1, 2, 2**20, measured[-1] * 2} | {r + d for r in measured for d in (-1, 0, 1) if r + d >= 1}:
            seconds = model.step_seconds(name, rows)
            assert math.isfinite(seconds) and seconds >= costs.MIN_STEP_S / 2, (name, rows, seconds)
    plans = [plan for name, plan in CACHE_PLANS.items() if model.knows(name)]
    planner = Planner(model, plans, AcceptanceModel(prior_rates=model.acceptance), adapt_costs=True)
    for rows in (1, 2, 16, 2**20):
        decision = planner.choose(rows, rows, [rows] * planner.max_depth)
        assert 0 < decision.tokens_per_s < math.inf and 0 < decision.ar_tokens_per_s < math.inf
        planner.record(decision, rows, decision.predicted_s)


@settings(max_examples=settings.default.max_examples * CACHE_FACTOR)
@given(entry=cost_cache_entries())
def test_fuzz_cost_cache_reader(entry):
    kind, data, expect = entry
    with tempfile.TemporaryDirectory() as folder:
        path = costs.cache_path(CACHE_KEY, Path(folder))
        _place(path, kind, data)
        calls = []

        def measure():
            calls.append(1)
            return MEASURED

        with warnings.catch_warnings(record=True) as caught, unblocking_fifo(path) as unblocked:
            warnings.simplefilter("always")
            model = costs.cached_cost_model(CACHE_KEY, measure, directory=Path(folder))
        assert not unblocked, "the reader blocked on a FIFO"
        messages = [str(w.message) for w in caught]
        corrupt = [m for m in messages if "corrupt" in m]
        assert all("corrupt" in m or "could not be written" in m for m in messages), messages
        if model.meta["source"] == "cache":
            assert expect in ("load", "any") and not calls and not messages, (expect, messages)
            assert_plannable(model)
            if expect == "load":
                parsed = json.loads(data)
                points = {n: {int(r): float(s) for r, s in p.items()} for n, p in parsed["points"].items()}
                assert model.points == points
                assert model.acceptance == parsed["acceptance"]
        else:
            assert model.meta["source"] == "measured" and calls == [1]
            assert expect != "load", f"a well-formed fresh entry was measured again: {messages}"
            if expect == "corrupt":
                assert len(corrupt) == 1, messages
            elif expect == "stale":
                assert not corrupt, messages
            assert any("could not be written" in m for m in messages) == (kind == "folder"), messages
            if kind != "folder":  # the measurement replaced the entry: read back
                assert costs.cached_cost_model(CACHE_KEY, measure, directory=Path(folder)).meta["source"] == "cache"


@contextlib.contextmanager
def unblocking_fifo(path: Path, after_s: float = 10.0):
    """Plays the writer of a FIFO at ``path`` after ``after_s``, so that a reader that blocked on it fails
    the test instead of hanging it; yields a list that holds True once it had to."""
    unblocked = []

    def play_the_writer():
        with contextlib.suppress(OSError):  # not a FIFO, or nobody is reading it
            if stat.S_ISFIFO(os.lstat(path).st_mode):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                unblocked.append(True)

    timer = threading.Timer(after_s, play_the_writer)
    timer.start()
    try:
        yield unblocked
    finally:
        timer.cancel()
