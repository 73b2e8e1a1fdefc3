"""philox_uniform on the backends that implement it (reference; cpu and cuda: csrc/include/lantern/philox.h
via csrc/cpu, csrc/cuda) against SPEC §5's known answers and the reference, bit for bit; the extension op's
own checks and CUDA-graph replay. (Triton's Philox lives inside its verify kernel:
tests/ops/test_verify.py.)"""
import pytest
import torch

import backends
from lantern import ops
from lantern.ops.reference import philox as ref
from op_cases import PHILOX_KNOWN_ANSWERS

PHILOX = backends.params(["reference", "cpu", "cuda"])


def philox(backend):
    """The backend's implementation (for cpu and cuda, the extension's wrapper, called directly)."""
    if backend == "reference":
        return ref.philox_uniform
    return backends.kernel("cpu", "philox_uniform")

KNOWN = PHILOX_KNOWN_ANSWERS  # SPEC §5: seed, (c0, c1, c2, c3) -> word 0, u, E


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).view(torch.int32)


@pytest.mark.parametrize("backend", PHILOX, indirect=True)
@pytest.mark.parametrize("seed,counters,word,u,E", KNOWN)
def test_known_answers(backend, device, seed, counters, word, u, E):
    cs = [torch.tensor([c], dtype=torch.int64, device=device) for c in counters]
    got = philox(backend)(seed, *cs)
    assert got.dtype == torch.float32 and got.device == device
    assert torch.equal(_bits(got.cpu()), _bits(torch.tensor([u])))  # bit-exact float32
    assert torch.equal(_bits(ref.uint_to_uniform(torch.tensor([word]))), _bits(got.cpu()))
    E_got = -torch.log1p(-got.cpu())  # E as the spec computes it, from this u
    assert torch.equal(_bits(E_got), _bits(torch.tensor([E])))


@pytest.mark.parametrize("backend", PHILOX, indirect=True)
def test_matches_reference_on_random_counters(backend, device):
    gen = torch.Generator().manual_seed(0)
    for seed in [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 987654321987654321]:
        cs = [torch.randint(0, 2**32, (1000,), generator=gen, dtype=torch.int64) for _ in range(4)]
        want = ref.philox_uniform(seed, *cs)
        got = philox(backend)(seed, *(c.to(device) for c in cs)).cpu()
        assert torch.equal(_bits(got), _bits(want)), seed


@pytest.mark.parametrize("backend", PHILOX, indirect=True)
def test_broadcasting_dtypes_and_seed_tensors(backend, device):
    c0 = torch.arange(16383 - 7, 16383 + 1, device=device, dtype=torch.int32)  # [8] token ids
    c1 = torch.arange(5, device=device)[:, None]  # [5, 1] nodes
    c2, c3 = 3, torch.tensor(2**32 - 1, device=device)  # row (int), offset (0-d device tensor)
    want = ref.philox_uniform(2**63 + 5, c0.cpu(), c1.cpu(), c2, c3.cpu())
    assert want.shape == (5, 8)
    seeds = [2**63 + 5, torch.tensor(2**63 + 5 - 2**64, device=device), torch.tensor([2**63 + 5 - 2**64])]
    for seed in seeds:
        got = philox(backend)(seed, c0, c1, c2, c3)
        assert got.shape == (5, 8) and torch.equal(_bits(got.cpu()), _bits(want))
    assert philox(backend)(1, 2, 3, 4, 5).shape == ()  # all ints: a 0-d tensor
    empty = philox(backend)(1, torch.zeros(0, dtype=torch.int64, device=device), 0, 0, 0)
    assert empty.shape == (0,)


