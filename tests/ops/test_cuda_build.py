"""Checks of the CUDA build, on the built lantern._C (no GPU needed):

- every csrc/cuda/*.cu has SASS for sm_80 and sm_90 in the extension, with the same kernels for both
  (``cuobjdump --list-elf`` / ``--dump-resource-usage``). With the build's TORCH_CUDA_ARCH_LIST "8.0;9.0" this
  is the check that every .cu compiles for both architectures;
- no kernel spills registers, on either architecture: ptxas's ``-v`` report of the very compile that produced
  the extension (build/ptxas/<file>.log, written by tools/nvcc_ptxas_log.py, which setup.py routes nvcc
  through), cross-checked against the kernels cuobjdump finds in the binary so a stale or missing report fails;
- a negative control: a torch-free .cu with a forced spill (tests/ops/spill_control.cu, plain nvcc through the
  same wrapper, seconds) is flagged by the same check, and a stack-allocated array alone is not.

They need nvcc, cuobjdump (CUDA toolkit, or the copy triton ships) and a CUDA build of lantern._C. Without
them they skip, except in CI (CI=true or LANTERN_REQUIRE_CUDA_BUILD=1), where they fail.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tools import cuda_resources as cr  # noqa: E402

REQUIRE_CUDA_BUILD = os.environ.get("CI") == "true" or os.environ.get("LANTERN_REQUIRE_CUDA_BUILD") == "1"
CONTROL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spill_control.cu")
GENCODE = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in cr.REQUIRED_ARCHS]


def _require(condition: bool, reason: str) -> None:
    if condition:
        return
    if REQUIRE_CUDA_BUILD:
        pytest.fail(f"{reason} (required in CI: CI=true or LANTERN_REQUIRE_CUDA_BUILD=1)")
    pytest.skip(reason)


def _tool(name: str) -> str:
    path = cr.find_tool(name)
    _require(path is not None, f"{name} not found ($CUDA_HOME/bin, PATH, triton's bundled tools)")
    return path


def _cuobjdump(*args: str) -> str:
    run = subprocess.run([_tool("cuobjdump"), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"cuobjdump {' '.join(args)} failed: {run.stderr[-2000:]}"
    return run.stdout


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


# ---- the checks, shared by the tests on lantern._C and the negative controls ------------------------------

def missing_archs(cubins: Set[Tuple[str, str]], stems: Iterable[str]) -> Dict[str, List[str]]:
    """{stem: [required archs with no cubin]} for the stems missing any."""
    missing = {s: [a for a in cr.REQUIRED_ARCHS if (s, a) not in cubins] for s in stems}
    return {s: archs for s, archs in missing.items() if archs}


def kernels_by_source_arch(kernels: Iterable[cr.BinaryKernel]) -> Dict[str, Dict[str, Set[str]]]:
    """{source stem: {arch: {kernel names}}} from cuobjdump's resource usage."""
    table: Dict[str, Dict[str, Set[str]]] = defaultdict(lambda: defaultdict(set))
    for k in kernels:
        table[_stem(k.source)][k.arch].add(k.name)
    return table


def spill_failures(functions: Iterable[cr.PtxasFunction]) -> List[str]:
    """One line per function that spills (or whose architecture the report does not say)."""
    return [f"{f.name} [{f.arch or 'arch unknown'}]: {f.spill_store_bytes} bytes spill stores, "
            f"{f.spill_load_bytes} bytes spill loads, {f.stack_bytes} bytes stack frame"
            for f in functions if f.spills or f.arch is None]


# ---- lantern._C -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def extension() -> str:
    spec = importlib.util.find_spec("lantern._C")
    _require(spec is not None and spec.origin is not None, "lantern._C is not built")
    return spec.origin


@pytest.fixture(scope="module")
def binary_kernels(extension) -> Dict[str, Dict[str, Set[str]]]:
    table = kernels_by_source_arch(cr.parse_resource_usage(_cuobjdump("--dump-resource-usage", extension)))
    _require(bool(table), f"{os.path.basename(extension)} holds no CUDA kernels (built without CUDA)")
    return table


