"""The first-use self-check of fused kernels (lantern.ops.self_check, lantern._backend.resolve;
docs/self_check.md), tested on CPU by injecting faulty kernels into the registry: the warning names the op,
backend, device and mismatch; "auto" falls back; an explicit backend gets the reference; the check runs once
per (backend, op, device); LANTERN_SELF_CHECK=0 turns it off. The healthy cpu (and triton, under the
interpreter) kernels pass every op's check, and the cases have margins that rounding cannot cross."""
from __future__ import annotations

import functools
import math
import threading
import warnings

import pytest
import torch

import backends
import lantern
from lantern import _backend, ops
from lantern.ops import (
    compact_kv_op,
    continuous_verify_op,
    draft_sample_op,
    latent_neighbours_op,
    philox_uniform_op,
    self_check,
    tree_attention_op,
    verify_op,
)
from lantern.ops.reference.continuous_verify import FAULTS as CONTINUOUS_FAULTS
from lantern.ops.reference.continuous_verify import continuous_verify as reference_continuous_verify
from lantern.ops.reference.latent_neighbours import latent_neighbours as reference_neighbours
from lantern.ops.reference.process_logits import guide
from lantern.ops.reference.verify import FAULTS
from lantern.ops.reference.verify import verify as reference_verify

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_self_checks(monkeypatch):
    """Each test starts with no cached verdict and the check switched on; the cache and the registry
    (monkeypatch.setitem) are restored afterwards, so other tests see what they saw before."""
    _backend._load_backends()
    monkeypatch.delenv("LANTERN_SELF_CHECK", raising=False)
    saved = dict(_backend._self_checks)
    _backend._self_checks.clear()
    yield
    _backend._self_checks.clear()
    _backend._self_checks.update(saved)


def counting(fn, counts):
    def wrapper(*args, **kwargs):
        counts.append(1)
        return fn(*args, **kwargs)
    return wrapper


def verify_next_token_plus_one(*args, **kwargs):
    result = backends.kernel("cpu", "verify")(*args, **kwargs)
    return result._replace(next_token=result.next_token + 1)


def verify_raises(*args, **kwargs):
    raise RuntimeError("kernel exploded at row 3")


def verify_call():
    """(args, kwargs) of a public verify call (the self-check's deterministic-drafts case)."""
    kwargs, _ = self_check.verify_cases(CPU)[0]
    args = [kwargs.pop(n) for n in ("logits", "tokens", "parents", "neighbours")]
    return args, kwargs


def assert_same_result(got, want):
    for field in want._fields:
        assert torch.equal(getattr(got, field), getattr(want, field)), field


# ---- a faulty kernel is caught, warned about, and replaced ----------------------------------------------

def test_auto_falls_back_to_the_reference_with_a_warning(monkeypatch):
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", verify_next_token_plus_one)
    args, kwargs = verify_call()
    with lantern.fused("auto"), pytest.warns(RuntimeWarning) as record:
        got = ops.verify(*args, **kwargs)
    message = str(record[0].message)
    for part in ("backend 'cpu'", "on verify (cpu)", "next_token[", "reference", "LANTERN_SELF_CHECK=0"):
        assert part in message, (part, message)
    assert len(record) == 1
    assert_same_result(got, reference_verify(*args, **kwargs))
    report = _backend.self_check_report()[("cpu", "verify", "cpu")]
    assert report.startswith("verify (deterministic drafts): next_token")


def test_an_explicit_backend_runs_the_reference_for_that_op_only(monkeypatch):
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", verify_next_token_plus_one)
    args, kwargs = verify_call()
    with lantern.fused("cpu"):
        with pytest.warns(RuntimeWarning, match=r"backend 'cpu' runs the reference verify"):
            got = ops.verify(*args, **kwargs)
        assert _backend.resolve("verify", CPU) is _backend._REGISTRY["reference"]["verify"]
        # other ops unaffected
        assert _backend.resolve("latent_neighbours", CPU) is backends.kernel("cpu", "latent_neighbours")
    assert_same_result(got, reference_verify(*args, **kwargs))


def test_a_kernel_that_raises_is_a_mismatch_naming_the_error(monkeypatch):
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", verify_raises)
    args, kwargs = verify_call()
    with lantern.fused("auto"), pytest.warns(RuntimeWarning, match="raised RuntimeError: kernel exploded at row 3"):
        got = ops.verify(*args, **kwargs)
    assert_same_result(got, reference_verify(*args, **kwargs))


