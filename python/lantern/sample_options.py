"""The options of a run, checked before anything is loaded or written (docs/sampling.md "Options").

``check_method_options`` serves ``lantern generate`` and ``lantern sample``: the model and method options,
through ``decoding.options`` (the library's one place for which option applies where, and for the bounds of the
settings). ``check_sample_options`` checks a ``lantern.sample`` job (``sample_settings.SampleSettings``, built
from the command line or from the API's keywords): every number within its bounds, every option applicable to
the model and method, the files named there present, the device and the fused backend usable. A refusal is a
SystemExit naming the option as the command line spells it (``decoding.options.cli_message``)."""
from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple

import torch

from . import sources
from .decoding import SpecConfig
from .sources import MAR_MODELS, is_mar, relaxed

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
# the options whose applicability depends on the model family, method and tree (decoding/options.py names
# them alike, but for --nodes: n_nodes)
METHOD_OPTIONS = ("tree", "draft", "depth", "nodes", "k", "delta", "lam", "budget", "window", "coupling", "init",
                  "compile", "dtype", "top_k", "top_p", "cfg_interval", "no_ar_baseline", "gamma", "rule", "bandwidth",
                  "sigma_ratio", "prefill", "max_tries", "mar_drafter", "mar_drafter_name")


def flag(dest: str) -> str:
    return "DIR" if dest == "out" else "--" + dest.replace("_", "-")


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
    """MAR models: the options MAR takes (``sources.check_mar_method``), a positive temperature, the CSpD
    settings and --num-sampling-steps, a respacing of the 1000 training steps ("100", or sections "50,25")."""
    if args.model not in MAR_MODELS:
        return
    sources.check_mar_method(args)
    if args.method == "cspd":
        sources.cspd_config(args)
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


def check_sample_options(args) -> None:
    """Every option of lantern sample (a SampleSettings), before any model is loaded or file written (module
    docstring). Fills in the defaults that do not need the model (batch; the model and method defaults).
    SystemExit naming the option."""
    from .sample_settings import DEFAULT_BATCH, default_of

    check_out(args.out)
    if args.num_images is None:
        raise SystemExit("--num-images is needed")
    if args.batch is None:
        args.batch = DEFAULT_BATCH
    check_numbers(args)
    from .sample_hf import check_hf_options  # (sample_hf imports nothing of this module)

    if check_hf_options(args, default_of):  # a transformers model directory: its own rules
        check_hf_method(args, default_of)
        check_numbers(args)  # again: the defaults it filled in
        check_device(args)
        return
    if args.method == "cspd" and args.model not in MAR_MODELS:
        raise SystemExit("--method cspd (continuous speculative decoding) is for MAR models: --model tiny-mar or "
                         "mar-checkpoint")
    check_method_options(args, default_of)
    check_numbers(args)  # again: the defaults it filled in
    if args.model in ("tiny", "checkpoint") and args.method != "ar" and args.tree == "auto":
        raise SystemExit("lantern sample needs a fixed draft tree (--tree chain, static or dynamic): --tree auto "
                         "picks each step's tree from timings, so the images would depend on the machine and the "
                         "batch (docs/sampling.md)")
    check_mar_options(args)
    check_model_names(args)
    check_model_files(args)
    check_device(args)


# ---------------------------------------------------------------------------------------------- model and method


def given_options(args, default: Callable[[str], object]) -> dict:
    """The method options set to something other than their defaults (``default(name)``; options.py's names)."""
    return {"n_nodes" if dest == "nodes" else dest: getattr(args, dest) for dest in METHOD_OPTIONS
            if hasattr(args, dest) and getattr(args, dest) != default(dest)}


