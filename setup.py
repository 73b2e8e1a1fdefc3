"""Build lantern and its extension lantern._C (metadata: pyproject.toml).

lantern._C always holds the CPU kernels (csrc/ops.cpp + csrc/cpu/*.cpp). The CUDA kernels (csrc/cuda/*.cu,
torch-free, compiled by nvcc) and their torch bindings (csrc/cuda/bindings.cpp, by the host compiler; all with
-DLANTERN_WITH_CUDA) are added when a CUDA toolkit is found (CUDA_HOME, else /usr/local/cuda),
torch is a CUDA build and LANTERN_NO_CUDA is not "1". TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0".
Install: ``pip install --no-build-isolation -e .`` (MAX_JOBS bounds the parallel compile jobs). The build
records one line, with or without CUDA kernels and for which architectures, that ``lantern.build_info()``
returns (pip shows the build's own output only with -v). MANIFEST.in puts every source in the sdist.
"""
import glob
import json
import os
import shlex
import sys

from setuptools import find_packages, setup

if os.path.isdir("/usr/local/cuda"):
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")  # read by torch.utils.cpp_extension on import
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

try:
    import torch  # noqa: E402
except ImportError:
    sys.exit("lantern: setup.py needs torch, and lantern._C must be built against the torch it will run with: "
             "install torch first, then build without isolation: pip install --no-build-isolation <lantern>")
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _with_cuda():
    if os.environ.get("LANTERN_NO_CUDA") == "1":
        return False, "LANTERN_NO_CUDA=1"
    if torch.version.cuda is None:
        return False, "torch is not a CUDA build"
    if not CUDA_HOME or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    return True, f"CUDA toolkit at {CUDA_HOME}, TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"


def _arch_names(arch_list):
    """TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX") -> "sm_80, sm_90 (+PTX)"."""
    archs = [a for a in arch_list.replace(",", ";").replace(" ", ";").split(";") if a]
    names = ["sm_" + a.replace("+PTX", "").replace(".", "") for a in archs]
    return ", ".join(names) + (" (+PTX)" if any("+PTX" in a for a in archs) else "")


def build_info(with_cuda, why):
    """The one line lantern.build_info() reports: with or without CUDA kernels, for which architectures."""
    if with_cuda:
        return (f"lantern._C with CUDA kernels for {_arch_names(os.environ['TORCH_CUDA_ARCH_LIST'])} "
                f"(nvcc of {CUDA_HOME}, torch {torch.__version__})")
    return f"lantern._C without CUDA kernels: {why} (torch {torch.__version__})"


GENERATED = os.path.join(ROOT, "build", "generated")  # lantern_build_info.h, written by BuildExt


def _write_build_info(line):
    """build/generated/lantern_build_info.h, rewritten only when the line changes (ninja then rebuilds ops.cpp
    alone)."""
    path = os.path.join(GENERATED, "lantern_build_info.h")
    text = f"#pragma once\n#define LANTERN_BUILD_INFO {json.dumps(line)}\n"
    if os.path.exists(path) and open(path).read() == text:
        return
    os.makedirs(GENERATED, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


OPENMP = ("-fopenmp",) if sys.platform.startswith("linux") else ()  # macOS clang has no -fopenmp


def extension():
    with_cuda, why = _with_cuda()
    # torch 2.14's headers require C++20, which torch.utils.cpp_extension passes by default; the torch-free
    # headers under csrc/include/lantern stay C++17 so standalone tests can use them.
    info = build_info(with_cuda, why)
    kwargs = dict(
        name="lantern._C",
        sources=_sources("csrc/ops.cpp") + _sources("csrc/cpu/*.cpp"),
        include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include"), GENERATED],
        # -ffp-contract=off: no fused multiply-adds, so the CPU kernels round like the reference (g++ contracts
        # a * b + c by default wherever FMA is available, e.g. in target_clones variants). -g0: Python's CFLAGS
        # carry -g, and debug information for torch's headers is most of each object file (verify.cpp: 7.2 MB
        # with it, 0.26 MB without) and a quarter of its compile time.
        # -fopenmp: at::parallel_for is a header template that runs serially in code compiled without OpenMP;
        # with it, the kernels' parallel loops use torch's OpenMP runtime (libgomp, loaded by torch already).
        extra_compile_args={"cxx": ["-O3", "-ffp-contract=off", "-g0", *OPENMP], "nvcc": ["-O3", "-lineinfo"]},
        extra_link_args=list(OPENMP),
    )
    if not with_cuda:
        ext = CppExtension(**kwargs)
    else:
        kwargs["sources"] += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp")
        kwargs["define_macros"] = [("LANTERN_WITH_CUDA", "1")]
        _keep_ptxas_reports()
        ext = CUDAExtension(**kwargs)
    ext.lantern_build_info = info
    return ext


def _keep_ptxas_reports():
    """nvcc runs through tools/nvcc_ptxas_log.py (torch's ninja build honours PYTORCH_NVCC), which keeps
    ptxas's report of each .cu (registers, stack, spills per kernel and arch) in build/ptxas/<file>.log for
    tests/ops/test_cuda_build.py; the compile itself is unchanged. A PYTORCH_NVCC set by the caller wins."""
    os.environ.setdefault("LANTERN_REAL_NVCC", os.path.join(CUDA_HOME, "bin", "nvcc"))
    wrapper = os.path.join(ROOT, "tools", "nvcc_ptxas_log.py")
    os.environ.setdefault("PYTORCH_NVCC", f"{shlex.quote(sys.executable)} {shlex.quote(wrapper)}")


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """A persistent build/temp (editable installs otherwise compile in a fresh temp dir each time), so ninja
    rebuilds only what changed."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")

    def run(self):
        for ext in self.extensions:
            info = getattr(ext, "lantern_build_info", None)
            if info is not None:
                _write_build_info(info)
                # pip shows a build's output only with -v: lantern.build_info() keeps the line (make install
                # prints it)
                print(f"lantern: building {info}", file=sys.stderr, flush=True)
        super().run()


packages = find_packages("python", include=["lantern", "lantern.*"])  # lantern.kernels: the Triton kernels

setup(
    packages=packages,
    package_dir={"lantern": "python/lantern"},
    # the tiny default models' weights ship inside the package (a non-editable install needs them too)
    package_data={"lantern": ["weights/tiny/*.safetensors", "weights/tiny/*.json", "weights/tiny_mar/*.safetensors",
                              "weights/tiny_mar/*.json"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
)
