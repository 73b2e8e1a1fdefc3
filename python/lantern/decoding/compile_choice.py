"""Whether a decoding run compiles its forwards: ``compile`` (True, False, "auto" or torch.compile's options)
resolved once per run on its device, with the reason (docs/compile.md, "What auto decides"), and the on-disk
cache inductor's graphs go to."""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple, Optional, Union

import torch

CompileOption = Union[bool, str, dict]  # True, False, "auto" or torch.compile's options
AUTO = "auto"
COMPILE_CHOICES = {"auto": AUTO, "on": True, "off": False}  # the CLI's --compile -> compile


class CompileChoice(NamedTuple):
    """What ``compile`` resolved to on a device: torch.compile's options (None: eager) and why."""

    options: Optional[dict]
    reason: str

    @property
    def on(self) -> bool:
        return self.options is not None


def check_compile(compile) -> None:
    """TypeError / ValueError naming ``compile`` unless it is True, False, "auto" or a dict of options."""
    if isinstance(compile, str):
        if compile != AUTO:
            raise ValueError(f"compile must be True, False, 'auto' or a dict of torch.compile options, got {compile!r}")
    elif not isinstance(compile, (bool, dict)) and compile is not None:
        raise TypeError(f"compile must be True, False, 'auto' or a dict of torch.compile options, got {compile!r}")


def resolve_compile(compile: CompileOption, device: torch.device) -> CompileChoice:
    """``compile`` on ``device``: False -> eager; True -> inductor (mode="reduce-overhead", CUDA graphs, on a
    GPU); a dict -> those options; "auto" -> True where torch.compile can work on the device, else eager, with
    the reason. Compiling also points inductor's on-disk caches at lantern's cache folder (unless the user chose
    another TORCHINDUCTOR_CACHE_DIR), so the next process loads a graph instead of compiling it."""
    check_compile(compile)
    device = torch.device(device)
    if compile is False or compile is None:
        return CompileChoice(None, "off (compile=False)")
    if compile == AUTO:
        why_not = compile_unavailable(device)
        if why_not is not None:
            return CompileChoice(None, f"off (auto: {why_not})")
        reason, compile = "on (auto)", True
    else:
        reason = "on (compile=True)" if compile is True else "on (compile options given)"
    use_lantern_cache_for_inductor()
    if compile is True:
        return CompileChoice({"mode": "reduce-overhead"} if device.type == "cuda" else {}, reason)
    return CompileChoice(dict(compile), reason)


def compile_options(compile: CompileOption, device: torch.device) -> Optional[dict]:
    """torch.compile's options for ``compile`` on ``device`` (None: eager); see ``resolve_compile``."""
    return resolve_compile(compile, device).options


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Why compile="auto" stays eager on ``device``, or None. LANTERN_COMPILE=0 turns it off and =1 on
    wherever torch.compile can work (``cannot_compile``). Otherwise "auto" compiles on a GPU (CUDA graphs
    remove the launch overhead that dominates a decoding step) and not on a CPU: there a graph of a 16-layer
    model costs tens of seconds of dynamo tracing and compiling per node-count bucket and row count, and
    inductor's on-disk cache saves only part of it (docs/compile.md), which a short run such as ``make demo``
    never earns back."""
    setting = _compile_setting()
    if setting is False:
        return f"LANTERN_COMPILE={os.environ['LANTERN_COMPILE']}"
    why_not = cannot_compile(device)
    if why_not is not None:
        return why_not
    if device.type == "cpu" and setting is not True:
        return "on a CPU each graph costs tens of seconds to trace and compile, more than a short run saves; " \
               "LANTERN_COMPILE=1 or compile=True for long runs"
    return None


def cannot_compile(device: torch.device) -> Optional[str]:
    """Why torch.compile cannot work on ``device`` here, or None: a Python dynamo does not support, no C++
    compiler (CPU), no Triton (GPU), a device inductor does not generate code for."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if device.type == "cpu":
        compiler = os.environ.get("CXX", "g++")
        return None if any(shutil.which(c) for c in (compiler, "g++", "c++", "clang++")) else \
            "no C++ compiler for inductor (set CXX)"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (inductor's GPU code generator)"
    return f"inductor does not generate code for {device.type} tensors"


def baseline_compile(device: torch.device) -> bool:
    """Whether the AR that printed speed-ups are held against is compiled on ``device``: the fastest AR lantern
    runs there, so compiled wherever torch.compile works (CPUs included, whatever "auto" decides for the
    run), unless LANTERN_COMPILE=0."""
    return _compile_setting() is not False and cannot_compile(torch.device(device)) is None


def _compile_setting() -> Optional[bool]:
    """LANTERN_COMPILE: False (0, false, off, no), True (1, true, on, yes) or None (unset or anything else)."""
    setting = os.environ.get("LANTERN_COMPILE", "").strip().lower()
    return False if setting in ("0", "false", "off", "no") else True if setting in ("1", "true", "on", "yes") else None


def use_lantern_cache_for_inductor() -> None:
    """TORCHINDUCTOR_CACHE_DIR = $LANTERN_CACHE/inductor unless the user chose another folder: the compiled
    graphs of one run are loaded, not compiled, by the next (inductor's FX graph cache is on by default)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default into the environment on first use (importing lantern can be that use)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        from ..neighbours import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
