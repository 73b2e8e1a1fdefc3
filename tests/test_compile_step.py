"""The ops as torch.library operators (lantern.ops.library, docs/dispatch.md) and a decoding step under
torch.compile(fullgraph=True): each op's one schema (its module's) in every namespace, every namespace's
registrations pass torch.library.opcheck (schema, fake tensors, AOT dispatch), the target's cached tree forward and one
speculative / AR step of the decoding loop trace into one graph and give the eager step's results, and the
value scans of the argument checks are left out while tracing only (shape / dtype checks still run)."""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import textwrap

import pytest
import torch

import lantern
import tiny_random_models
from lantern import _backend, ops
from lantern.decoding import Sampling, SpecConfig
from lantern.decoding.planner import Plan
from lantern.decoding.proposers import new_state
from lantern.decoding.state import DecodeState
from lantern.ops import (
    continuous_verify_op,
    draft_sample_op,
    library,
    philox_uniform_op,
    self_check,
    triton_backend,
    verify_op,
)
from lantern.ops.reference.tree import ancestor_mask

CPU = torch.device("cpu")
COMPILE = dict(backend="aot_eager", fullgraph=True)


def extension_built() -> bool:
    return importlib.util.find_spec("lantern._C") is not None and lantern.fused_ops("cpu").get("verify", False)


def triton_interpreted() -> bool:
    return triton_backend.triton_unavailable() is None and triton_backend.interpreting()


needs_extension = pytest.mark.skipif(not extension_built(), reason="lantern._C is not built")
BACKENDS = [pytest.param("reference"), pytest.param("cpu", marks=needs_extension)]


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    lantern.disable_fused()


# ---- the declarations ---------------------------------------------------------------------------------

EXTENSION_OPS = [op.name for op in library.ops() if library.EXTENSION in op.backends.values()]


def test_each_op_has_its_modules_schema_in_every_namespace():
    """The schema is written once, in the op module; lantern._C only registers kernels for it."""
    for op in library.ops():
        assert str(getattr(torch.ops.lantern_reference, op.name).default._schema) == \
            f"lantern_reference::{op.name}{op.schema}"
        if op.name in EXTENSION_OPS:
            assert str(getattr(torch.ops.lantern, op.name).default._schema) == f"lantern::{op.name}{op.schema}"


@needs_extension
def test_lantern_C_registers_kernels_for_the_declared_ops():
    """Every op whose table names lantern._C has its CPU kernel."""
    for name in EXTENSION_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lantern::{name}", "CPU"), name
    assert set(EXTENSION_OPS) == {"verify", "latent_neighbours", "tree_attention", "compact_kv", "philox_uniform",
                                  "continuous_verify", "draft_sample"}


def same_schema(name: str, a: str, b: str) -> bool:
    """Whether two schema strings of op ``name`` declare the same operator, as torch compares schemas (which
    counts SymInt as int: triton_op infers SymInt from an ``int`` annotation); alias sets may be named
    differently (infer_schema names them a0, a1, ...)."""
    def parse(schema):
        return torch._C.parse_schema(name + re.sub(r"\(\w+!\)", "(a!)", schema))
    return parse(a) == parse(b)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("name", triton_backend.triton_ops())
def test_triton_launchers_annotations_give_the_declared_schema(name):
    """torch releases before 2.14 ignore triton_op's ``schema=`` and infer the schema from the launcher's
    annotations, so the annotations must spell the declared schema."""
    op = library.OPS[name]
    module = importlib.import_module(op.triton_module)
    inferred = torch.library.infer_schema(module.launch, mutates_args=op.mutates)
    assert same_schema(name, inferred, op.schema), (inferred, op.schema)


def test_same_schema_tells_different_schemas_apart():
    assert same_schema("f", "(Tensor(a0!) x, SymInt k) -> Tensor", "(Tensor(a!) x, int k) -> Tensor")
    assert not same_schema("f", "(Tensor(a!) x, int k) -> Tensor", "(Tensor x, int k) -> Tensor")
    assert not same_schema("f", "(Tensor x, float k) -> Tensor", "(Tensor x, int k) -> Tensor")
    assert not same_schema("f", "(Tensor x, Tensor? y=None) -> Tensor", "(Tensor x, Tensor? y) -> Tensor")


