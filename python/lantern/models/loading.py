"""Load official LlamaGen checkpoints (GPT and VQ) into our model classes, strictly.

Files: .pt/.pth/.bin via ``torch.load(weights_only=True)`` (no arbitrary pickles), .safetensors via
safetensors. Wrappers "model" / "module" / "state_dict" are unwrapped (repeatedly, at most 16 levels; a
wrapper that contains itself raises ValueError); a "module." or "_orig_mod." prefix on every key (DDP,
torch.compile) is stripped; ``freqs_cis`` and KV-cache buffers are dropped. Then every remaining key must
match the model's names and shapes exactly, or a ValueError lists the missing, unexpected and misshapen keys.
"""
from __future__ import annotations

import os
import pickle
import re
from typing import Dict, Mapping, Optional, Union

import torch

from .gpt import Transformer, build_gpt
from .vq import VQModel, build_vq

StateDict = Dict[str, torch.Tensor]

_WRAPPERS = ("model", "module", "state_dict")
_MAX_WRAPPERS = 16  # wrapper levels followed at most (real checkpoints have one or two)
_DROPPED = re.compile(r"(^|\.)(freqs_cis|causal_mask|kv_cache|k_cache|v_cache)(\.|$)")
_DECODER_PREFIXES = ("decoder.", "post_quant_conv.", "quantize.")


