"""The CUDA kernel of verify (csrc/cuda/verify.cu, csrc/include/lantern/cuda/verify.cuh) against the CPU kernel,
which it ports: same compute type (float64 for float64 logits), same scalar rules (lantern/verify.h), same
top-k / top-p selections. Rows must agree exactly on >= 99.9 % of random cases (they differ only where a sum
rounds differently: the GPU sums in a block-wide tree, the CPU in index order; or where CUDA's exp / log1pf
round differently from glibc's). Also: the kernel's own paths (V not a multiple of the block, V = 1, T = 1,
k larger than the block, every logit masked, mixed input dtypes), invalid rows marked -1 when the op is
called directly, no host synchronisation, and CUDA-graph replay with a new offset. Needs a GPU and lantern._C
built with CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lantern
from backends import cuda_kernel_marks
from lantern import ops
from lantern.ops.reference.verify import VerifyResult
from op_cases import AGREEMENT, agreement, random_case, random_neighbours, to_device

pytestmark = cuda_kernel_marks("verify")


def cpu_and_cuda(args, kwargs):
    """(cpu backend, cuda backend) results of one lantern.ops.verify call, both moved to the CPU."""
    with lantern.fused("cpu"):
        want = ops.verify(*to_device(args, "cpu"), **to_device(kwargs, "cpu"))
    with lantern.fused("cuda"):
        got = ops.verify(*to_device(args, "cuda"), **to_device(kwargs, "cuda"))
    return want, VerifyResult(*(t.cpu() for t in got))


def assert_agree(cases, exact=False):
    agree, rows, bad = agreement(cpu_and_cuda, cases)
    print(f"verify cuda vs cpu: {agree}/{rows} rows agree, cases with a mismatch: {bad}")
    assert (agree == rows) if exact else (agree / rows >= AGREEMENT), (agree, rows, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_agrees_with_the_cpu_kernel_on_random_cases(dtype):
    assert_agree({seed: random_case(seed, dtype=dtype) for seed in range(2000, 2120)})


@pytest.mark.parametrize("V", [1, 2, 511, 513, 1537, 20000])
@pytest.mark.parametrize("T", [1, 2, 17])
def test_vocabulary_sizes_around_the_block(V, T):
    """V below, just around and far above the 512-thread block, and T = 1 (no children: the bonus race)."""
    assert_agree({seed: random_case(seed, V=V, T=T, B=8) for seed in range(3000, 3006)})


def test_neighbour_merge_longer_than_the_block():
    """k = 700 > 512 neighbours: the merge loads them in two chunks and must stop exactly where the CPU does."""
    args, kwargs = random_case(4000, V=2048, T=9, B=8)
    rng = np.random.default_rng(4000)
    nbrs = random_neighbours(rng, 2048, 800)
    kwargs = {**kwargs, "k": 700, "lam": None, "delta": 0.9, "budget": "candidate"}
    assert_agree({0: ((*args[:3], nbrs), kwargs)})


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("sampled", [False, True])
def test_every_logit_masked_gives_token_zero(top_k, sampled):
    """A node whose logits are all -inf has no mass: the walk rejects and the race gives token 0, as on the CPU
    (with top-k the CPU's support is every token with weight NaN; without it, empty)."""
    B, T, V = 3, 4, 700
    logits = torch.full((B, T, V), float("-inf"))
    logits[1] = torch.randn(T, V)  # one ordinary row beside them
    parents = torch.tensor([[-1, 0, 0, 1]] * B)
    tokens = torch.tensor([[0, 3, 5, 7]] * B)
    draft = torch.softmax(torch.randn(B, T, V), -1) if sampled else None
    kwargs = dict(top_k=top_k, draft_probs=draft, seed=5, offset=9)
    want, got = cpu_and_cuda((logits, tokens, parents, None), kwargs)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert got.next_token[0] == 0 and got.next_token[2] == 0


def test_mixed_input_dtypes():
    """uncond_logits in another dtype than logits, drafter rows in float32 beside float16 logits."""
    args, kwargs = random_case(5000, V=300, T=9, B=16, dtype=torch.float16)
    logits = args[0]
    uncond = torch.randn(logits.shape, dtype=torch.float32)
    draft = torch.softmax(torch.randn(logits.shape), -1)
    cases = {0: (args, {**kwargs, "uncond_logits": uncond}), 1: (args, {**kwargs, "draft_probs": draft})}
    assert_agree(cases)


def direct_args(B=3, T=5, V=64, K=4, seed=6):
    g = torch.Generator().manual_seed(seed)
    d = "cuda"
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * B)[:, :T]
    tokens = torch.randint(0, V, (B, T), generator=g)
    return dict(
        logits=torch.randn(B, T, V, generator=g).to(d), tokens=tokens.to(d), parents=parents.to(d),
        neighbours=torch.randint(0, V, (V, K), generator=g, dtype=torch.int32).to(d), uncond_logits=None,
        cfg_scale=torch.ones(B, device=d), temperature=torch.ones(B, device=d),
        top_k=torch.zeros(B, dtype=torch.int64, device=d), top_p=torch.ones(B, dtype=torch.float64, device=d),
        draft_probs=None, k=2, delta=0.1, lam=None, node_budget=False,
        seed=torch.tensor(11, device=d), offset=torch.tensor(3, device=d))


@pytest.mark.parametrize("fault", ["root", "parent", "token", "neighbour"])
def test_invalid_row_is_marked_and_others_are_unchanged(fault):
    """Called directly (no host checks), an invalid row gets accept_len = next_token = -1, path = node_status
    = -1; the kernel reads nothing out of bounds and the other rows equal the CPU op's on the same batch with
    the fault undone (rows are independent; a row's random stream depends on its index)."""
    good = direct_args()
    V = good["logits"].shape[-1]
    if fault == "neighbour":  # row 1's candidates are all token V - 1, the others' token 0
        good["tokens"][1, 1:] = V - 1
        good["tokens"][[0, 2], 1:] = 0
    bad = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in good.items()}
    if fault == "root":
        bad["parents"][1, 0] = 0
    elif fault == "parent":
        bad["parents"][1, 3] = 4
    elif fault == "token":
        bad["tokens"][1, 2] = V
    else:
        bad["neighbours"][V - 1] = V + 5
    got = [t.cpu() for t in torch.ops.lantern.verify(**bad)]
    assert got[0][1] == -1 and got[2][1] == -1
    assert (got[1][1] == -1).all() and (got[3][1] == -1).all()
    want = torch.ops.lantern.verify(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in good.items()})
    ok = [0, 2]
    for w, g in zip(want, got):
        assert torch.equal(w[ok], g[ok])


def test_no_host_synchronisation():
    a = direct_args()
    torch.ops.lantern.verify(**a)  # warm-up (allocator, module load)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ops.lantern.verify(**a)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("sampled", [False, True])
def test_cuda_graph_replays_with_a_new_offset(sampled):
    a = direct_args(B=4, T=5, V=1000, seed=7)
    if sampled:
        a["draft_probs"] = torch.softmax(torch.randn_like(a["logits"]), -1)
    offset = torch.tensor(0, device="cuda")
    a["offset"] = offset
    torch.ops.lantern.verify(**a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.lantern.verify(**a)
    for step in (1, 2, 77):
        offset.fill_(step)
        graph.replay()
        eager = torch.ops.lantern.verify(**{**a, "offset": torch.tensor(step, device="cuda")})
        for g, e in zip(out, eager):
            assert torch.equal(g, e)
