"""The options of `lantern sample`, checked before anything is loaded or written (docs/sampling.md "Options").

``check_api_value`` gives ``lantern.sample(**options)`` the type checks that argparse gives the command line
(the same parser's actions: int, float, str, flags, choices, lists); ``check_sample_options`` then checks the
values for both alike: every number within its bounds, every option applicable to the model and method, the
files named there present, the device and the fused backend usable."""
from __future__ import annotations

import argparse
import math
import numbers
import os
from typing import NamedTuple

MAX_IMAGES = 10**8  # image ids are 32-bit counters of the Philox stream; PNG names have room for them
MAX_BATCH = 65536
MAX_CLASSES = 10**6
MIN_TEMPERATURE = 1e-3  # a positive temperature: below it, use 0 (greedy)
MAX_THREADS = 1024


class Bound(NamedTuple):
    least: float
    largest: float
    least_open: bool = False  # the least value itself is refused
    largest_open: bool = False

    def holds(self, x) -> bool:
        above = x > self.least if self.least_open else x >= self.least
        below = x < self.largest if self.largest_open else x <= self.largest
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.least_open else '['}{self.least}, {self.largest}{')' if self.largest_open else ']'}"


# every numeric option of lantern sample: dest -> its bounds (floats must also be finite)
BOUNDS = {
    "num_images": Bound(1, MAX_IMAGES), "batch": Bound(1, MAX_BATCH), "threads": Bound(1, MAX_THREADS),
    "seed": Bound(0, 2**64 - 1),
    "cfg_scale": Bound(0.0, 1000.0), "cfg_interval": Bound(-1, 2**31 - 1), "temperature": Bound(0.0, 100.0),
    "top_k": Bound(0, 2**31 - 1), "top_p": Bound(0.0, 1.0, least_open=True),
    "depth": Bound(1, 1024), "nodes": Bound(1, 65536), "k": Bound(0, 2**20), "delta": Bound(0.0, 1.0),
    "lam": Bound(1.0, 1e6), "window": Bound(1, 1024),
    "num_iter": Bound(1, 4096), "gamma": Bound(1, 4096), "bandwidth": Bound(0.0, 1e6, least_open=True),
    "prefill": Bound(0.0, 1.0, largest_open=True), "max_tries": Bound(1, 2**31 - 2),
}
CHECKPOINT_FLAGS = {"gpt": "--gpt", "vq": "--vq", "mar": "--mar", "vae": "--vae", "mar_drafter": "--mar-drafter"}
MAR_MODELS = ("tiny-mar", "mar-checkpoint")


def flag(dest: str) -> str:
    return "DIR" if dest == "out" else "--" + dest.replace("_", "-")


# ---------------------------------------------------------------------------------------------- types (API)


