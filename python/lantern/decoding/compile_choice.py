"""Whether a decoding run compiles its forwards: ``compile`` (True, False, "auto" or torch.compile's options)
resolved once per run on its device, with the reason (docs/compile.md, "What auto decides"), and the on-disk
cache inductor's graphs go to."""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple, Optional, Sequence, Union

import torch

CompileOption = Union[bool, str, dict]  # True, False, "auto" or torch.compile's options
AUTO = "auto"
COMPILE_CHOICES = {"auto": AUTO, "on": True, "off": False}  # the CLI's --compile -> compile


class CompileChoice(NamedTuple):
    """What ``compile`` resolved to on a device: torch.compile's options (None: eager), why, whether only
    AR's loop compiles (``ar_only``: the speculative loop's forwards stay eager), and whether lantern's own
    models run AOT-compiled packages (``aot``: aot.py, on a CPU) instead of torch.compile."""

    options: Optional[dict]
    reason: str
    ar_only: bool = False
    aot: bool = False

    @property
    def on(self) -> bool:
        """Whether AR's loop (``generate_ar``, and a speculative run that turns to AR) compiles."""
        return self.options is not None

    @property
    def ar_loop_apart(self) -> bool:
        """Whether ``generate_ar``'s compiled loop is faster than the speculative loop's AR steps, so that the
        calibration times it apart (``calibration.COMPILED_AR``) and a tree="auto" run is that loop when it beats
        the first step's plan: with AR's loop alone compiled (``ar_only``), or with AOT packages (AR's loop
        runs the same forward without the speculative loop's per-step verify, commit and host read)."""
        return self.on and (self.ar_only or self.aot)

    @property
    def speculative_on(self) -> bool:
        """Whether the speculative loop's forwards (target and drafter) compile."""
        return self.on and not self.ar_only


def check_compile(compile) -> None:
    """TypeError / ValueError naming ``compile`` unless it is True, False, "auto" or a dict of options."""
    if isinstance(compile, str):
        if compile != AUTO:
            raise ValueError(f"compile must be True, False, 'auto' or a dict of torch.compile options, got {compile!r}")
    elif not isinstance(compile, (bool, dict)) and compile is not None:
        raise TypeError(f"compile must be True, False, 'auto' or a dict of torch.compile options, got {compile!r}")


def resolve_compile(compile: CompileOption, device: torch.device, models: Sequence = ()) -> CompileChoice:
    """``compile`` on ``device`` for ``models`` (the run's target and drafter; None entries ignored): False ->
    eager; a dict -> torch.compile with those options; True or "auto" -> compiled where it works, with the
    reason:
    - on a CPU, lantern's own models (``aot.supports``) run AOT-compiled packages, compiled once per machine
      and loaded by every later process (``aot.py``); other models go through torch.compile (inductor), and
      with "auto" only AR's loop does (``AR_ONLY_ON_CPU``);
    - on a GPU, torch.compile with mode="reduce-overhead" (CUDA graphs).
    "auto" stays eager where torch.compile cannot work (``compile_unavailable``). Compiling also points
    inductor's on-disk caches at lantern's cache folder (unless the user chose another
    TORCHINDUCTOR_CACHE_DIR), so the next process loads a graph instead of compiling it."""
    check_compile(compile)
    device = torch.device(device)
    if compile is False or compile is None:
        return CompileChoice(None, "off (compile=False)")
    if isinstance(compile, dict):
        use_lantern_cache_for_inductor()
        return CompileChoice(dict(compile), "on (compile options given)")
    said = "auto" if compile == AUTO else "compile=True"
    if compile == AUTO:
        why_not = compile_unavailable(device)
        if why_not is not None:
            return CompileChoice(None, f"off (auto: {why_not})")
    use_lantern_cache_for_inductor()
    if device.type == "cuda":
        return CompileChoice({"mode": "reduce-overhead"}, f"on ({said})")
    if device.type == "cpu" and aot_possible(models):
        return CompileChoice({}, f"on ({said}: {AOT_ON_CPU})", aot=True)
    ar_only = compile == AUTO and device.type == "cpu" and _compile_setting() is not True
    if ar_only:
        return CompileChoice({}, f"on, AR's loop only (auto: {AR_ONLY_ON_CPU})", ar_only=True)
    return CompileChoice({}, f"on ({said})")


def aot_possible(models: Sequence) -> bool:
    """Whether every one of ``models`` (None entries ignored) has AOT-compiled forwards here (``aot.py``)."""
    from . import aot

    return aot.unavailable() is None and all(aot.supports(m) for m in models if m is not None)


# what "auto" and True run on a CPU for lantern's own models (docs/compile.md)
AOT_ON_CPU = "ahead-of-time compiled forwards, compiled once per machine and cached on disk"


def compile_options(compile: CompileOption, device: torch.device) -> Optional[dict]:
    """torch.compile's options for ``compile`` on ``device`` (None: eager); see ``resolve_compile``."""
    return resolve_compile(compile, device).options


# why "auto" compiles AR's loop alone on a CPU for models without AOT packages (docs/compile.md, "What auto decides")
AR_ONLY_ON_CPU = ("on a CPU a graph costs tens of seconds to trace and compile: AR's one graph pays for itself, a "
                  "speculative run's dozen do not; LANTERN_COMPILE=1 or compile=True compiles them too")


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Why compile="auto" stays eager on ``device``, or None. LANTERN_COMPILE=0 turns it off and =1 on for
    every forward wherever torch.compile can work (``cannot_compile``). Otherwise "auto" compiles
    (``resolve_compile``): on a GPU through CUDA graphs (they remove the launch overhead that dominates a
    decoding step); on a CPU lantern's own models through AOT packages, compiled once per machine (aot.py),
    and other models' AR loop only: there a torch.compile graph of a 16-layer model costs tens of seconds of
    dynamo tracing and compiling in every process, and a speculative run meets a dozen (node-count buckets,
    forward kinds), which a short run never earns back (docs/compile.md)."""
    setting = _compile_setting()
    if setting is False:
        return f"LANTERN_COMPILE={os.environ['LANTERN_COMPILE']}"
    return cannot_compile(device)


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