TRITON_SCHEMA_SCRIPT = textwrap.dedent('''
    import json
    import torch
    from lantern.ops import triton_backend
    assert triton_backend.import_failures() == {}, triton_backend.import_failures()  # declares every op
    print(json.dumps({name: str(getattr(torch.ops.lantern_triton, name).default._schema)
                      for name in triton_backend.triton_ops()}))
''')


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_ops_on_a_gpu_have_the_declared_schemas():
    """Imported as on a GPU (no interpreter: each op a triton_op; in a subprocess, no GPU needed), every
    lantern_triton op registers with its declared schema, whatever this torch does with ``schema=``."""
    from triton_compile import run_compile_script

    schemas = json.loads(run_compile_script(TRITON_SCHEMA_SCRIPT, timeout=300).strip().splitlines()[-1])
    assert set(schemas) == set(triton_backend.triton_ops())
    for name, schema in schemas.items():
        prefix = f"lantern_triton::{name}"
        assert schema.startswith(prefix) and same_schema(name, schema[len(prefix):], library.OPS[name].schema), schema


def op_samples():
    """(op name, schema arguments) per op: the self-check cases converted as the public ops convert them."""
    verify = verify_op.to_schema("triton", **self_check.verify_cases(CPU)[0][0])
    seed, c0, c1, c2, c3 = self_check.philox_cases(CPU)[1]
    parents = torch.tensor(self_check.ATT_PARENTS)
    scores = torch.tensor([[-0.5, -1.0, -0.75, -2.0], [-0.25, -0.5, -3.0, -0.6]])
    cand_parents = torch.tensor([[-1, -1, 0, 1], [-1, 0, 1, 0]])
    cv = self_check.continuous_cases(CPU)[1][0]
    draft = self_check.draft_cases(CPU)[1][0]
    continuous = continuous_verify_op.to_schema(
        "cpu", *(cv[n] for n in ("draft", "mu_p", "sigma_p", "mu_q", "sigma_q", "logsig_p", "logsig_q", "rule",
                                 "bandwidth", "sigma_ratio")), 1000, cv["seed"], cv["offset"], rows=cv["rows"],
        positions=cv["positions"])
    return {
        "verify": verify,
        "continuous_verify": continuous,
        "latent_neighbours": (self_check.neighbour_codebook(CPU), self_check.NEIGHBOUR_K, True),
        "tree_attention": self_check.attention_case(CPU),
        "compact_kv": self_check.compact_case(CPU),
        "philox_uniform": philox_uniform_op.to_schema("cpu", seed, c0, c1, c2, c3),
        "draft_sample": draft_sample_op.to_schema(
            "cpu", draft["logits"], draft["uncond_logits"], draft["cfg_scale"], draft["temperature"],
            draws=draft["draws"], seed=draft["seed"], node_ids=draft["node_ids"], offset=draft["offset"],
            rows=draft["rows"]),
        "process_logits": (verify[0], verify[4], verify[5], verify[6], verify[7], verify[8]),
        "ancestor_mask": (parents,),
        "build_tree": (torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), cand_parents, scores, torch.tensor([9, 0]), 3),
    }


def namespaces():
    found = [("lantern_reference", op.name) for op in library.ops()]
    if extension_built():
        found += [("lantern", name) for name in EXTENSION_OPS]
    if triton_interpreted():
        _backend._load_backends()
        found += [("lantern_triton", name) for name in _backend._REGISTRY["triton"]]
    return found


@pytest.mark.parametrize("namespace, name", namespaces(), ids=lambda x: x)
def test_opcheck(namespace, name):
    """Schema (mutation and aliasing as declared), fake implementation against the kernel's real outputs,
    and AOT dispatch with dynamic shapes, on the self-check's inputs."""
    op = getattr(getattr(torch.ops, namespace), name).default
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    if namespace == "lantern_triton":  # the interpreter runs each kernel in Python: one pass of each test
        utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(op, op_samples()[name], test_utils=utils)