def test_cuda_sources_exist():
    assert cr.cuda_sources(), "no csrc/cuda/*.cu found"


def test_every_cu_has_sass_for_sm80_and_sm90(extension, binary_kernels):
    """Each csrc/cuda/*.cu is in the extension as SASS for sm_80 and sm_90, with the same kernels in both."""
    stems = [_stem(s) for s in cr.cuda_sources()]
    assert not missing_archs(cr.parse_list_elf(_cuobjdump("--list-elf", extension)), stems), (
        "cuobjdump --list-elf: no SASS for "
        f"{missing_archs(cr.parse_list_elf(_cuobjdump('--list-elf', extension)), stems)}")
    for stem in stems:
        by_arch = binary_kernels.get(stem, {})
        assert all(by_arch.get(a) for a in cr.REQUIRED_ARCHS), f"{stem}.cu: kernels per arch {dict(by_arch)}"
        assert by_arch[cr.REQUIRED_ARCHS[0]] == by_arch[cr.REQUIRED_ARCHS[1]], (
            f"{stem}.cu: different kernels for {cr.REQUIRED_ARCHS}: {dict(by_arch)}")


@pytest.mark.parametrize("source", cr.cuda_sources(), ids=_stem)
def test_no_register_spills(source, binary_kernels):
    """ptxas's report of this .cu's compile into lantern._C: 0 bytes spilled by every function on every
    required arch. The report must describe the binary: the same kernels per arch, not older than the object."""
    stem = _stem(source)
    log = os.path.join(cr.PTXAS_LOG_DIR, f"{stem}.log")
    _require(os.path.exists(log), f"no ptxas report {os.path.relpath(log, ROOT)}: lantern._C was not built by "
             "setup.py through tools/nvcc_ptxas_log.py (PYTORCH_NVCC set to something else?)")
    header, functions = cr.read_ptxas_log(log)
    obj = header.get("object", "")
    assert not (os.path.exists(obj) and os.path.getmtime(obj) > os.path.getmtime(log) + 1), (
        f"{log} is older than {obj}: the object was rebuilt without the ptxas report")
    reported = {a: {f.name for f in functions if f.entry and f.arch == a} for a in cr.REQUIRED_ARCHS}
    built = {a: binary_kernels.get(stem, {}).get(a, set()) for a in cr.REQUIRED_ARCHS}
    assert reported == built, f"{log} does not describe lantern._C's kernels: report {reported}, binary {built}"
    failures = spill_failures(functions)
    assert not failures, f"{stem}.cu spills registers:\n" + "\n".join(failures)


# ---- negative controls ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_spill_check_flags_a_forced_spill(tmp_path):
    """spill_control.cu, compiled through the build's nvcc wrapper: the spill check flags spill_kernel on both
    archs, not the kernel whose stack frame holds only a local array, nor the clean one; cuobjdump sees the
    spill kernel's stack frame (spilled registers live there) in the object."""
    nvcc = _tool("nvcc")
    obj = str(tmp_path / "spill_control.o")
    env = dict(os.environ, LANTERN_PTXAS_LOG_DIR=str(tmp_path / "ptxas"), LANTERN_REAL_NVCC=nvcc)
    # the arguments as torch's ninja build passes them: "-c" twice, dependency file first
    args = ["-MD", "-MF", f"{obj}.d", *GENCODE, "-c", "-c", CONTROL, "-o", obj]
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "nvcc_ptxas_log.py"), *args],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "bytes spill stores" not in run.stderr  # the report goes to the log, not the build output
    header, functions = cr.read_ptxas_log(str(tmp_path / "ptxas" / "spill_control.log"))
    assert header["source"] == CONTROL and header["object"] == obj
    flagged = spill_failures(functions)
    assert sorted(line.split(" [")[1].split("]")[0] for line in flagged if "spill_kernel" in line) == list(
        cr.REQUIRED_ARCHS), flagged
    assert len(flagged) == len(cr.REQUIRED_ARCHS), flagged
    local = [f for f in functions if "local_array_kernel" in f.name]
    assert len(local) == 2 and all(f.stack_bytes > 0 and not f.spills for f in local), local

    kernels = cr.parse_resource_usage(_cuobjdump("--dump-resource-usage", obj))
    assert {k.arch for k in kernels if "spill_kernel" in k.name and k.stack_bytes > 0} == set(cr.REQUIRED_ARCHS)
    assert not missing_archs(cr.parse_list_elf(_cuobjdump("--list-elf", obj)), ["spill_control"])


