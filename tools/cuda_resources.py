"""Per-kernel resource figures from two sources, and where the CUDA tools are.

- ptxas's ``-v`` report (kept by the build in build/ptxas/<file>.log, see tools/nvcc_ptxas_log.py): stack
  frame and *spill* bytes of every function, per architecture. Only this report separates spills from a
  local array that lives on the stack.
- ``cuobjdump --list-elf`` / ``--dump-resource-usage`` on the built extension: which architectures each
  source file has SASS for, and every kernel's registers / stack per architecture, read from the binary itself.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS_LOG_DIR = os.path.join(ROOT, "build", "ptxas")
REQUIRED_ARCHS = ("sm_80", "sm_90")


@dataclass(frozen=True)
class PtxasFunction:
    name: str  # mangled
    arch: Optional[str]  # None when the report gave no architecture for its section (a parse failure)
    entry: bool  # a __global__ kernel (ptxas: "Compiling entry function")
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


_GMEM = re.compile(r"ptxas info\s*: \d+ bytes gmem")
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> List[PtxasFunction]:
    """Every function's stack / spill figures in a ``-Xptxas -v`` report. ptxas runs once per architecture;
    each run opens with "N bytes gmem", names its architecture on each entry function, and lists the
    properties of entry and non-entry functions alike; a run's functions get the architecture its entries name."""
    sections: List[List[str]] = [[]]
    for line in text.splitlines():
        if _GMEM.search(line):
            sections.append([])
        sections[-1].append(line)
    functions: List[PtxasFunction] = []
    for lines in sections:
        entries = {m.group(1): m.group(2) for m in map(_ENTRY.search, lines) if m}
        archs = set(entries.values())
        arch = archs.pop() if len(archs) == 1 else None
        pending: Optional[str] = None
        for line in lines:
            props = _PROPS.search(line)
            if props:
                pending = props.group(1)
                continue
            frame = _FRAME.search(line)
            if frame and pending is not None:
                stack, stores, loads = (int(g) for g in frame.groups())
                functions.append(PtxasFunction(pending, arch, pending in entries, stack, stores, loads))
                pending = None
    return functions


def read_ptxas_log(path: str) -> Tuple[Dict[str, str], List[PtxasFunction]]:
    """A log written by tools/nvcc_ptxas_log.py: its '# key: value' header and the parsed report."""
    with open(path) as f:
        text = f.read()
    header = dict(m.groups() for m in re.finditer(r"^# (\w+): (.*)$", text, flags=re.M))
    return header, parse_ptxas(text)


@dataclass(frozen=True)
class BinaryKernel:
    source: str  # the .cu the cubin came from (cuobjdump's "identifier")
    arch: str
    name: str  # mangled
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int


def parse_resource_usage(text: str) -> List[BinaryKernel]:
    """``cuobjdump --dump-resource-usage``: one "Fatbin elf code" block per cubin (arch, identifier), then
    "Function NAME:" and "REG:n STACK:n SHARED:n LOCAL:n ..." per kernel."""
    kernels: List[BinaryKernel] = []
    arch = source = name = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Fatbin "):
            arch = source = name = None
        elif line.startswith("arch = "):
            arch = line.split("=", 1)[1].strip()
        elif line.startswith("identifier = "):
            source = line.split("=", 1)[1].strip()
        elif line.startswith("Function ") and line.endswith(":"):
            name = line[len("Function "):-1]
        elif line.startswith("REG:") and name is not None:
            fields = dict(f.split(":", 1) for f in line.split() if ":" in f)
            kernels.append(BinaryKernel(source or "?", arch or "?", name, int(fields["REG"]),
                                        int(fields["STACK"]), int(fields.get("LOCAL", 0)),
                                        int(fields.get("SHARED", 0))))
            name = None
    return kernels


_ELF = re.compile(r"ELF file\s+\d+:\s+(\S+?)(?:\.\d+)?\.(sm_\w+)\.cubin")


def parse_list_elf(text: str) -> Set[Tuple[str, str]]:
    """``cuobjdump --list-elf``: {(object stem, arch)} of the SASS cubins: "compact_kv.sm_80.cubin" (in a
    linked library) and "compact_kv.1.sm_80.cubin" (in an object file) both give ("compact_kv", "sm_80")."""
    return {m.groups() for m in map(_ELF.search, text.splitlines()) if m}


def cuda_sources(root: str = ROOT) -> List[str]:
    """Every csrc/cuda/*.cu (what setup.py compiles), sorted."""
    return sorted(glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))


def cuda_home() -> str:
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def find_tool(name: str) -> Optional[str]:
    """A CUDA tool: $CUDA_HOME/bin, then PATH, then (cuobjdump only) the copy triton ships."""
    candidates = [os.path.join(cuda_home(), "bin", name), shutil.which(name)]
    if name in ("cuobjdump", "nvdisasm"):
        try:
            import triton.backends.nvidia as triton_nvidia

            candidates.append(os.path.join(os.path.dirname(triton_nvidia.__file__), "bin", name))
        except ImportError:
            pass
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