def test_swapped_neighbour_columns_are_caught(monkeypatch):
    def swapped(codebook, K, normalize=False):
        table = backends.kernel("cpu", "latent_neighbours")(codebook, K, normalize)
        return table[:, [1, 0, *range(2, K)]]

    monkeypatch.setitem(_backend._REGISTRY["cpu"], "latent_neighbours", swapped)
    codebook = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    warned = pytest.warns(RuntimeWarning, match=r"latent_neighbours \(normalize=False\): table\[0, 0\]")
    with lantern.fused("auto"), warned:
        got = ops.latent_neighbours(codebook, 6, True)
    assert torch.equal(got, reference_neighbours(codebook, 6, True))


def test_auto_moves_on_to_the_next_candidate(monkeypatch):
    """cuda -> triton -> reference, exercised on CPU: the candidate list is ("cpu", "triton"), the "triton"
    kernel a counting copy of the healthy cpu one."""
    triton_calls = []
    monkeypatch.setattr(_backend, "_auto_candidates", lambda device: ("cpu", "triton"))
    monkeypatch.setitem(_backend._AVAILABILITY, "triton", lambda: None)
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", verify_next_token_plus_one)
    second = counting(backends.kernel("cpu", "verify"), triton_calls)
    monkeypatch.setitem(_backend._REGISTRY["triton"], "verify", second)
    with lantern.fused("auto"):
        with pytest.warns(RuntimeWarning, match="backend 'cpu'"):
            assert _backend.resolve("verify", CPU) is second
        assert len(triton_calls) == 2  # its own self-check: two cases
        _backend._self_checks.clear()
        monkeypatch.setitem(_backend._REGISTRY["triton"], "verify", verify_raises)
        with pytest.warns(RuntimeWarning) as record:
            assert _backend.resolve("verify", CPU) is _backend._REGISTRY["reference"]["verify"]
        assert sorted(str(w.message).split("'")[1] for w in record) == ["cpu", "triton"]


FAULTY = {
    "verify": [functools.partial(reference_verify, faults=(f,)) for f in FAULTS] + [verify_next_token_plus_one],
    "latent_neighbours": [
        lambda c, K, n=False: backends.kernel("cpu", "latent_neighbours")(c, K, n)[:, [0, 2, 1, *range(3, K)]]],
    "tree_attention": [
        lambda *a: backends.kernel("cpu", "tree_attention")(*a).index_add(2, torch.tensor([4]),
                                                                          torch.full((2, 4, 1, 16), 1e-3))],
    "compact_kv": [
        lambda cache, cl, pn, nk: backends.kernel("cpu", "compact_kv")(cache, cl, pn, nk - torch.tensor([0, 1]))
        + torch.tensor([0, 1])],
    "philox_uniform": [lambda *a: torch.nextafter(backends.kernel("cpu", "philox_uniform")(*a), torch.tensor(2.0))],
    "continuous_verify": [functools.partial(reference_continuous_verify, faults=(f,)) for f in CONTINUOUS_FAULTS]
    # off-by-one try key
    + [lambda *a, **k: backends.kernel("cpu", "continuous_verify")(*a, **{**k, "offset": k["offset"] + 1}),
       lambda *a, **k: backends.kernel("cpu", "continuous_verify")(*a, **k)._replace(  # 1e-4 on one token
           tokens=backends.kernel("cpu", "continuous_verify")(*a, **k).tokens.index_add(1, torch.tensor([2]),
                                                                                      torch.full((3, 1, 3), 1e-4)))],
    "draft_sample": [  # an off-by-one offset; the draws of a greedy row from its softmax; 1e-4 on one q
        lambda *a, **k: backends.kernel("cpu", "draft_sample")(*a, **{**k, "offset": k["offset"] + 1}),
        lambda *a, **k: backends.kernel("cpu", "draft_sample")(*a, **{**k, "temperature": torch.where(
            torch.as_tensor(k.get("temperature", 1.0)) == 0, 1.0, torch.as_tensor(k.get("temperature", 1.0)))}),
        lambda *a, **k: backends.kernel("cpu", "draft_sample")(*a, **k)._replace(
            probs=backends.kernel("cpu", "draft_sample")(*a, **k).probs.index_add(2, torch.tensor([0]),
                                                                                torch.full((3, 2, 1), 1e-4)))],
}


