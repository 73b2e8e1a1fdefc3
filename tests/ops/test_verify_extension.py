"""lantern._C's verify op (torch.ops.lantern.verify: csrc/cpu/verify.cpp, csrc/cuda) called directly, on
the backends that use it (cpu, cuda): the kernel's own argument checks, opcheck, torch.compile, and the CPU
kernel's vocabulary split over threads. Agreement with the reference is tests/ops/test_verify.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import backends
import lantern
from lantern import ops
from op_cases import random_case, random_neighbours, to_device

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")

EXTENSION = backends.params(["cpu", "cuda"])


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check("checks the routing only (resolve), runs no op")
def test_routed_to_the_extension(backend, device):
    assert lantern._backend.resolve("verify", device) is backends.kernel("cpu", "verify")
    with lantern.fused("auto"):
        assert lantern._backend.resolve("verify", device) is backends.kernel("cpu", "verify")


def with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", backends.params(["cpu"]), indirect=True)
@pytest.mark.parametrize("seed", range(2000, 2012))
def test_single_row_splits_the_vocabulary_without_changing_results(backend, seed):
    """B = 1 with V = 16384 >= 2 chunks: with more threads than rows the kernel splits each node's vocabulary
    passes over the threads (csrc/cpu/verify.cpp). The result must equal the one-thread run bit for bit and
    agree with the reference (pinned: exactly)."""
    args, kwargs = random_case(seed, V=16384, T=9, B=1)
    one = with_threads(1, lambda: backends.kernel("cpu", "verify")(*args, **kwargs))
    split = with_threads(4, lambda: backends.kernel("cpu", "verify")(*args, **kwargs))
    for a, b in zip(one, split):
        assert torch.equal(a, b)
    with lantern.fused("reference"):
        want = ops.verify(*args, **kwargs)
    for a, b in zip(want, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_bad_input_raises_like_reference(backend, device):
    """Bad inputs raise the same errors under the backend as under the reference (the checks run before any
    backend); the kernel's own checks guard direct calls of torch.ops.lantern.verify."""
    args, kwargs = to_device(random_case(5, V=16, T=5, B=2), device)
    logits, tokens, parents, nbrs = args
    bad_tokens = tokens.clone()
    bad_tokens[0, 0] = 16
    for name in ("reference", backend):
        with lantern.fused(name), pytest.raises(ValueError, match="tokens"):
            ops.verify(logits, bad_tokens, parents, nbrs, **kwargs)
    B, T, V = logits.shape
    on = lambda t: t.to(device)  # noqa: E731
    direct = lambda **over: torch.ops.lantern.verify(**{**dict(
        logits=logits, tokens=on(torch.zeros(B, T, dtype=torch.int64)), parents=on(torch.full((B, T), -1)),
        neighbours=None, uncond_logits=None, cfg_scale=on(torch.ones(B)), temperature=on(torch.ones(B)),
        top_k=on(torch.zeros(B, dtype=torch.int64)), top_p=on(torch.ones(B, dtype=torch.float64)), draft_probs=None,
        k=0, delta=0.0, lam=None, node_budget=False, seed=on(torch.tensor(0)), offset=on(torch.tensor(0))), **over})
    direct()  # a valid call: every node but the root is padding

    def rejects(match, bad_row, **over):
        """The kernel's value checks: a ValueError on cpu; on cuda (no host sync) the bad row is marked -1
        and the other row is untouched (docs/semantics.md)."""
        if device.type != "cuda":
            with pytest.raises(ValueError, match=match):
                direct(**over)
            return
        accept_len, path, next_token, status = (t.cpu() for t in direct(**over))
        assert accept_len[bad_row] == -1 and next_token[bad_row] == -1, match
        assert (path[bad_row] == -1).all() and (status[bad_row] == -1).all(), match
        assert accept_len[1 - bad_row] >= 0 and next_token[1 - bad_row] >= 0, match

    parents_bad = torch.full((B, T), -1)
    parents_bad[1, 2] = 2
    rejects("parents", 1, parents=on(parents_bad))
    tok_bad, par_ok = torch.zeros(B, T, dtype=torch.int64), torch.full((B, T), -1)
    par_ok[0, 1], tok_bad[0, 1] = 0, V
    rejects("tokens", 0, tokens=on(tok_bad), parents=on(par_ok))
    tok_ok = torch.zeros(B, T, dtype=torch.int64)
    nb_bad = torch.full((V, 2), V, dtype=torch.int32)
    rejects("neighbours", 0, tokens=on(tok_ok), parents=on(par_ok), neighbours=on(nb_bad), k=2)
    with pytest.raises(ValueError, match="k=3 exceeds"):
        direct(neighbours=on(nb_bad), k=3)
    with pytest.raises(TypeError, match="top_p"):
        direct(top_p=on(torch.ones(B)))


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check("the compiled graph calls torch.ops.lantern.verify itself: no fallback to hide a kernel")
def test_torch_compile_fullgraph(backend, device):
    """torch.compile traces a step that calls the fused verify (through its fake implementation)."""
    args, kwargs = to_device(random_case(12, V=64, T=9, B=4), device)
    logits, tokens, parents, nbrs = args
    kwargs = {k: v for k, v in kwargs.items() if k not in ("temperature", "top_k", "top_p", "cfg_scale")}
    kwargs["seed"], kwargs["offset"] = torch.tensor(3, device=device), torch.tensor(5, device=device)

    def step(logits, tokens, parents, nbrs):
        r = backends.kernel("cpu", "verify")(logits * 1.0, tokens, parents, nbrs, **kwargs)
        return r.accept_len + 0, r.next_token, r.path, r.node_status

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(logits, tokens, parents, nbrs)
    want = step(logits, tokens, parents, nbrs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check("calls torch.ops.lantern.verify itself (opcheck): no fallback to hide a kernel")
def test_opcheck(backend, device):
    args, kwargs = to_device(random_case(13, V=32, T=6, B=3), device)
    logits, tokens, parents, nbrs = args
    B = logits.shape[0]
    k = 2
    nb = random_neighbours(np.random.default_rng(0), 32, 4).to(device)
    on = lambda t: t.to(device)  # noqa: E731
    torch.library.opcheck(torch.ops.lantern.verify.default, (
        logits, tokens, parents, nb, None, on(torch.full((B,), 2.0)), on(torch.ones(B)),
        on(torch.zeros(B, dtype=torch.int64)), on(torch.ones(B, dtype=torch.float64)), None, k, 0.1, None, False,
        on(torch.tensor(1)), on(torch.tensor(2))))
