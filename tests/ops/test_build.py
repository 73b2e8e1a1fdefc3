"""The C++/CUDA extension lantern._C: it imports, registers its ops (CUDA kernels too when CI demands it),
and its ops trace under FakeTensorMode and torch.compile."""
import os
import time

import pytest
import torch

import lantern
from lantern import _backend

_C = pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")
from lantern.ops import extension  # noqa: E402

OPS = ("lantern::compact_kv", "lantern::philox_uniform")
REQUIRE_CUDA_BUILD = os.environ.get("CI") == "true" or os.environ.get("LANTERN_REQUIRE_CUDA_BUILD") == "1"


def _has_kernel(op, key):
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)


def test_extension_imports_and_registers_cpu_kernels():
    assert isinstance(_C.cuda_compiled(), bool)
    for op in OPS:
        assert _has_kernel(op, "CPU"), op
    assert _backend._why_unavailable("cpu") is None
    assert lantern.fused_ops("cpu")["compact_kv"] and lantern.fused_ops("cpu")["philox_uniform"]


def test_cuda_kernels_compiled():
    """In CI (CI=true or LANTERN_REQUIRE_CUDA_BUILD=1) the .cu sources must have compiled into lantern._C."""
    if not REQUIRE_CUDA_BUILD and not _C.cuda_compiled():
        pytest.skip("lantern._C was built without CUDA kernels (set CI=true to require them)")
    assert _C.cuda_compiled(), "lantern._C was built without csrc/cuda (is CUDA_HOME set at build time?)"
    for op in OPS:
        assert _has_kernel(op, "CUDA"), f"{op} has no CUDA kernel"


def test_cuda_availability_says_why():
    why = _backend._why_unavailable("cuda")
    if extension.cuda_compiled() and torch.cuda.is_available():
        assert why is None
    else:
        assert isinstance(why, str) and ("CUDA" in why)


def _compact_inputs():
    cache = torch.randn(2, 2, 3, 2, 10, 4)  # [layers, K/V, B, Hkv, Lmax, Dh]
    cache_len = torch.tensor([2, 0, 5])
    path_nodes = torch.tensor([[0, 1, 3], [0, 2, -1], [0, -1, -1]])
    n_keep = torch.tensor([3, 2, 1])
    return cache, cache_len, path_nodes, n_keep


def test_opcheck_compact_kv():
    torch.library.opcheck(torch.ops.lantern.compact_kv.default, _compact_inputs())


def test_opcheck_philox_uniform():
    args = (torch.tensor(42), torch.arange(6).view(2, 3), torch.tensor(1), torch.tensor([[7], [8]]), torch.tensor(0))
    torch.library.opcheck(torch.ops.lantern.philox_uniform.default, args)


def test_fake_tensor_mode_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        cache, cache_len, path_nodes, n_keep = (mode.from_tensor(t) for t in _compact_inputs())
        new_len = torch.ops.lantern.compact_kv(cache, cache_len, path_nodes, n_keep)
        assert new_len.shape == (3,) and new_len.dtype == torch.int64
        seed, c0, c1, c = (mode.from_tensor(t) for t in (torch.tensor(0), torch.zeros(4, 1, dtype=torch.int64),
                                                          torch.zeros(5, dtype=torch.int32), torch.tensor(0)))
        u = torch.ops.lantern.philox_uniform(seed, c0, c1, c, c)
        assert u.shape == (4, 5) and u.dtype == torch.float32


def test_torch_compile_fullgraph():
    """torch.compile (inductor; ~10 s cold on 2 CPU cores) traces the in-place compact_kv and philox_uniform
    in one graph, and the compiled graph gives the eager results."""
    def step(cache, cache_len, path_nodes, n_keep, seed, offset):
        new_len = torch.ops.lantern.compact_kv(cache, cache_len, path_nodes, n_keep)
        u = torch.ops.lantern.philox_uniform(seed, torch.arange(4), new_len[:, None], torch.tensor(0), offset)
        return new_len * 1, u + 0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    eager_args = _compact_inputs() + (torch.tensor(7), torch.tensor(3))
    comp_args = tuple(t.clone() for t in eager_args)
    t0 = time.perf_counter()
    got = compiled(*comp_args)
    assert time.perf_counter() - t0 < 120, "torch.compile took over 2 minutes"
    want = step(*eager_args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(comp_args[0], eager_args[0], rtol=0, atol=0)  # the in-place update survives


@pytest.mark.slow
def test_sdist_holds_every_source_whatever_the_build_finds(tmp_path):
    """The sdist made on a machine without CUDA (LANTERN_NO_CUDA=1, as in CI's sdist step) still holds every
    tracked C++/CUDA source and header, the nvcc wrapper and the kernels, so that any machine can build it."""
    import subprocess
    import sys
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sources = ["csrc", "python/lantern", "tools/nvcc_ptxas_log.py"]
    tracked = subprocess.run(["git", "ls-files", *sources], cwd=root, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    needed = set(tracked.stdout.split())
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d",
                    str(tmp_path)], cwd=root, env={**os.environ, "LANTERN_NO_CUDA": "1"}, check=True,
                   capture_output=True)
    (archive,) = tmp_path.glob("lantern-*.tar.gz")
    with tarfile.open(archive) as tar:
        held = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = sorted(needed - held)
    assert not missing, missing
    assert not any(name.endswith((".so", ".pyc")) for name in held)


# a process whose lantern declares philox_uniform with one argument fewer than lantern._C's kernel takes: the
# Python package changed a schema and the extension was not rebuilt
_STALE_BUILD = """
import json
import warnings
import torch
define = torch.library.define
def changed(name, schema, *args, **kwargs):
    if name == "lantern::philox_uniform":
        schema = "(Tensor seed, Tensor c0, Tensor c1, Tensor c2) -> Tensor"
    return define(name, schema, *args, **kwargs)
torch.library.define = changed
import lantern
seen = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    seen["build_info"] = lantern.build_info()
seen["warned"] = " ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
seen["registered"] = torch._C._dispatch_has_kernel_for_dispatch_key("lantern::compact_kv", "CPU")
try:
    lantern.enable_fused("cpu")
except RuntimeError as e:
    seen["refused"] = str(e)
lantern.enable_fused("auto")
seen["auto"] = lantern.ops.philox_uniform(1, torch.arange(3), 0, 0, 0).tolist()
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_a_kernel_that_does_not_match_its_schema_raises_instead_of_aborting():
    """lantern._C registers its kernels when lantern calls register_kernels(), not from static initializers: a
    kernel whose signature differs from the schema the Python package declares (a stale build) gives a Python
    RuntimeError saying to rebuild, no kernel stays registered, the cpu backend refuses with that reason and
    "auto" runs the reference; the process does not abort. The control: this process's lantern registers
    them (test_extension_imports_and_registers_cpu_kernels)."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _STALE_BUILD], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = json.loads(run.stdout.splitlines()[-1])
    for key in ("build_info", "warned", "refused"):
        assert "lantern._C does not match the lantern Python package" in lines[key], (key, lines[key])
        assert "make install" in lines[key] and "pip install --no-build-isolation -e ." in lines[key]
    assert "lantern::philox_uniform" in lines["refused"]  # the dispatcher's message names the op
    assert lines["registered"] is False  # the kernels registered before the mismatch were undone
    from lantern.ops.reference.philox import philox_uniform

    assert lines["auto"] == philox_uniform(1, torch.arange(3), 0, 0, 0).tolist()