def read_state_dict(path_or_state_dict: Union[str, os.PathLike, Mapping]) -> StateDict:
    """A file path or an in-memory dict -> the bare state dict (unwrapped, prefixes stripped)."""
    if isinstance(path_or_state_dict, Mapping):
        obj = path_or_state_dict
    else:
        path = os.fspath(path_or_state_dict)
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            obj = load_file(path, device="cpu")
        else:
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                raise ValueError(f"{path}: torch.load(weights_only=True) refused this file (it holds objects "
                                 f"other than tensors and plain containers); re-save just the state dict. "
                                 f"Detail: {e}") from e
    obj = _unwrap(obj)
    if not isinstance(obj, Mapping):
        raise ValueError(f"checkpoint is not a state dict (got {type(obj).__name__})")
    state = dict(obj)
    non_tensors = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if non_tensors:
        raise ValueError(f"checkpoint entries are not tensors: {non_tensors[:10]}")
    check_storage(state)
    for prefix in ("module.", "_orig_mod."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return {k: v for k, v in state.items() if not _DROPPED.search(k)}


def _unwrap(obj):
    """Follow the "model" / "module" / "state_dict" wrappers, at most _MAX_WRAPPERS deep. A wrapper that
    contains itself (a cycle, possible in a pickle) or a deeper chain raises ValueError instead of looping."""
    seen = set()
    while isinstance(obj, Mapping):
        wrapper = next((w for w in _WRAPPERS if isinstance(obj.get(w), Mapping)), None)
        if wrapper is None:
            return obj
        if id(obj) in seen:
            raise ValueError(f"checkpoint wrappers form a cycle (a {wrapper!r} entry contains itself); "
                             f"not a state dict")
        if len(seen) >= _MAX_WRAPPERS:
            raise ValueError(f"checkpoint wrappers nest more than {_MAX_WRAPPERS} deep "
                             f"({'/'.join(_WRAPPERS)}); not a state dict")
        seen.add(id(obj))
        obj = obj[wrapper]
    return obj


def check_storage(state: StateDict) -> None:
    """Every tensor's elements must lie in bytes the file holds: a pickle can declare a tensor of any shape
    over a one-element storage (stride 0), and converting it would allocate all of that shape. ValueError
    naming the tensor."""
    for name, t in state.items():
        if t.numel() * t.element_size() > t.untyped_storage().nbytes():
            raise ValueError(f"checkpoint tensor {name!r} of shape {list(t.shape)} has "
                             f"{t.untyped_storage().nbytes()} bytes of data for {t.numel()} {t.dtype} elements "
                             f"(repeated or overlapping elements); not a saved weight")


def check_finite(state: StateDict, what: str = "checkpoint") -> None:
    """Every floating-point tensor must be finite (no NaN, no inf): a model with such weights samples NaN
    without any other error. ValueError naming the first such tensor. Meta tensors hold no values."""
    for name, t in state.items():
        if not t.is_floating_point() or t.numel() == 0 or t.is_meta:
            continue
        lo, hi = torch.aminmax(t.detach().reshape(-1))  # NaN propagates into both
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            kind = "NaN" if bool(torch.isnan(t).any()) else "inf"
            raise ValueError(f"{what} tensor {name!r} holds {kind} values (as {t.dtype}); a model with "
                             f"non-finite weights samples NaN. The file is damaged or not a trained model")


def check_state_dict(model: torch.nn.Module, state: StateDict, what: str = "model") -> None:
    """Raise ValueError listing missing, unexpected and misshapen keys of ``state`` against ``model``."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    misshapen = sorted((k, expected[k], tuple(state[k].shape)) for k in expected
                       if k in state and tuple(state[k].shape) != expected[k])
    if missing or unexpected or misshapen:
        lines = [f"checkpoint does not match {what}:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {unexpected}")
        if misshapen:
            lines.append(f"  misshapen keys ({len(misshapen)}): " +
                         ", ".join(f"{k} (expected {list(e)}, got {list(g)})" for k, e, g in misshapen))
        raise ValueError("\n".join(lines))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16; read from
    /proc/cpuinfo, so False off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def decode_dtype(device) -> torch.dtype:
    """The dtype a GPT decodes in by default on ``device``: bfloat16 on a GPU (LlamaGen's setting); on a CPU
    bfloat16 where it has native bf16 dot products (oneDNN's bf16 matrix products then run at 2-3x float32's
    rate from a few dozen rows on: docs/tiny_model.md), else float32 (bf16 would be emulated, slower)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _load_into(model: torch.nn.Module, state: StateDict, device, dtype: Optional[torch.dtype]):
    """model was built on the meta device; state's keys and shapes are checked already. Tensors are moved to
    device/dtype (floating tensors only), must then be finite (``check_finite``), and are assigned."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    converted = {k: convert(v) for k, v in state.items()}
    check_finite(converted)  # after the conversion: a finite float32 weight can overflow a narrower dtype
    model.load_state_dict(converted, strict=True, assign=True)
    return model


def load_gpt(path_or_state_dict, name: str, model_type: str = "c2i", *, device="cpu",
             dtype: Optional[torch.dtype] = None, **build_kwargs) -> Transformer:
    """Build GPT ``name`` (build_gpt's arguments, e.g. block_size=576 for 384 px) and load the checkpoint
    strictly. dtype None keeps the checkpoint's dtype. Returns the model in eval mode."""
    state = read_state_dict(path_or_state_dict)
    with torch.device("meta"):
        model = build_gpt(name, model_type, **build_kwargs)
    check_state_dict(model, state, f"{name} ({model_type})")
    _load_into(model, state, device, dtype)
    model.reset_rope(device)
    return model.eval()


def load_vq(path_or_state_dict, name: str = "VQ-16", decoder_only: bool = False, *, device="cpu",
            **build_kwargs) -> VQModel:
    """Build VQ ``name`` and load the checkpoint strictly (float32). decoder_only: keep only the decoder,
    post_quant_conv and quantize keys (the encoder keys in the file are ignored). Eval mode."""
    state = read_state_dict(path_or_state_dict)
    if decoder_only:
        state = {k: v for k, v in state.items() if k.startswith(_DECODER_PREFIXES)}
    with torch.device("meta"):
        model = build_vq(name, decoder_only=decoder_only, **build_kwargs)
    check_state_dict(model, state, f"{name}{' decoder' if decoder_only else ''}")
    _load_into(model, state, device, torch.float32)
    return model.eval()