@pytest.mark.parametrize("op_name, faulty", [(op, f) for op, fs in FAULTY.items() for f in fs])
def test_every_case_catches_a_subtle_fault(monkeypatch, op_name, faulty):
    """Negative controls: the reference verify's deliberate bugs (wrong residual, reused uniform, off-by-one
    neighbour count), one swapped neighbour pair, 1e-3 on one attention output row, one K/V move skipped,
    one ulp on the uniforms; the drafts' off-by-one offset, greedy rows drawn from the softmax, 1e-4 on one q."""
    monkeypatch.setitem(_backend._REGISTRY["cpu"], op_name, faulty)
    mismatch = self_check.check("cpu", op_name, CPU)
    assert mismatch is not None and mismatch.startswith(op_name), mismatch


# ---- once per (backend, op, device); the switch; compile; threads; RNG; no recursion ---------------------

def test_the_check_runs_once_per_backend_op_and_device(monkeypatch):
    calls = []
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", counting(backends.kernel("cpu", "verify"), calls))
    args, kwargs = verify_call()
    with lantern.fused("cpu"), warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.verify(*args, **kwargs)
        assert len(calls) == 2 + 1  # the check's two cases, then the call
        ops.verify(*args, **kwargs)
        assert len(calls) == 4
    with lantern.fused("auto"):
        ops.verify(*args, **kwargs)  # the same (backend, op, device) through "auto": no new check
    assert len(calls) == 5
    assert _backend.self_check_report() == {("cpu", "verify", "cpu"): None}

    faulty_calls = []
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", counting(verify_next_token_plus_one, faulty_calls))
    _backend._self_checks.clear()
    with lantern.fused("cpu"):
        with pytest.warns(RuntimeWarning):
            ops.verify(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning, no second check
            ops.verify(*args, **kwargs)
    assert len(faulty_calls) == 1  # the check stops at the first case's mismatch; the kernel never runs again


def test_LANTERN_SELF_CHECK_0_keeps_the_faulty_kernel(monkeypatch):
    monkeypatch.setenv("LANTERN_SELF_CHECK", "0")
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", verify_next_token_plus_one)
    args, kwargs = verify_call()
    with lantern.fused("auto"), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ops.verify(*args, **kwargs)
    assert torch.equal(got.next_token, reference_verify(*args, **kwargs).next_token + 1)
    assert _backend.self_check_report() == {}


def test_no_check_while_compiling_but_a_cached_verdict_applies(monkeypatch):
    """Under torch.compile tracing the checker cannot run (it needs real tensors): an unchecked kernel is
    used as is; a verdict from an earlier eager check is respected."""
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", verify_next_token_plus_one)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with lantern.fused("cpu"):
        assert _backend.resolve("verify", CPU) is verify_next_token_plus_one
        assert _backend.self_check_report() == {}
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        with pytest.warns(RuntimeWarning):
            _backend.run_self_checks(CPU, backends=("cpu",))
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert _backend.resolve("verify", CPU) is _backend._REGISTRY["reference"]["verify"]


@pytest.mark.parametrize("faulty", [False, True])
def test_concurrent_first_uses_run_one_check(monkeypatch, faulty):
    """Six threads resolve the same op at once: one check runs, and every thread gets its verdict."""
    calls = []
    kernel = counting(verify_next_token_plus_one if faulty else backends.kernel("cpu", "verify"), calls)
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "verify", kernel)
    start = threading.Barrier(6)
    resolved = []

    def first_use():
        with lantern.fused("cpu"):  # the active backend is per thread
            start.wait()
            resolved.append(_backend.resolve("verify", CPU))

    threads = [threading.Thread(target=first_use) for _ in range(6)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    expected = _backend._REGISTRY["reference"]["verify"] if faulty else kernel
    assert len(calls) == (1 if faulty else 2)  # the faulty kernel fails the first case
    assert len(resolved) == 6 and all(r is expected for r in resolved)
    assert len(record) == (1 if faulty else 0)


def test_the_check_leaves_the_global_rng_alone_and_never_calls_resolve(monkeypatch):
    def no_resolve(*args, **kwargs):
        raise AssertionError("the self-check went through the dispatcher")

    monkeypatch.setattr(_backend, "resolve", no_resolve)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    for op_name in self_check.CASES:
        assert self_check.check("cpu", op_name, CPU) is None
    assert torch.equal(torch.get_rng_state(), state)


def test_the_reference_backend_is_never_checked(monkeypatch):
    calls = []
    for op_name, fn in list(_backend._REGISTRY["reference"].items()):
        monkeypatch.setitem(_backend._REGISTRY["reference"], op_name, counting(fn, calls))
    with lantern.fused("reference"):
        for op_name in _backend._REGISTRY["reference"]:
            assert _backend.resolve(op_name, CPU) is _backend._REGISTRY["reference"][op_name]
    assert calls == [] and _backend.self_check_report() == {}
    with lantern.fused("cpu"):  # an op the cpu backend does not fuse runs the reference, unchecked
        for op_name in _backend._REGISTRY["reference"]:
            _backend.resolve(op_name, CPU)
    assert set(_backend.self_check_report()) == {("cpu", op, "cpu") for op in _backend._REGISTRY["cpu"]}


def test_a_fused_op_without_a_case_runs_unchecked(monkeypatch):
    """(test_every_fused_op_has_a_case keeps this from happening in the repository.)"""
    monkeypatch.setitem(_backend._REGISTRY["cpu"], "ancestor_mask", verify_raises)
    with lantern.fused("cpu"):
        assert _backend.resolve("ancestor_mask", CPU) is verify_raises
    assert _backend.self_check_report() == {}


def test_a_bug_in_the_checker_propagates_and_is_not_cached(monkeypatch):
    def broken_reference(*args, **kwargs):
        raise ZeroDivisionError("checker bug")

    monkeypatch.setitem(_backend._REGISTRY["reference"], "compact_kv", broken_reference)
    with lantern.fused("cpu"), pytest.raises(ZeroDivisionError, match="checker bug"):
        _backend.resolve("compact_kv", CPU)
    assert _backend.self_check_report() == {}


# ---- the healthy kernels pass; the cases are valid and have margins --------------------------------------

def test_every_fused_op_has_a_case():
    for backend in ("cpu", "cuda", "triton"):
        missing = set(_backend._REGISTRY[backend]) - set(self_check.CASES)
        assert not missing, f"{backend} registers {sorted(missing)} without a self-check case"


@pytest.mark.parametrize("op_name", sorted(self_check.CASES))
def test_the_reference_and_the_cpu_kernels_pass(op_name):
    assert self_check.check("reference", op_name, CPU) is None
    if op_name in _backend._REGISTRY["cpu"]:
        assert self_check.check("cpu", op_name, CPU) is None


@pytest.mark.parametrize("op_name",
                         ["verify", "latent_neighbours", "tree_attention", "compact_kv", "continuous_verify"])
def test_the_triton_kernels_pass(op_name):
    """Under the interpreter without a GPU (about 0.2 to 1.2 s per op on 2 cores), on CUDA with one."""
    if _backend._why_unavailable("triton") is not None or op_name not in _backend._REGISTRY["triton"]:
        pytest.skip("the triton backend is unavailable here")
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    assert self_check.check("triton", op_name, device) is None


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", sorted(self_check.CASES))
def test_the_cuda_kernels_pass(op_name):
    if _backend._why_unavailable("cuda") is not None:
        pytest.skip("the cuda backend is unavailable here")
    assert self_check.check("cuda", op_name, torch.device("cuda")) is None


def test_run_self_checks_reports_every_cpu_op():
    report = _backend.run_self_checks("cpu", backends=("cpu",))
    assert report == {("cpu", op, "cpu"): None for op in _backend._REGISTRY["cpu"]}


def test_the_cases_are_valid_public_inputs():
    for kwargs, _ in self_check.verify_cases(CPU):
        verify_op.check(
            kwargs["logits"], kwargs["tokens"], kwargs["parents"], kwargs["neighbours"], kwargs.get("uncond_logits"),
            kwargs.get("cfg_scale", 1.0), kwargs["temperature"], kwargs.get("top_k", 0), kwargs.get("top_p", 1.0),
            kwargs.get("draft_probs"), kwargs["k"], kwargs.get("delta", 0.0), kwargs.get("lam"),
            kwargs.get("budget", "candidate"), kwargs["seed"], kwargs["offset"])
    latent_neighbours_op.check(self_check.neighbour_codebook(CPU), self_check.NEIGHBOUR_K, True)
    tree_attention_op.check(*self_check.attention_case(CPU))
    compact_kv_op.check(*self_check.compact_case(CPU))
    for args in self_check.philox_cases(CPU):
        philox_uniform_op.check(*args)
    for kwargs, _ in self_check.draft_cases(CPU):
        draft_sample_op.check(kwargs["logits"], kwargs.get("uncond_logits"), kwargs.get("cfg_scale", 1.0),
                              kwargs.get("temperature", 1.0), kwargs.get("top_k", 0), kwargs.get("top_p", 1.0),
                              kwargs["draws"], kwargs["seed"], kwargs["node_ids"], kwargs["offset"], kwargs.get("rows"))
    for kwargs, _ in self_check.continuous_cases(CPU):
        continuous_verify_op.check(*(kwargs[n] for n in ("draft", "mu_p", "sigma_p", "mu_q", "sigma_q", "logsig_p",
                                                             "logsig_q", "rule")),
                                       kwargs.get("bandwidth", 1.0), kwargs.get("sigma_ratio", "paper"),
                                       kwargs.get("max_tries", 1000), kwargs["seed"], kwargs["offset"], kwargs["rows"],
                                       kwargs["positions"])


def test_continuous_cases_cover_every_branch_and_rounding_cannot_flip_them():
    """Across the cases drafts are accepted and rejected, proposals kept at try 1 and later, and the cap hit;
    the reference's decisions do not move when it computes in float64."""
    seen = set()
    for kwargs, label in self_check.continuous_cases(CPU):
        want = reference_continuous_verify(**kwargs)
        wide = {n: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for n, v in kwargs.items()}
        got = reference_continuous_verify(**wide)
        assert torch.equal(got.accepted, want.accepted) and torch.equal(got.tries, want.tries), label
        cap = kwargs.get("max_tries", 1000)
        seen |= {"accepted" * bool(want.accepted.any()), "rejected" * bool((~want.accepted).any()),
                 "first try" * bool((want.tries == 1).any()),
                 "later try" * bool(((want.tries > 1) & (want.tries <= cap)).any()),
                 "capped" * bool((want.tries > cap).any())}
    assert {"accepted", "rejected", "first try", "later try", "capped"} <= seen


def test_verify_cases_cover_the_walk_and_rounding_cannot_flip_them():
    """Both cases accept and reject (at depth >= 2); guidance is exact; and the reference's results do not
    move when the logits are computed in float64 or nudged by 1e-5 (backends differ by ~1e-7 relative)."""
    noise = torch.Generator().manual_seed(0)
    for kwargs, label in self_check.verify_cases(CPU):
        args = [kwargs.pop(n) for n in ("logits", "tokens", "parents", "neighbours")]
        want = reference_verify(*args, **kwargs)
        assert int(want.accept_len.max()) >= 2 and bool((want.node_status == 0).any()), label
        assert bool((want.node_status == 1).any()), label
        if "uncond_logits" in kwargs:
            guided = guide(args[0], kwargs["uncond_logits"], kwargs["cfg_scale"])  # [B, T, V]
            assert bool((guided * 2 == (guided * 2).round()).all()), "guidance is not exact"
            assert bool((guided.sort(-1).values.diff(dim=-1) > 0).all()), "tied guided logits"
        variants = [dict(logits=args[0].double(), uncond=kwargs.get("uncond_logits"))]
        for _ in range(4):
            variants.append(dict(logits=args[0] + 1e-5 * torch.randn(args[0].shape, generator=noise),
                                 uncond=kwargs.get("uncond_logits")))
        for variant in variants:
            moved = dict(kwargs)
            if variant["uncond"] is not None:
                moved["uncond_logits"] = variant["uncond"].to(variant["logits"].dtype)
            got = reference_verify(variant["logits"], *args[1:], **moved)
            assert_same_result(got, want)


def test_neighbour_codebook_is_tie_free():
    from neighbour_check import exact_table

    codebook = self_check.neighbour_codebook(CPU)
    for normalize in (False, True):
        assert self_check.min_relative_gap(codebook, normalize) > self_check.MIN_RELATIVE_GAP
        table = reference_neighbours(codebook, self_check.NEIGHBOUR_K, normalize)
        exact = torch.as_tensor(exact_table(codebook, self_check.NEIGHBOUR_K, normalize))
        assert torch.equal(table.to(torch.int64), exact)


def test_draft_cases_keys_are_apart_beyond_rounding():
    """In every draft_sample case, the keys E / q deciding each node's draws (the first draws + 1, finite) differ
    by more than 1e-4 relative, so no float32 rounding of q or E can reorder them."""
    from lantern.ops.reference.draft_sample import draft_sample
    from lantern.ops.reference.philox import exponential_key, philox_uniform

    for kwargs, label in self_check.draft_cases(CPU):
        q = draft_sample(**kwargs).probs.double()
        B, N, V = q.shape
        rows = kwargs.get("rows", torch.arange(B))
        u = philox_uniform(kwargs["seed"], torch.arange(V)[None, None, :], kwargs["node_ids"][..., None],
                           rows[:, None, None], kwargs["offset"])
        keys = torch.where(q > 0, exponential_key(u).double() / q, math.inf).sort(-1).values
        keys = keys[..., : kwargs["draws"] + 1]
        ratio = keys[..., 1:] / keys[..., :-1]
        close = torch.isfinite(keys[..., 1:]) & (ratio < 1 + 1e-4)
        assert not bool(close.any()), label
