"""Load official MAR checkpoints (``checkpoint-last.pth``: its ``model_ema`` entry) and KL-16 VAE files
(``kl16.ckpt``: its ``model`` entry) strictly, with ``torch.load(weights_only=True)`` only.

MAR's head sizes (diffloss_d, diffloss_w) are not stored in a checkpoint except as tensor shapes: they are
taken from the arguments when given, else read off ``diffloss.net.input_proj.weight`` and the number of
``diffloss.net.res_blocks.*``, else the config's values.
"""
from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from typing import Optional, Union

import torch

from .loading import StateDict, _load_into, check_state_dict, read_state_dict
from .mar import MAR, build_mar
from .vae import AutoencoderKL, build_vae

PathOrState = Union[str, os.PathLike, Mapping]

RESAVE_HINT = (
    "lantern loads checkpoints with torch.load(weights_only=True) and never unpickles other objects. The "
    "official MAR training script also stores its arguments (an argparse.Namespace under 'args'), which "
    "weights_only refuses. Re-save the weights alone once, in a Python session you trust:\n"
    "    import torch\n"
    "    ckpt = torch.load(PATH, map_location='cpu', weights_only=False)\n"
    "    torch.save({'model_ema': ckpt['model_ema']}, 'mar-ema.pth')   # MAR ('model' for kl16.ckpt)\n"
    "or as safetensors: safetensors.torch.save_file(ckpt['model_ema'], 'mar-ema.safetensors')")


def _read_file(path: str):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: torch.load(weights_only=True) refused this file: it holds pickled objects "
                         f"other than tensors and plain containers.\n{RESAVE_HINT}\nDetail: {e}") from e


def read_checkpoint(path_or_state_dict: PathOrState, prefer: str = "model_ema") -> StateDict:
    """A file or an in-memory dict -> the bare state dict: the ``prefer`` entry when the top level has it
    (MAR files hold both 'model' and 'model_ema'; sampling uses the EMA), else the usual unwrapping."""
    obj = path_or_state_dict
    if not isinstance(obj, Mapping):
        obj = _read_file(os.fspath(obj))
    if isinstance(obj, Mapping) and isinstance(obj.get(prefer), Mapping):
        obj = obj[prefer]
    return read_state_dict(obj)


_RES_BLOCK = re.compile(r"^diffloss\.net\.res_blocks\.(\d+)\.")
# the head sizes a file may imply at most (the released heads: 12 blocks, 1536 wide), so that the model built
# to check a file against stays small whatever the file says
MAX_DIFFLOSS_D = 64
MAX_DIFFLOSS_W = 8192


def infer_head_sizes(state: StateDict) -> dict:
    """{diffloss_w, diffloss_d} read off the head's tensors (empty when the state has no head), before any
    model is built: the res_blocks must be numbered 0 .. d-1, and d and w are bounded (MAX_DIFFLOSS_D,
    MAX_DIFFLOSS_W); ValueError naming the offending key otherwise."""
    sizes = {}
    w = state.get("diffloss.net.input_proj.weight")
    if w is not None:
        if w.dim() != 2 or not 1 <= w.shape[0] <= MAX_DIFFLOSS_W:
            raise ValueError(f"checkpoint key 'diffloss.net.input_proj.weight' has shape {list(w.shape)}: the head "
                             f"width must be in [1, {MAX_DIFFLOSS_W}]")
        sizes["diffloss_w"] = int(w.shape[0])
    blocks = {}
    for key in state:
        m = _RES_BLOCK.match(key)
        if m:
            blocks.setdefault(int(m.group(1)), key)
    if blocks:
        d = len(blocks)
        stray = sorted(i for i in blocks if i >= d)  # a gap below: a block numbered past the count
        if stray or d > MAX_DIFFLOSS_D:
            what = (f"unexpected key {blocks[stray[0]]!r}: the head's res_blocks must be numbered 0 .. d-1"
                    if stray else f"the head has {d} res_blocks")
            raise ValueError(f"checkpoint does not match a MAR head: {what} (d at most {MAX_DIFFLOSS_D})")
        sizes["diffloss_d"] = d
    return sizes


def check_head_sizes(diffloss_d, diffloss_w) -> None:
    for name, value, top in (("diffloss_d", diffloss_d, MAX_DIFFLOSS_D), ("diffloss_w", diffloss_w, MAX_DIFFLOSS_W)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top):
            raise ValueError(f"{name} must be an int in [1, {top}], got {value!r}")


def load_mar(path_or_state_dict: PathOrState, name: str, *, device="cpu", dtype: Optional[torch.dtype] = None,
             diffloss_d: Optional[int] = None, diffloss_w: Optional[int] = None, **overrides) -> MAR:
    """Build MAR ``name`` ("MAR-B" | "MAR-L" | "MAR-H" | "MAR-tiny" | "MAR-tiny-drafter"; overrides replace
    MARConfig fields) and load the checkpoint strictly. diffloss_d / diffloss_w: the head's depth and width,
    inferred from the weights when not given. dtype None keeps the checkpoint's. Eval mode."""
    check_head_sizes(diffloss_d, diffloss_w)
    state = read_checkpoint(path_or_state_dict)
    head = infer_head_sizes(state)
    if diffloss_d is not None:
        head["diffloss_d"] = diffloss_d
    if diffloss_w is not None:
        head["diffloss_w"] = diffloss_w
    with torch.device("meta"):
        model = build_mar(name, **{**head, **overrides})
    check_state_dict(model, state, f"{name} (diffloss_d={model.config.diffloss_d}, "
                                   f"diffloss_w={model.config.diffloss_w})")
    _load_into(model, state, device, dtype)
    return model.eval()


def load_vae(path_or_state_dict: PathOrState, name: str = "KL-16", *, device="cpu", **overrides) -> AutoencoderKL:
    """Build VAE ``name`` ("KL-16" | "KL-tiny"; overrides replace VAEConfig fields, e.g. scale) and load the
    checkpoint strictly, in float32. Eval mode."""
    state = read_checkpoint(path_or_state_dict, prefer="model")
    with torch.device("meta"):
        model = build_vae(name, **overrides)
    check_state_dict(model, state, name)
    _load_into(model, state, device, torch.float32)
    return model.eval()