TRITON_OP_SCRIPT = textwrap.dedent('''
    import json, logging
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from lantern.ops import self_check, triton_backend, verify_op
    assert triton_backend.import_failures() == {}, triton_backend.import_failures()  # declares every op

    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)  # no driver here
    cpu = torch.device("cpu")
    kw = self_check.verify_cases(cpu)[0][0]
    cases = {
        "verify": verify_op.to_schema("triton", **kw),
        "latent_neighbours": (self_check.neighbour_codebook(cpu), 5, True),
        "tree_attention": self_check.attention_case(cpu),
        "compact_kv": self_check.compact_case(cpu),
    }
    report = {}
    for name, real in cases.items():
        with FakeTensorMode():  # CUDA tensors without a GPU: shapes, strides and dtypes only
            fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                    if isinstance(t, torch.Tensor) else t for t in real]
        op = getattr(torch.ops.lantern_triton, name)
        graph = make_fx(dispatch_functionalize(lambda *a: op(*a)), tracing_mode="fake")(*fake)
        report[name] = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    print(json.dumps(report))
''')


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_ops_decompose_into_their_kernels_for_inductor():
    """On a GPU (no interpreter) each lantern_triton op is a triton_op: functionalised, as AOT autograd does
    before inductor, it becomes its Triton kernel launches (triton_kernel_wrapper_functional), not an opaque
    call. Traced here with fake CUDA tensors, in a subprocess without TRITON_INTERPRET (no GPU needed)."""
    from triton_compile import run_compile_script

    report = json.loads(run_compile_script(TRITON_OP_SCRIPT, timeout=600).strip().splitlines()[-1])
    assert set(report) == {"verify", "latent_neighbours", "tree_attention", "compact_kv"}
    for name, targets in report.items():
        assert "triton_kernel_wrapper_functional" in targets, (name, targets)
        assert not any(t.startswith("lantern_triton") for t in targets), (name, targets)


def test_fake_outputs_have_the_kernels_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    samples = op_samples()
    for name, args in samples.items():
        want = getattr(torch.ops.lantern_reference, name)(*[a.clone() if isinstance(a, torch.Tensor) else a
                                                             for a in args])
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            got = getattr(torch.ops.lantern_reference, name)(*fake_args)
        for g, w in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))):
            assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device), name


# ---- the cached forward and a decoding step under torch.compile(fullgraph=True) -----------------------------

def small_models():
    """float64: the step tests compare eager and traced steps whose drafter calls have other row counts."""
    return tiny_random_models.small_models(dtype=torch.float64)


def enable(backend: str) -> None:
    if backend != "reference":
        lantern.enable_fused(backend)


def tree_inputs():
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, -1]])
    tokens = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 0]])
    positions = torch.tensor([[0, 1, 1, 2, 2], [0, 1, 2, 3, 1]])
    return tokens, positions, ancestor_mask(parents)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_cached_tree_forward_traces_as_one_graph(backend):
    enable(backend)
    target, _ = small_models()
    target.setup_cache(2, 40)
    target(None, torch.tensor([1, 2]), cache_len=torch.zeros(2, dtype=torch.int64))  # the condition
    cache_len = torch.ones(2, dtype=torch.int64)
    tokens, positions, mask = tree_inputs()

    def forward(tokens, cache_len, positions, mask):
        return target(tokens, cache_len=cache_len, positions=positions, tree_mask=mask, return_hidden=True)

    before = target.kv_cache.clone()
    want = forward(tokens, cache_len, positions, mask)
    want_cache = target.kv_cache.clone()
    target.kv_cache.copy_(before)
    got = torch.compile(forward, **COMPILE)(tokens, cache_len, positions, mask)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(target.kv_cache, want_cache)


PLANS = {
    "chain": Plan("chain3", "chain", depth=3),
    "sampled_chain": Plan("chain3s", "chain", depth=3, sampled=True),
    "static": Plan("static2-1-1", "static", depth=3, static_widths=(2, 1, 1)),
    "dynamic": Plan("tree8", "dynamic", depth=3, n_nodes=8, top_per_node=3),
    "ar": Plan("ar", "ar"),
}


def twin_loops(method: str, plan: Plan):
    """Two decoding states of the same batch, on separate copies of the models, two eager steps in."""
    target, drafter = small_models()
    neighbours = ops.latent_neighbours(torch.randn(target.config.vocab_size, 4), 4)
    config = SpecConfig(method=method, k=4, delta=0.2)
    sampling = Sampling(cfg_scale=2.0, temperature=1.0, seed=7)
    plans = [plan, PLANS["chain"]]
    loops = []
    for _ in range(2):
        t, d = copy.deepcopy((target, drafter))
        loops.append(new_state(t, d, torch.tensor([1, 3, 4]), neighbours, config, sampling, t.config.block_size,
                               plans, catch_up=True))
    for loop in loops:
        for step in (1, 2):
            loop.step(PLANS["chain"], step)
    return loops