def test_arch_check_flags_a_missing_arch():
    listing = "ELF file    1: compact_kv.sm_80.cubin\nELF file    2: verify.1.sm_80.cubin\n" \
              "ELF file    3: verify.2.sm_90.cubin\n"
    assert missing_archs(cr.parse_list_elf(listing), ["compact_kv", "verify", "tree_attention"]) == {
        "compact_kv": ["sm_90"], "tree_attention": ["sm_80", "sm_90"]}


def test_ptxas_parser_reads_non_entry_functions_and_unknown_archs():
    report = ("ptxas info    : 0 bytes gmem\n"
              "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
              "ptxas info    : Function properties for _Z1kv\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
              "ptxas info    : Function properties for _Z6helperv\n"
              "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
              "ptxas info    : 0 bytes gmem\n"
              "ptxas info    : Function properties for _Z6orphanv\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    functions = cr.parse_ptxas(report)
    assert functions == [cr.PtxasFunction("_Z1kv", "sm_90", True, 0, 0, 0),
                         cr.PtxasFunction("_Z6helperv", "sm_90", False, 16, 8, 4),
                         cr.PtxasFunction("_Z6orphanv", None, False, 0, 0, 0)]
    assert len(spill_failures(functions)) == 2


# ---- nvcc never parses torch's headers (csrc/cuda/*.cu are torch-free; bindings.cpp is the torch side) ------

TORCH_HEADER_PREFIXES = ("ATen/", "c10/", "torch/", "pybind11/", "Python.h")
INCLUDE_DIRS = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]


def torch_include_chains(path: str, seen: Set[str] | None = None) -> List[List[str]]:
    """Every chain of #includes from `path` to a torch / pybind11 header, following the quoted includes that
    resolve inside the checkout (the file's directory, csrc/include, csrc)."""
    seen = set() if seen is None else seen
    if path in seen:
        return []
    seen.add(path)
    chains = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("#include"):
                continue
            name = line.split(None, 1)[1].strip()[1:-1]
            if name.startswith(TORCH_HEADER_PREFIXES):
                chains.append([name])
                continue
            for directory in [os.path.dirname(path), *INCLUDE_DIRS]:
                found = os.path.join(directory, name)
                if line.split(None, 1)[1].startswith('"') and os.path.isfile(found):
                    chains += [[name, *chain] for chain in torch_include_chains(found, seen)]
                    break
    return chains


@pytest.mark.parametrize("source", cr.cuda_sources(), ids=_stem)
def test_cuda_sources_never_include_torch(source):
    """nvcc's device passes parse a translation unit once per architecture: a .cu that reaches torch's headers
    costs about a minute of CPU to build instead of seconds."""
    assert torch_include_chains(source) == [], f"{os.path.relpath(source, ROOT)} includes torch"


def test_torch_include_scan_sees_the_bindings_includes(tmp_path):
    """Negative control: the torch side reaches torch directly and through op_checks.h."""
    chains = torch_include_chains(os.path.join(ROOT, "csrc", "cuda", "bindings.cpp"))
    assert ["ATen/ops/empty.h"] in chains and ["op_checks.h", "ATen/core/Tensor.h"] in chains
    source = tmp_path / "uses_checks.cu"
    source.write_text('#include "lantern/cuda/launch.h"\n#include "kernel_registry.h"\n')
    assert torch_include_chains(str(source)) == [["kernel_registry.h", "torch/library.h"]]
