"""One small call of each CUDA kernel of lantern._C, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python -m tools.sanitize_cuda_ops
    python -m tools.sanitize_cuda_ops --rehearse   (the same calls on the CPU backend: no GPU, no sanitizer)

Each call goes through the public op (``lantern.ops``, argument checks included) with the ``cuda`` backend on
CUDA tensors, the first-use self-check off (LANTERN_SELF_CHECK=0) so that nothing reroutes it. Every
csrc/cuda/<op>.cu needs a case here: a file without one, or an op lantern._C has no CUDA kernel for, fails
the run. Prints "sanitize_cuda_ops: OK" at the end; exits 2 without a CUDA device.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, List, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools.cuda_resources import cuda_sources  # noqa: E402

Call = Callable[[], object]


def _compact_kv(dev: torch.device) -> List[Call]:
    import lantern.ops as ops

    cache = torch.randn(2, 2, 3, 2, 10, 4, device=dev)  # [layers, K/V, B, Hkv, Lmax, Dh]
    cache_len = torch.tensor([2, 0, 5], device=dev)
    path_nodes = torch.tensor([[0, 1, 3], [0, 2, -1], [0, -1, -1]], device=dev)  # [B, P]
    n_keep = torch.tensor([3, 2, 1], device=dev)
    half = torch.randn(1, 2, 2, 9, 6, device=dev, dtype=torch.bfloat16)  # 12-byte rows: narrow copy units
    half_args = (torch.tensor([1, 4], device=dev), torch.tensor([[2, 0], [1, -1]], device=dev),
                 torch.tensor([2, 1], device=dev))
    return [lambda: ops.compact_kv(cache, cache_len, path_nodes, n_keep),
            lambda: ops.compact_kv(half, *half_args)]


def _philox_uniform(dev: torch.device) -> List[Call]:
    import lantern.ops as ops

    args = (torch.tensor(42, device=dev), torch.arange(6, device=dev).view(2, 3), torch.tensor(1, device=dev),
            torch.tensor([[7], [8]], device=dev), torch.tensor(0, device=dev))
    return [lambda: ops.philox_uniform(*args)]


def _verify(dev: torch.device) -> List[Call]:
    import lantern.ops as ops
    from bench.bench_verify import inputs

    logits, uncond, tokens, parents, neighbours = (t.to(dev) for t in inputs(2, T=23, V=1024, K=16))
    return [lambda: ops.verify(logits, tokens, parents, neighbours, uncond_logits=uncond, cfg_scale=3.0,
                               top_k=200, k=16, delta=0.1, seed=1),
            lambda: ops.verify(logits, tokens, parents, seed=2, offset=3)]  # exact verification


def _latent_neighbours(dev: torch.device) -> List[Call]:
    import lantern.ops as ops

    codebook = torch.randn(300, 8, generator=torch.Generator().manual_seed(0)).to(dev)  # [V, d]
    return [lambda: ops.latent_neighbours(codebook, 17), lambda: ops.latent_neighbours(codebook, 5, normalize=True)]


def _tree_attention(dev: torch.device) -> List[Call]:
    import lantern.ops as ops
    from bench.bench_tree_attention import inputs

    q, k, v, cache_len, tree_mask = inputs(40, B=2, H=4, T=19, Dh=64)
    cache_len, tree_mask = cache_len.to(dev), tree_mask.to(dev)
    return [lambda dtype=dtype: ops.tree_attention(*(t.to(dev, dtype) for t in (q, k, v)), cache_len, tree_mask)
            for dtype in (torch.float32, torch.bfloat16)]


def _continuous_verify(dev: torch.device) -> List[Call]:
    import lantern.ops as ops
    from lantern.ops import self_check

    calls = []
    for kwargs, _ in self_check.continuous_cases(dev):  # exact, paper, a 2-try cap
        calls.append(lambda kwargs=kwargs: ops.continuous_verify(**kwargs))
    g = torch.Generator().manual_seed(0)
    block = [torch.randn(5, 33, 16, generator=g).to(dev) for _ in range(5)]  # [B, N, C]: a grid-stride tail
    block[2], block[4] = block[2].abs() + 0.1, block[4].abs() + 0.1  # stds
    sums = [torch.randn(5, 33, generator=g).to(dev) for _ in range(2)]
    calls.append(lambda: ops.continuous_verify(*block, *sums, rule="paper", bandwidth=42.0, seed=3))
    return calls


# op -> its calls on ``dev`` (inputs made here, outside the backend block; each call goes through lantern.ops)
CASES: Dict[str, Callable[[torch.device], List[Call]]] = {
    "compact_kv": _compact_kv,
    "philox_uniform": _philox_uniform,
    "verify": _verify,
    "latent_neighbours": _latent_neighbours,
    "tree_attention": _tree_attention,
    "continuous_verify": _continuous_verify,
}


def cuda_ops() -> List[str]:
    """The op of each csrc/cuda/<op>.cu."""
    return [os.path.splitext(os.path.basename(p))[0] for p in cuda_sources()]


def missing_cases(ops: List[str]) -> List[str]:
    return [op for op in ops if op not in CASES]


def missing_kernels(ops: List[str], dispatch_key: str) -> List[str]:
    """The ops lantern._C has registered no ``dispatch_key`` kernel for (``lantern.ops.extension`` registers
    them when it is imported; lantern._C only records its kernels when it loads)."""
    from lantern.ops import extension

    found = extension.implementations(dispatch_key)
    return [op for op in ops if op not in found]


def rehearse() -> int:
    """The same calls on CPU tensors with the cpu backend (no GPU, no sanitizer): the driver's own code runs,
    for `make gpu-check --rehearse`."""
    import lantern

    ops = cuda_ops()
    if missing_cases(ops):
        print(f"sanitize_cuda_ops: no case for csrc/cuda/{missing_cases(ops)}: add one to CASES", file=sys.stderr)
        return 1
    no_kernel = missing_kernels(ops, "CPU")
    if no_kernel:
        print(f"sanitize_cuda_ops: lantern._C has no CPU kernel for {no_kernel}", file=sys.stderr)
        return 1
    for op in ops:
        calls = CASES[op](torch.device("cpu"))
        with lantern.fused("cpu"):
            for call in calls:
                call()
        print(f"sanitize_cuda_ops: {op} ran", flush=True)
    print(f"sanitize_cuda_ops: OK ({len(ops)} ops)")
    return 0


def main(argv: Sequence[str] = ()) -> int:
    if list(argv) == ["--rehearse"]:
        return rehearse()
    if not torch.cuda.is_available():
        print("sanitize_cuda_ops: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    ops = cuda_ops()
    missing = missing_cases(ops)
    if missing:
        print(f"sanitize_cuda_ops: no case for csrc/cuda/{missing}: add one to CASES", file=sys.stderr)
        return 1
    import lantern

    no_kernel = missing_kernels(ops, "CUDA")
    if no_kernel:
        print(f"sanitize_cuda_ops: lantern._C has no CUDA kernel for {no_kernel} (rebuild with CUDA)",
              file=sys.stderr)
        return 1
    # every call must reach the CUDA kernel: no first-use self-check, which would route a kernel it finds wrong
    # to the reference (pytest -m gpu checks the results)
    os.environ["LANTERN_SELF_CHECK"] = "0"
    dev = torch.device("cuda")
    for op in ops:
        calls = CASES[op](dev)
        with lantern.fused("cuda"):
            for call in calls:
                call()
        torch.cuda.synchronize()
        print(f"sanitize_cuda_ops: {op} ran", flush=True)
    print(f"sanitize_cuda_ops: OK ({len(ops)} ops)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