@pytest.mark.parametrize("backend", backends.params(["cpu", "cuda"]), indirect=True)
@pytest.mark.parametrize("bad,match", [
    (dict(c1=torch.zeros(3)), "c1"),  # float counter
    (dict(seed=torch.tensor([1, 2])), "seed"),  # two elements
    (dict(seed=torch.tensor(1.0)), "seed"),
    (dict(c2=torch.zeros(2, dtype=torch.int64)), "size|shape|broadcast"),  # [3] vs [2]
])
@pytest.mark.no_kernel_check("bad input: the kernel's own checks reject it before any work")
def test_extension_op_rejects_bad_input(backend, device, bad, match):
    args = dict(seed=torch.tensor(1), c0=torch.zeros(3, dtype=torch.int64), c1=torch.tensor(0), c2=torch.tensor(0),
                c3=torch.tensor(0))
    args.update(bad)
    args = {key: value.to(device) for key, value in args.items()}
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        torch.ops.lantern.philox_uniform(**args)


@pytest.mark.parametrize("backend", backends.params(["cuda"]), indirect=True)
def test_cuda_graph_replay_with_new_seed_and_offset(backend):
    seed, offset = torch.tensor(1, device="cuda"), torch.tensor(0, device="cuda")
    c0 = torch.arange(64, device="cuda")
    philox(backend)(seed, c0, 1, 2, offset)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # counters as device tensors: nothing is copied from the host
        out = torch.ops.lantern.philox_uniform(seed, c0, torch.ones_like(c0), torch.full_like(c0, 2), offset)
    for s, o in [(5, 0), (7, 11), (2**62, 2**32 - 1)]:
        seed.fill_(s)
        offset.fill_(o)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bits(out.cpu()), _bits(ref.philox_uniform(s, c0.cpu(), 1, 2, o)))


# ---- bad input (SPEC §9) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,exc,fragment", [
    ((-1, 0, 0, 0, 0), ValueError, "seed"),
    ((0, 2**32, 0, 0, 0), ValueError, "c0"),
    ((0, 0, torch.tensor([-1]), 0, 0), ValueError, "c1"),
    ((0, 0, 0, torch.tensor([0.5]), 0), TypeError, "c2"),
    ((0, 0, 0, 0, "1"), ValueError, "c3"),
])
def test_rejects_bad_input(args, exc, fragment):
    with pytest.raises(exc, match=fragment):
        ops.philox_uniform(*args)


ALL_BACKENDS = backends.params(backends.NAMES)  # reference, cpu, cuda, triton (skipped, with the reason, if unusable)


@pytest.mark.parametrize("backend", backends.params(["reference", "cpu", "cuda"]))  # triton has no philox op
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_counters_that_do_not_broadcast_raise(backend):
    """Counters of shapes [3] and [0] are refused by the checks with a ValueError naming the counters (not a
    RuntimeError from inside torch.broadcast_tensors); shapes that broadcast run."""
    import lantern
    from lantern import ops

    with lantern.fused(backend):
        with pytest.raises(ValueError, match="c0, c1, c2, c3 must broadcast together"):
            ops.philox_uniform(1, torch.tensor([1, 2, 3]), torch.zeros(0, dtype=torch.int64), 0, 0)
        broadcast = ops.philox_uniform(1, torch.tensor([1, 2, 3]), torch.zeros(2, 1, dtype=torch.int64), 0, 0)
        assert broadcast.shape == (2, 3)


def test_reference_puts_int_counters_on_the_tensor_counters_device():
    # an int counter becomes a tensor on the device of the tensor counters: on a GPU a CPU word would meet CUDA
    # words inside the rounds ("found at least two devices"); the meta device fails the same way without a GPU
    c0 = torch.arange(5, device="meta")
    for args in ((c0, 0, 2, 3), (7, c0, 2, 3), (7, 0, 2, c0[:, None])):
        assert ref.philox_word0(11, *args).device.type == "meta"
        assert ref.philox_uniform(11, *args).device.type == "meta"
    assert torch.equal(ref.philox_uniform(11, torch.arange(5), 0, 2, 3),
                       ref.philox_uniform(11, torch.arange(5), torch.tensor(0), 2, 3))
