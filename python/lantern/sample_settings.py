"""The settings of a ``lantern.sample`` job: one dataclass, field by field the options of ``lantern sample``
(the command line builds it from its parsed options; ``lantern.sample(out, n, **options)`` from its keywords).

Defaults and choices are read from the library (``SpecConfig``, ``CSpDConfig``, the methods, trees and
rules the decoding loops take), never typed again. ``from_options`` gives the keywords of the Python API the
type checks that argparse gives the command line's text; ``sample_options.check_sample_options`` then checks
the values for both alike.
"""
from __future__ import annotations

import numbers
import os
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import List, Optional

import torch

from .decoding import SpecConfig
from .decoding.compiled import COMPILE_CHOICES
from .decoding.config import DRAFTS, TREES
from .decoding.jacobi import FRESH_INITS
from .decoding.options import GPT_METHODS, MAR_METHODS
from .ops.reference.continuous_verify import RULES, SIGMA_RATIOS
from .ops.verify_op import BUDGETS

# the choices of the settings (and of the command line's flags)
MODELS = ("tiny", "checkpoint", "tiny-mar", "mar-checkpoint")
METHODS = GPT_METHODS + tuple(m for m in MAR_METHODS if m not in GPT_METHODS)
DRAFT_KINDS = tuple(d for d in DRAFTS if d is not None)
IMAGE_SIZES = (256, 384, 512)
VAE_NAMES = ("KL-16", "KL-tiny")
CFG_SCHEDULES = ("linear", "constant")
DTYPES = ("auto", "float32", "bfloat16", "float64")
DEFAULT_BATCH = 16
DEFAULT_THREADS = 1  # what torchrun gives each process: one process and N processes compute alike by default


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _choice(default, choices):
    return field(default=default, metadata={"choices": tuple(choices)})


@dataclass
class SampleSettings:
    """Every option of ``lantern sample`` by its Python name (docs/sampling.md "Options"). None: not given
    (the model's recommendation, or the method's default, is filled in when the job is checked)."""
    out: str
    num_images: int
    resume: bool = False
    # the model
    model: str = _choice("tiny", MODELS)
    gpt: Optional[str] = None
    gpt_name: Optional[str] = None
    vq: Optional[str] = None
    image_size: Optional[int] = _choice(None, IMAGE_SIZES)
    mar: Optional[str] = None
    mar_name: Optional[str] = None
    vae: Optional[str] = None
    vae_name: Optional[str] = _choice(None, VAE_NAMES)
    num_iter: Optional[int] = None
    cfg_schedule: Optional[str] = _choice(None, CFG_SCHEDULES)
    num_sampling_steps: Optional[str] = None
    # a transformers model directory instead of --model, and its prompts (sample_hf)
    hf: Optional[str] = None
    prompt: Optional[List[str]] = None
    prompts: Optional[str] = None  # a text file, one prompt per line
    negative_prompt: Optional[str] = None
    # sampling
    classes: Optional[List[int]] = None
    seed: int = 0
    cfg_scale: Optional[float] = None
    cfg_interval: int = -1
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    # the method (SpecConfig's defaults; a fixed tree: the images must not depend on timings)
    method: str = _choice("ar", METHODS)
    tree: str = _choice("chain", TREES)
    draft: Optional[str] = _choice(None, DRAFT_KINDS)
    depth: int = SpecConfig.depth
    nodes: int = SpecConfig.n_nodes
    k: int = SpecConfig.k
    delta: Optional[float] = None  # None: SpecConfig.delta for lantern, 0 (exact) for sjd
    lam: Optional[float] = None
    budget: str = _choice(SpecConfig.budget, BUDGETS)
    window: int = SpecConfig.window
    coupling: bool = SpecConfig.coupling
    init: str = _choice(SpecConfig.init, FRESH_INITS)
    # --method cspd (None: CSpDConfig's defaults)
    gamma: Optional[int] = None
    rule: Optional[str] = _choice(None, RULES)
    bandwidth: Optional[float] = None
    sigma_ratio: Optional[str] = _choice(None, SIGMA_RATIOS)
    prefill: Optional[float] = None
    max_tries: Optional[int] = None
    mar_drafter: Optional[str] = None
    mar_drafter_name: Optional[str] = None
    # the run
    batch: Optional[int] = None  # None: DEFAULT_BATCH
    fused: Optional[str] = None
    compile: str = _choice("auto", COMPILE_CHOICES)
    device: str = field(default_factory=default_device)
    dtype: str = _choice("auto", DTYPES)
    threads: int = DEFAULT_THREADS
    no_progress: bool = False

    @classmethod
    def from_options(cls, out, num_images, **options) -> "SampleSettings":
        """The settings of ``lantern.sample(out, num_images, **options)``, each value converted as argparse
        converts the command line's text: TypeError naming the option for an unknown option or a value of the
        wrong type, ValueError for a value outside its choices."""
        names = {f.name for f in fields(cls)}
        values = dict(options, out=out, num_images=num_images)
        for name in values:
            if name not in names:
                raise TypeError(f"sample() got an unknown option {name!r}")
        return cls(**{name: check_value(name, value) for name, value in values.items()})


def default_of(name: str):
    """The default of setting ``name`` (None for the required ones)."""
    spec = _FIELDS[name]
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return None if spec.default is MISSING else spec.default


def check_value(name: str, value):
    """``value`` for setting ``name`` converted as argparse would convert the command line's text -> the value
    (module docstring)."""
    kind, optional = _kind(name)
    if value is None:
        if optional:
            return None
        raise TypeError(f"sample(): {name} cannot be None")
    if name == "compile" and isinstance(value, bool):  # compile=True / False as lantern.generate takes it
        return "on" if value else "off"
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"sample(): {name} must be True or False, got {value!r}")
        return value
    if typing.get_origin(kind) is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"sample(): {name} must be a list, got {type(value).__name__} {value!r}")
        item_kind = typing.get_args(kind)[0]
        return [_item(name, item_kind, item) for item in value]
    return _item(name, kind, value)


def _item(name: str, kind, value):
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"sample(): {name} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"sample(): {name} must be a number, got {type(value).__name__} {value!r}")
        value = float(value)
    else:  # text: names and paths
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise TypeError(f"sample(): {name} must be a str, got {type(value).__name__} {value!r}")
    choices = _FIELDS[name].metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"sample(): {name} must be one of {list(choices)}, got {value!r}")
    return value


def _kind(name: str):
    """(the setting's type, whether it may be None): Optional[int] -> (int, True)."""
    hint = _HINTS[name]
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


_FIELDS = {f.name: f for f in fields(SampleSettings)}
_HINTS = typing.get_type_hints(SampleSettings)
