"""lantern._C's latent_neighbours and tree_attention ops (csrc/cpu, csrc/cuda) called directly, on the
backends that use them (cpu, cuda): the kernels' own argument checks, opcheck and torch.compile. Agreement
with the reference is tests/ops/test_latent_neighbours.py and tests/ops/test_tree_attention.py."""
from __future__ import annotations

import pytest
import torch

import backends
from op_cases import attention_case

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")

EXTENSION = backends.params(["cpu", "cuda"])


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check("bad input: the kernel's own checks reject it before any work")
def test_neighbours_kernel_rejects_bad_k(backend, device):
    with pytest.raises(ValueError, match="K must be"):
        torch.ops.lantern.latent_neighbours(torch.randn(5, 2, device=device), 5, False)


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check("bad input: the kernel's own checks reject it before any work")
def test_attention_kernel_rejects_cache_len_past_the_cache(backend, device):
    q, k, v, cache_len, mask = attention_case(1, 2, 2, 4, 8, [10], 14, dtype=torch.float32, seed=6, device=device)
    with pytest.raises(ValueError, match="cache_len"):
        torch.ops.lantern.tree_attention(q, k, v, torch.tensor([11], device=device), mask)
    with pytest.raises(ValueError, match="multiple"):
        torch.ops.lantern.tree_attention(q[:, :1].expand(1, 3, 4, 8).contiguous(), k, v, cache_len, mask)


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.no_kernel_check(
    "calls torch.ops.lantern.* itself (opcheck, a compiled graph): no fallback to hide a kernel")
def test_opcheck_and_compile(backend, device):
    q, k, v, cache_len, mask = attention_case(2, 4, 2, 9, 16, [20, 3], 40, dtype=torch.float32, seed=7, device=device)
    k = torch.nan_to_num(k)
    v = torch.nan_to_num(v)
    torch.library.opcheck(torch.ops.lantern.tree_attention.default, (q, k, v, cache_len, mask))
    codebook = torch.randn(40, 4, device=device)
    torch.library.opcheck(torch.ops.lantern.latent_neighbours.default, (codebook, 5, True))

    def step(q, k, v, cache_len, mask, codebook):
        o = torch.ops.lantern.tree_attention(q * 1.0, k, v, cache_len, mask)
        return o.sum(-1), torch.ops.lantern.latent_neighbours(codebook, 5, True) + 0

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, v, cache_len, mask, codebook)
    want = step(q, k, v, cache_len, mask, codebook)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], want[1])