def compile_one_graph(fn):
    """fn compiled with aot_eager into one graph, and a function listing the custom ops that graph calls."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def custom_ops():
        assert counter.frame_count == 1
        return {str(node.target) for node in counter.graphs[0].graph.nodes
                if node.op == "call_function" and str(node.target).startswith("lantern")}

    return torch.compile(fn, backend=counter, fullgraph=True), custom_ops


# the ops a speculative step calls, per backend (the reference ones while tracing: lantern_reference::)
STEP_OPS = {
    "cpu": {"lantern.verify", "lantern.tree_attention", "lantern.compact_kv"},
    "reference": {"lantern_reference.verify", "lantern_reference.tree_attention", "lantern_reference.compact_kv"},
}


def assert_same_state(a: DecodeState, b: DecodeState) -> None:
    """Tokens, lengths and counts equal; the float states equal up to float64 rounding. Eager feeds the drafter
    the longest row's columns, traced code all of the tree's, so the drafter's products have other row counts,
    and a machine whose matrix products round by row count (AVX-512 / AMX, GPUs) differs in their last bits
    (~1e-16 relative; a float32 tree-attention input could round the other way with probability ~1e-6 over the
    test, then ~1e-7: tolerance 1e-9). Decisions on such values change with probability < 1e-8 per decision."""
    for name in ("out", "n_done", "target_len"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    fa, fb = a.proposer.feed, b.proposer.feed
    assert torch.equal(fa.n, fb.n) and torch.equal(a.figures.accept_len, b.figures.accept_len)
    width = fa.width
    close = lambda x, y: torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)  # noqa: E731
    assert torch.equal(fa.tokens[:, :width], fb.tokens[:, :width])
    close(fa.features[:, :width], fb.features[:, :width])
    close(a.target.kv_cache, b.target.kv_cache)
    close(a.proposer.drafter.kv_cache, b.proposer.drafter.kv_cache)
    assert torch.equal(a.proposer.drafter.cache_len, b.proposer.drafter.cache_len)


@pytest.mark.slow
@pytest.mark.parametrize("backend, method, plan", [
    pytest.param("cpu", "lantern", "chain", marks=needs_extension),
    pytest.param("cpu", "spec", "dynamic", marks=needs_extension),
    pytest.param("cpu", "lantern", "sampled_chain", marks=needs_extension),
    pytest.param("cpu", "spec", "static", marks=needs_extension),
    ("reference", "lantern", "dynamic"),
])
@torch.no_grad()
def test_speculative_step_traces_as_one_graph(backend, method, plan):
    """Drafter catch-up and tree growth, the target's tree forward, verify, the commit and compact_kv."""
    enable(backend)
    eager, traced = twin_loops(method, PLANS[plan])
    want = eager.step(PLANS[plan], 3)
    step, custom_ops = compile_one_graph(traced.step)
    got = step(PLANS[plan], 3)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert_same_state(eager, traced)
    called = custom_ops()
    assert STEP_OPS[backend] <= called, called
    if plan == "dynamic":  # a fixed-shape tree's mask is made once per run (DecodeState.tree_inputs)
        assert {"lantern_reference.build_tree", "lantern_reference.ancestor_mask"} <= called
    # the traced step fed the drafter all of the tree's columns, eager only the longest row's: same next step
    eager.step(PLANS[plan], 4)
    traced.step(PLANS[plan], 4)
    assert torch.equal(eager.out, traced.out) and torch.equal(eager.n_done, traced.n_done)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_ar_step_traces_as_one_graph(backend):
    enable(backend)
    eager, traced = twin_loops("lantern", PLANS["ar"])
    want = eager.step(PLANS["ar"], 3)
    got = torch.compile(traced.step, **COMPILE)(PLANS["ar"], 3)
    assert torch.equal(got[0], want[0])
    assert_same_state(eager, traced)