def check_api_value(dest: str, action: argparse.Action, value):
    """``value`` for option ``dest`` of ``lantern.sample`` converted as argparse would convert the command line's
    text -> the value. TypeError naming the option for a value of the wrong type; ValueError for a value outside
    the option's choices."""
    if value is None:
        if action.default is None and not action.required and action.nargs != 0:
            return None
        raise TypeError(f"sample(): {dest} cannot be None")
    if dest == "compile" and isinstance(value, bool):  # compile=True / False as lantern.generate takes it
        return "on" if value else "off"
    if action.nargs == 0:  # a flag (store_true)
        if not isinstance(value, bool):
            raise TypeError(f"sample(): {dest} must be True or False, got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"sample(): {dest} must be a list, got {type(value).__name__} {value!r}")
        return [_item(dest, action, item) for item in value]
    return _item(dest, action, value)


def _item(dest: str, action: argparse.Action, value):
    kind = action.type
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"sample(): {dest} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"sample(): {dest} must be a number, got {type(value).__name__} {value!r}")
        value = float(value)
    else:  # text: names and paths
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise TypeError(f"sample(): {dest} must be a str, got {type(value).__name__} {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"sample(): {dest} must be one of {list(action.choices)}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- values (CLI and API)


def check_numbers(args) -> None:
    """Every numeric option within BOUNDS (floats finite); SystemExit naming the option."""
    for dest, bound in BOUNDS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"{flag(dest)} must be a finite number in {bound}, got {value}")
        if not bound.holds(value):
            raise SystemExit(f"{flag(dest)} must be in {bound}, got {value}")
    if args.temperature is not None and 0 < args.temperature < MIN_TEMPERATURE:
        raise SystemExit(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {args.temperature}")
    if args.classes is not None:
        if not 1 <= len(args.classes) <= MAX_CLASSES:
            raise SystemExit(f"--classes must hold between 1 and {MAX_CLASSES} class ids, got {len(args.classes)}")
        negative = [c for c in args.classes if c < 0]
        if negative:
            raise SystemExit(f"--classes must be class ids >= 0, got {negative[:10]}")


def check_out(out) -> None:
    if not str(out).strip():
        raise SystemExit(f"DIR must name the output folder, got {str(out)!r}")


def check_model_files(args) -> None:
    """The checkpoint files the model options name exist (before the folder is made or anything is read)."""
    if args.model == "checkpoint" and (not args.gpt or not args.vq):
        raise SystemExit("--model checkpoint needs --gpt PATH and --vq PATH")
    if args.model == "mar-checkpoint" and (not args.mar or not args.vae):
        raise SystemExit("--model mar-checkpoint needs --mar PATH (checkpoint-last.pth: its model_ema is used) "
                         "and --vae PATH (kl16.ckpt)")
    if args.model == "mar-checkpoint" and args.method == "cspd" and not args.mar_drafter:
        raise SystemExit("--method cspd with --model mar-checkpoint needs --mar-drafter PATH (a smaller MAR, e.g. "
                         "MAR-B for MAR-H) and --mar-drafter-name")
    for dest, option in CHECKPOINT_FLAGS.items():
        path = getattr(args, dest, None)
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"{option} {path!r} is not a file")


def check_model_names(args) -> None:
    """--gpt-name / --mar-name / --mar-drafter-name name known configs."""
    from .models.gpt import GPT_CONFIGS
    from .models.mar import MAR_CONFIGS

    for dest, known in (("gpt_name", GPT_CONFIGS), ("mar_name", MAR_CONFIGS), ("mar_drafter_name", MAR_CONFIGS)):
        name = getattr(args, dest, None)
        if name is not None and name not in known:
            raise SystemExit(f"{flag(dest)} must be one of {sorted(known)}, got {name!r}")


def check_mar_options(args) -> None:
    """MAR models: the options MAR takes (generate_mar_cli's checks), a positive temperature, the CSpD settings
    and --num-sampling-steps, a respacing of the 1000 training steps ("100", or sections "50,25")."""
    if args.model not in MAR_MODELS:
        return
    from .generate_mar_cli import _check_options, _cspd_config

    _check_options(args)
    if args.method == "cspd":
        _cspd_config(args)
    if args.temperature is not None and args.temperature <= 0:
        raise SystemExit(f"--temperature must be > 0 for MAR models (the diffusion head's noise scale), got "
                         f"{args.temperature}")
    if args.num_sampling_steps is not None:
        from .models.diffusion import TRAIN_STEPS, space_timesteps

        try:
            if not args.num_sampling_steps.strip():
                raise ValueError("empty")
            space_timesteps(TRAIN_STEPS, args.num_sampling_steps)
        except ValueError as e:
            raise SystemExit(f"--num-sampling-steps must be a number of diffusion steps in [1, {TRAIN_STEPS}] (or "
                             f"sections, e.g. 50,25), got {args.num_sampling_steps!r} ({e})") from e


def check_device(args) -> None:
    """--device names a device this machine has; --fused a backend it can run on that device."""
    import torch

    from ._backend import BACKENDS, _why_unavailable, wrong_device

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"--device {args.device!r} is not a device ({e})") from e
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise SystemExit(f"--device {args.device}: no such CUDA device here")
    if args.fused is not None:
        if args.fused not in BACKENDS:
            raise SystemExit(f"--fused must be one of {list(BACKENDS)}, got {args.fused!r}")
        why = None if args.fused == "auto" else _why_unavailable(args.fused)
        if why is not None:
            raise SystemExit(f"--fused {args.fused} is unavailable: {why}")
        wrong = wrong_device(args.fused, device)
        if wrong is not None:
            raise SystemExit(f"--fused {args.fused} runs on {wrong} tensors, not on --device {args.device}")


def check_sample_options(args, default_batch: int) -> None:
    """Every option of lantern sample, before any model is loaded or file written (module docstring). Fills in
    the defaults that do not need the model (batch; generate_cli's model and method defaults). SystemExit naming
    the option."""
    from .generate_cli import check_method_options

    check_out(args.out)
    if args.num_images is None:
        raise SystemExit("--num-images is needed")
    if args.batch is None:
        args.batch = default_batch
    check_numbers(args)
    if args.method == "cspd" and args.model not in MAR_MODELS:
        raise SystemExit("--method cspd (continuous speculative decoding) is for MAR models: --model tiny-mar or "
                         "mar-checkpoint")
    check_method_options(args)
    check_numbers(args)  # again: the defaults it filled in
    if args.model in ("tiny", "checkpoint") and args.method != "ar" and args.tree == "auto":
        raise SystemExit("lantern sample needs a fixed draft tree (--tree chain, static or dynamic): --tree auto "
                         "picks each step's tree from timings, so the images would depend on the machine and the "
                         "batch (docs/sampling.md)")
    check_mar_options(args)
    check_model_names(args)
    check_model_files(args)
    check_device(args)
