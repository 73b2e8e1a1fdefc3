"""SPEC §9: every argument of verify / process_logits / philox_uniform is checked, with a message that
names it. Run through the public ops on every backend (the ``backend`` fixture, tests/ops/conftest.py), so
every backend inherits the same errors."""
import math

import pytest
import torch

import backends
import lantern
from lantern import ops
from op_cases import to_device

B, T, V, K = 2, 4, 8, 3


def make_args(**over):
    g = torch.Generator().manual_seed(0)
    args = dict(
        logits=torch.randn(B, T, V, generator=g),
        tokens=torch.tensor([[1, 2, 3, 4], [0, 5, -1, 6]]),
        parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, 1]]),
        neighbours=torch.stack([(torch.arange(V) + i) % V for i in range(1, K + 1)], 1).to(torch.int32),
    )
    kwargs = dict(k=2, delta=0.1)
    for key, value in over.items():
        (args if key in args else kwargs)[key] = value
    return args, kwargs


def call_verify(backend, **over):
    """ops.verify under ``lantern.fused(backend)`` on that backend's device."""
    args, kwargs = to_device(make_args(**over), backends.device_for(backend))
    with lantern.fused(backend):
        return ops.verify(args.pop("logits"), args.pop("tokens"), args.pop("parents"), args.pop("neighbours"),
                          **kwargs)


BAD_VERIFY = [
    # (override, exception, message fragment)
    (dict(logits=torch.randn(B, T)), ValueError, "logits"),
    (dict(logits=torch.randint(0, 3, (B, T, V))), TypeError, "logits"),
    (dict(logits=torch.full((B, T, V), math.nan)), ValueError, "logits"),
    (dict(tokens=torch.tensor([[1, 2, 3, 4], [0, 5, -1, V]])), ValueError, "tokens"),
    (dict(tokens=torch.tensor([[1, 2, 3, -3], [0, 5, -1, 6]])), ValueError, "tokens"),
    (dict(tokens=torch.tensor([[1, 2, 3, 4], [0, 5, 2, 6]])), ValueError, "padding"),
    (dict(tokens=torch.zeros(B, T, dtype=torch.int32)), TypeError, "tokens"),
    (dict(tokens=torch.zeros(B, T + 1, dtype=torch.int64)), ValueError, "tokens"),
    (dict(parents=torch.tensor([[-1, 0, 0, 3], [-1, 0, -1, 1]])), ValueError, "parents"),  # self loop
    (dict(parents=torch.tensor([[-1, 0, 3, 1], [-1, 0, -1, 1]])), ValueError, "parents"),  # forward edge / cycle
    (dict(parents=torch.tensor([[0, 0, 0, 1], [-1, 0, -1, 1]])), ValueError, "parents"),  # root with parent
    (dict(parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, 2]])), ValueError, "parents"),  # child of padding
    (dict(parents=torch.tensor([[-1, 0, 0, -2], [-1, 0, -1, 1]])), ValueError, "parents"),
    (dict(k=K + 1), ValueError, "k=4 exceeds"),
    (dict(k=-1), ValueError, "k must"),
    (dict(k=1.5), TypeError, "k must"),
    (dict(neighbours=None), ValueError, "neighbours"),
    (dict(neighbours=torch.zeros(V, K, dtype=torch.int64)), TypeError, "neighbours"),
    (dict(neighbours=torch.zeros(V - 1, K, dtype=torch.int32)), ValueError, "neighbours"),
    (dict(neighbours=torch.full((V, K), V, dtype=torch.int32)), ValueError, "neighbours"),
    (dict(delta=-0.1), ValueError, "delta"),
    (dict(delta=math.nan), ValueError, "delta"),
    (dict(lam=0.5), ValueError, "lam"),
    (dict(lam=2.0, budget="node"), ValueError, "budget"),
    (dict(budget="row"), ValueError, "budget"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=torch.tensor([1.0, -0.5])), ValueError, "temperature"),
    (dict(temperature=torch.ones(B + 1)), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(cfg_scale=math.inf, uncond_logits=torch.zeros(B, T, V)), ValueError, "cfg_scale"),
    (dict(uncond_logits=torch.zeros(B, T, V - 1)), ValueError, "uncond_logits"),
    (dict(uncond_logits=torch.full((B, T, V), math.nan)), ValueError, "uncond_logits"),
    (dict(draft_probs=torch.rand(B, T, V - 1)), ValueError, "draft_probs"),
    (dict(draft_probs=-torch.rand(B, T, V)), ValueError, "draft_probs"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(offset=2**32), ValueError, "offset"),
    (dict(offset=torch.tensor([1, 2])), ValueError, "offset"),
]


@pytest.mark.parametrize("override,exc,fragment", BAD_VERIFY, ids=[f"{i}-{e[2]}" for i, e in enumerate(BAD_VERIFY)])
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_verify_rejects_bad_input(backend, override, exc, fragment):
    with pytest.raises(exc, match=fragment):
        call_verify(backend, **override)