@pytest.mark.slow
@pytest.mark.skipif(not triton_interpreted(), reason="needs triton (run under TRITON_INTERPRET=1 on CPU)")
@torch.no_grad()
def test_speculative_step_traces_with_the_triton_ops():
    """Under the interpreter the Triton ops are opaque custom ops (their fake implementations trace them)."""
    lantern.enable_fused("triton")
    eager, traced = twin_loops("lantern", PLANS["chain"])
    want = eager.step(PLANS["chain"], 3)
    got = torch.compile(traced.step, **COMPILE)(PLANS["chain"], 3)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert_same_state(eager, traced)


@pytest.mark.slow
@needs_extension
@torch.no_grad()
def test_cached_tree_forward_compiles_with_inductor():
    lantern.enable_fused("cpu")
    target, _ = small_models()
    target.setup_cache(2, 40)
    target(None, torch.tensor([1, 2]), cache_len=torch.zeros(2, dtype=torch.int64))
    cache_len = torch.ones(2, dtype=torch.int64)
    tokens, positions, mask = tree_inputs()

    def forward(tokens, cache_len, positions, mask):
        return target(tokens, cache_len=cache_len, positions=positions, tree_mask=mask)

    before = target.kv_cache.clone()
    want = forward(tokens, cache_len, positions, mask)
    target.kv_cache.copy_(before)
    got = torch.compile(forward, fullgraph=True)(tokens, cache_len, positions, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ---- argument checks while tracing -------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.no_kernel_check("eager: bad input rejected; traced: the compiled graph calls the op itself")
def test_value_scans_run_eagerly_and_are_left_out_of_traced_code(backend):
    enable(backend)
    q, k, v, cache_len, mask = self_check.attention_case(CPU)
    no_self_bit = mask & ~1  # node 0 does not attend to itself: a value error, yet safe for every kernel
    with pytest.raises(ValueError, match="tree_mask must set bit i of node i"):
        ops.tree_attention(q, k, v, cache_len, no_self_bit)
    traced = torch.compile(lambda *args: ops.tree_attention(*args), **COMPILE)
    assert traced(q, k, v, cache_len, no_self_bit).shape == q.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_shape_and_dtype_checks_still_run_while_tracing(backend):
    enable(backend)
    q, k, v, cache_len, mask = self_check.attention_case(CPU)
    traced = torch.compile(lambda *args: ops.tree_attention(*args), backend="aot_eager")
    with pytest.raises(TypeError, match="cache_len must have dtype"):
        traced(q, k, v, cache_len.to(torch.int32), mask)
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        traced(q, k, v, cache_len, mask[:, :3])


def test_scanned_inputs_are_scanned_again_after_an_in_place_edit():
    """checks.RecentlyValid skips the scan of the same unchanged tensors only: an in-place edit is seen."""
    q, k, v, cache_len, mask = self_check.attention_case(CPU)
    ops.tree_attention(q, k, v, cache_len, mask)
    ops.tree_attention(q, k, v, cache_len, mask)  # known valid: not scanned
    mask[0, 0, 0] &= ~1  # node 0 of row 0 loses its own bit
    with pytest.raises(ValueError, match="tree_mask must set bit i of node i"):
        ops.tree_attention(q, k, v, cache_len, mask)
    cache_len[1] = 100
    with pytest.raises(ValueError, match="cache_len must satisfy"):
        ops.tree_attention(q, k, v, cache_len, ancestor_mask(torch.tensor(self_check.ATT_PARENTS)))
    parents = torch.tensor(self_check.ATT_PARENTS)
    ops.ancestor_mask(parents)
    parents[0, 2] = 3  # a parent after its child
    with pytest.raises(ValueError, match="topologically ordered"):
        ops.ancestor_mask(parents)


FRESH_PROCESS_SCRIPT = textwrap.dedent('''
    import torch
    import lantern
    from lantern.ops import self_check

    args = self_check.attention_case(torch.device("cpu"))
    traced = torch.compile(lambda *a: lantern.ops.tree_attention(*a), backend="aot_eager", fullgraph=True)
    print(tuple(traced(*args).shape))  # the reference backend, nothing run eagerly before
    lantern.enable_fused("auto")  # loads the fused backends (eager)
    traced = torch.compile(lambda *a: lantern.ops.tree_attention(*a), backend="aot_eager", fullgraph=True)
    print(tuple(traced(*args).shape))
''')


@pytest.mark.slow
def test_tracing_needs_no_eager_call_first():
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["(2,", "4,", "5,", "16)"] * 2