def check_method_options(args, default: Callable[[str], object]) -> None:
    """The model and method options of ``generate`` and ``sample`` (``args``: the parsed options, or the
    SampleSettings; ``default(name)``: an option's default, against which "given" is told): each given option
    applies to the chosen model, method and tree (``decoding/options.py``), every number is in its bounds
    (SystemExit naming the option otherwise); fills in the model defaults and --delta."""
    from .decoding.options import OptionError, check_applicable, cli_message

    for dest, models in sources.MODEL_OPTIONS.items():
        if getattr(args, dest, None) is not None and args.model not in models:
            flag = "--" + dest.replace("_", "-")
            raise SystemExit(f"{flag} does not apply to --model {args.model} (it is for --model "
                             f"{' / '.join(models)})")
    for dest, value in sources.MODEL_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    for flag, value in (("--depth", args.depth), ("--nodes", args.nodes), ("--window", args.window)):
        if value < 1:
            raise SystemExit(f"{flag} must be >= 1, got {value}" +
                             (" (for no drafts use --method ar)" if flag == "--nodes" else ""))
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {args.batch}")
    if args.draft == "sampled" and args.tree == "dynamic":
        raise SystemExit("--draft sampled does not apply to --tree dynamic (EAGLE-2 drafts are each node's top "
                         "tokens); use --tree chain or static for sampled drafts")
    try:
        check_method_numbers(args)
        family = "mar" if is_mar(args) else "gpt"
        check_applicable(family, args.method, given_options(args, default), tree=args.tree, relaxed=relaxed(args),
                         cli=True)
    except OptionError as e:
        raise SystemExit(cli_message(e)) from e
    if not is_mar(args):
        check_jacobi_options(args)


def check_method_numbers(args) -> None:
    """The numeric options' bounds, before any model is loaded (those that depend on the model, --classes,
    --num-iter's upper bound and --k's, are checked once it is): OptionError."""
    from .decoding import options as o
    from .models.mar import NUM_SAMPLING_STEPS_RULE, num_sampling_steps_valid

    o.check_tree_sizes(args.depth, args.nodes, args.window, (1,))
    o.check_int("k", args.k, 0, None, " (latent neighbours merged at most)")
    if args.delta is not None or args.lam is not None:
        o.check_relaxation(0.0 if args.delta is None else args.delta, args.lam)
    if is_mar(args):
        o.check_mar_settings(1.0 if args.cfg_scale is None else args.cfg_scale, args.temperature, args.seed,
                             args.num_iter)
        if args.num_sampling_steps is not None and not num_sampling_steps_valid(args.num_sampling_steps):
            raise o.OptionError("num_sampling_steps", f"{NUM_SAMPLING_STEPS_RULE}, got {args.num_sampling_steps!r}")
        return
    try:
        o.check_gpt_sampling(1.0 if args.cfg_scale is None else args.cfg_scale, args.temperature,
                             0 if args.top_k is None else args.top_k, args.top_p, args.seed, args.cfg_interval, 1,
                             torch.device("cpu"))
    except o.OptionError:
        raise
    except ValueError as e:  # the ops' checks: "name must ..."
        name, problem = str(e).split(" ", 1)
        raise o.OptionError(name, problem) from e


def check_jacobi_options(args) -> None:
    """--method sjd verifies its window as a chain (its other options: ``check_method_options``; SpecConfig
    refuses the same, but only once the models are loaded). Fills in --delta: SpecConfig's for lantern, 0
    (exact) for sjd."""
    if args.method == "sjd":
        if args.tree not in ("auto", "chain"):
            raise SystemExit(f"--method sjd verifies its window as a chain: --tree must be auto or chain, got "
                             f"{args.tree}")
    if args.delta is None:
        args.delta = 0.0 if args.method == "sjd" else SpecConfig.delta


def check_hf_method(args, default: Callable[[str], object]) -> None:
    """An --hf run's method and its options (``generate --hf``'s: Jacobi drafts from the model itself, verified
    as a chain; ``sample_hf``); fills in --delta."""
    from .decoding.options import OptionError, check_applicable, cli_message

    if args.method == "cspd":
        raise SystemExit("--method cspd is for MAR models; --hf takes ar, sjd, spec or lantern")
    if args.method != "ar" and args.tree != "chain":
        raise SystemExit(f"--hf drafts from the model itself (Jacobi windows), verified as a chain: --tree must be "
                         f"chain, got {args.tree}")
    given = given_options(args, default)
    for dest, name in (("draft", "draft"), ("depth", "depth"), ("nodes", "n_nodes")):
        if name in given:
            raise SystemExit(f"{flag(dest)} does not apply to --hf: there is no drafter, the drafts are the "
                             f"model's own (their number is --window)")
    try:
        check_method_numbers(args)
        check_applicable("gpt", "ar" if args.method == "ar" else "sjd", given, tree=args.tree,
                         relaxed=sources.relaxed(args), cli=True)
    except OptionError as e:
        raise SystemExit(cli_message(e)) from e
    if args.delta is None:
        args.delta = SpecConfig.delta if args.method == "lantern" else 0.0