def test_verify_accepts_the_good_arguments(backend):
    result = call_verify(backend)
    assert result.accept_len.shape == (B,) and result.path.shape == (B, T - 1)
    # tensors for seed / offset and per-row settings are accepted too
    call_verify(backend, seed=torch.tensor(3), offset=torch.tensor(7), temperature=torch.tensor([0.0, 1.0]),
                top_k=torch.tensor([0, 3]), top_p=torch.tensor([1.0, 0.5]))


def test_verify_rejects_device_mismatch(backend, device):
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    args, kwargs = to_device(make_args(), device)
    tokens = args["tokens"].to("cpu" if device.type == "cuda" else "cuda")
    with pytest.raises(ValueError, match="tokens"):
        ops.verify(args["logits"], tokens, args["parents"], args["neighbours"], **kwargs)


def verify_with_table(backend, table, k):
    args, kwargs = to_device(make_args(k=k), table.device)
    with lantern.fused(backend):
        return ops.verify(args["logits"], args["tokens"], args["parents"], table, **kwargs)


@pytest.mark.parametrize("edit", ["element", "view", "wider k"])
def test_verify_rechecks_a_neighbour_table_edited_after_validation(backend, device, edit):
    """check_verify remembers tables it has validated; an in-place edit (of the table or of a view of it), or
    a larger k than was validated, must be checked again."""
    table = make_args()[0]["neighbours"].clone().to(device)  # [V, K], valid
    verify_with_table(backend, table, k=1)
    verify_with_table(backend, table, k=1)  # served by the cache
    if edit == "element":
        table[V - 1, 0] = V
    elif edit == "view":
        table[:, :1].fill_(-1)
    else:
        table.data[:, 1] = V  # .data bypasses the version counter; the wider k must still be checked
    with pytest.raises(ValueError, match="neighbours has value"):
        verify_with_table(backend, table, k=2 if edit == "wider k" else 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_verify_finds_one_bad_logit_among_masked_ones(backend, device, dtype, bad):
    """One NaN or +inf among -inf (masked) and finite logits, in every float dtype, in either input."""
    args, kwargs = to_device(make_args(), device)
    for name in ("logits", "uncond_logits"):
        logits = args["logits"].to(dtype, copy=True)
        logits[0, 1, :3] = -math.inf
        uncond = logits.clone()
        (logits if name == "logits" else uncond)[1, T - 1, V - 1] = bad
        with lantern.fused(backend), pytest.raises(ValueError, match=f"^{name} contains NaN or \\+inf"):
            ops.verify(logits, args["tokens"], args["parents"], args["neighbours"], uncond_logits=uncond,
                       cfg_scale=2.0, **kwargs)


BAD_PROCESS = [
    (dict(logits=torch.tensor([1.0, math.nan])), ValueError, "logits"),
    (dict(logits=torch.tensor([1.0, math.inf])), ValueError, "logits"),
    (dict(logits=torch.zeros(3, 0)), ValueError, "logits"),
    (dict(logits=[1.0, 2.0]), TypeError, "logits"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(cfg_scale=math.nan, uncond_logits=torch.zeros(2)), ValueError, "cfg_scale"),
    (dict(uncond_logits=torch.zeros(3)), ValueError, "uncond_logits"),
]


@pytest.mark.parametrize("override,exc,fragment", BAD_PROCESS, ids=[f"{i}-{e[2]}" for i, e in enumerate(BAD_PROCESS)])
@pytest.mark.no_kernel_check("bad input (and process_logits has only the reference)")
def test_process_logits_rejects_bad_input(backend, device, override, exc, fragment):
    kwargs = dict(logits=torch.tensor([1.0, 2.0]))
    kwargs.update(override)
    kwargs = to_device(kwargs, device)
    with lantern.fused(backend), pytest.raises(exc, match=fragment):
        ops.process_logits(**kwargs)


@pytest.mark.parametrize("args,exc,fragment", [
    ((-1, 0, 0, 0, 0), ValueError, "seed"),
    ((0, 2**32, 0, 0, 0), ValueError, "c0"),
    ((0, 0, torch.tensor([-1]), 0, 0), ValueError, "c1"),
    ((0, 0, 0, torch.tensor([0.5]), 0), TypeError, "c2"),
    ((0, 0, 0, 0, "1"), ValueError, "c3"),
])
def test_philox_rejects_bad_input(args, exc, fragment):
    with pytest.raises(exc, match=fragment):
        ops.philox_uniform(*args)


def test_unknown_backend_is_named(monkeypatch):
    with pytest.raises(ValueError, match="'tpu'"):
        lantern.enable_fused("tpu")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="triton.*TRITON_INTERPRET"):
            lantern.enable_fused("triton")
    assert lantern.active_backend() == "reference"
