"""``lantern sample --hf DIR``: a locally downloaded transformers model directory (Janus / Janus-Pro, Emu3) as
the sampled model, loaded as ``lantern generate --hf`` loads it (``hf.cli``: its processor and tokenizer from
DIR, ``lantern.hf.wrap``, the model's own VQ decoder). Prompts take the place of class ids: image i has prompt
``prompts[i mod len(prompts)]``, from ``--prompt TEXT [TEXT ...]`` or ``--prompts FILE`` (one prompt a line,
surrounding whitespace removed, blank lines skipped).

The methods are ``generate --hf``'s: ar, sjd (exact, or relaxed with --delta > 0 or --lam), lantern (Jacobi
drafts with relaxed acceptance over the model's codebook) and spec (exact: there is no drafter, the drafts
are the model's own), each verified as a chain (a fixed tree, as every ``lantern sample`` run). Options of
lantern's own models (--model, the checkpoints, --classes, MAR's, the drafter trees') are refused before
anything is written, as are Chameleon-class models (no VQ decoder in the class: nothing to write).

config.json records DIR, the model's class, the sha256 of every file of DIR the run reads (weights,
configs, tokenizer and processor files), the prompts (their text, or the file's path, and a digest of the
list) and every sampling option after the model's defaults are filled in; ``numerics`` adds the
transformers version to lantern's record (docs/hf.md "lantern sample")."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch

from . import sources

MAX_PROMPTS_BYTES = 64 << 20
# the options of lantern's own models: none applies to a transformers model
NOT_HF = (*sources.MODEL_OPTIONS, "classes")
HF_ONLY = ("prompt", "prompts", "negative_prompt")
# files of DIR that do not decide the images
_NOT_READ = ("readme", "license", "notice")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_hf_options(args, default: Callable[[str], object]) -> bool:
    """Whether ``args`` (a SampleSettings) is an --hf run; checks its model and prompts if so (module
    docstring; its method: ``sample_options.check_hf_method``), filling in the prompts' texts
    (``args.prompt_texts``). An --hf option without --hf is refused. SystemExit naming the option."""
    if args.hf is None:
        given = [dest for dest in HF_ONLY if getattr(args, dest) is not None]
        if given:
            raise SystemExit(f"{_flag(given[0])} applies to --hf DIR (a transformers model); lantern's own models "
                             f"take --classes")
        return False
    if args.model != default("model"):
        raise SystemExit(f"--model does not apply with --hf (the model is DIR's), got --model {args.model}")
    for dest in NOT_HF:
        if getattr(args, dest, None) is not None:
            why = "it takes --prompt or --prompts" if dest == "classes" else "it is for lantern's own models"
            raise SystemExit(f"{_flag(dest)} does not apply to --hf (a transformers model; {why})")
    if not os.path.isdir(args.hf):
        raise SystemExit(f"--hf {args.hf}: not a directory (a locally downloaded transformers model)")
    from .hf.cli import model_kind

    kind = model_kind(args.hf)
    if kind == "chameleon":
        raise SystemExit(f"--hf {args.hf}: a Chameleon-class model holds no VQ decoder, and lantern sample writes "
                         f"images; lantern generate --hf writes its codes")
    if args.negative_prompt is not None and kind == "janus":
        raise SystemExit("--negative-prompt applies to Emu3 and Chameleon models; Janus's unconditional prompt is "
                         "its own rule")
    args.prompt_texts = prompt_texts(args)
    return True


def prompt_texts(args) -> List[str]:
    """The prompts of --prompt or --prompts FILE (exactly one of them)."""
    if (args.prompt is None) == (args.prompts is None):
        raise SystemExit("--hf needs its prompts: --prompt TEXT [TEXT ...] or --prompts FILE (one of them)")
    if args.prompt is not None:
        if not args.prompt:
            raise SystemExit("--prompt needs at least one TEXT")
        return list(args.prompt)
    return read_prompts(args.prompts)


def read_prompts(path) -> List[str]:
    """A UTF-8 text file of at most 64 MiB -> its prompts, one a line (surrounding whitespace removed, blank
    lines skipped). SystemExit naming --prompts unless it holds at least one."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise SystemExit(f"--prompts {path!r} is not a regular file")
        if info.st_size > MAX_PROMPTS_BYTES:
            raise SystemExit(f"--prompts {path!r} holds {info.st_size} bytes, more than {MAX_PROMPTS_BYTES}")
        text = Path(path).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--prompts {path!r} cannot be read as UTF-8 text ({type(e).__name__}: {e})") from e
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"--prompts {path!r} holds no prompt (one a line)")
    return prompts


def prompts_record(args) -> dict:
    """config.json's record of the prompts: their text (--prompt) or file (--prompts), their number and the
    sha256 of the list (as JSON)."""
    record = {"prompt_count": len(args.prompt_texts),
              "prompts_sha256": hashlib.sha256(json.dumps(args.prompt_texts).encode()).hexdigest()}
    if args.prompts is not None:
        record["prompts_file"] = os.path.abspath(args.prompts)
    else:
        record["prompts"] = list(args.prompt_texts)
    return record


def model_files(directory) -> Dict[str, str]:
    """name -> path of every file of DIR a run reads (its top level, but hidden files and README / LICENSE /
    NOTICE / *.md): the weights, the configs, the tokenizer and processor files."""
    files = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            lower = entry.name.lower()
            if entry.name.startswith(".") or lower.endswith(".md") or lower.startswith(_NOT_READ):
                continue
            if entry.is_file():
                files[entry.name] = entry.path
    return dict(sorted(files.items()))


class HFSampler:
    """A transformers model through ``lantern.generate``, every draw keyed by image id (``sampling``'s
    ``DiscreteSampler`` for the models of ``lantern.hf``)."""

    def __init__(self, args):
        from .hf.cli import CLASSES, generation_options, hf_dtype, load, wrapped

        self.kind, self.model, self.processor = _loaded(args, lambda: load(args.hf, args.device,
                                                                           hf_dtype(args.dtype, args.device)))
        self.prompts = args.prompt_texts
        self.target = wrapped(self.kind, self.model, self.processor, self.prompts[0], args.device)
        from .decoding.compiled import COMPILE_CHOICES

        self.options = generation_options(args, self.kind, self.target)
        self.options["compile"] = COMPILE_CHOICES[args.compile]  # as numerics_of records it
        self.weight_files = model_files(args.hf)
        self.hf = os.path.abspath(args.hf)
        self.codes_per_image = self.target.config.height * self.target.config.width
        self.sequence_length = self.target.config.block_size
        with torch.no_grad():
            blank = torch.zeros(1, self.codes_per_image, dtype=torch.int64, device=args.device)
            self.image_shape = tuple(self.target.decode_images(blank).shape[2:])
        sampling = {k: v for k, v in self.options.items() if k not in ("method", "seed", "neighbours", "compile")}
        self.settings = dict(model_class=CLASSES[self.kind], **prompts_record(args),
                             image_codes=[self.target.config.height, self.target.config.width],
                             negative_prompt=args.negative_prompt, **sampling)
        if args.method != "ar":  # the neighbours merged at most: the codebook's other codes at most
            self.settings["k"] = min(args.k, self.target.rules.n_codes - 1)
        self.args = args

    @torch.no_grad()
    def sample(self, ids: torch.Tensor, _labels, seed: int):
        """Images ids [b] (their prompts by id) -> (uint8 pixels [b, H, W, 3], counts)."""
        from .decoding import generate
        from .hf.cli import encode_prompts, negative_prompt_options, to_pixels

        device = self.args.device
        texts = [self.prompts[i % len(self.prompts)] for i in ids.tolist()]
        input_ids, mask, _ = encode_prompts(self.kind, self.processor, texts, device)
        options = dict(self.options, seed=seed, **negative_prompt_options(
            self.processor, self.args.negative_prompt, len(texts), self.options["cfg_scale"], device))
        codes, stats = generate(self.target, input_ids, attention_mask=mask, image_ids=ids, **options)
        # one image at a time: a pixel depends on its image's codes, not on the rows decoded beside them
        pixels = np.concatenate([to_pixels(self.target.decode_images(row[None])).numpy() for row in codes])
        b, L = len(ids), self.sequence_length
        if stats is None:  # AR: one target forward per position (row ends included)
            counts = dict(emitted=b * L, row_steps=b * L, target_forwards=L, draft_forwards=0)
        else:
            counts = dict(emitted=stats.emitted, row_steps=stats.row_steps, target_forwards=stats.target_forwards,
                          draft_forwards=stats.draft_forwards)
        return pixels, counts

    @staticmethod
    def figures(counts: dict, _images: int) -> dict:
        return dict(tau=counts.get("emitted", 0) / max(counts.get("row_steps", 0), 1), **counts)

    def record(self, args) -> dict:
        """The model's part of config.json (``sampling.settings_of``)."""
        from .sample_folder import digest

        sha256 = {name: digest(path) for name, path in self.weight_files.items()}
        return dict(hf=self.hf, sha256=sha256, method=args.method, num_images=args.num_images, batch=args.batch,
                    seed=args.seed, **self.settings)


def _loaded(args, load):
    try:
        return load()
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - a model directory is input: its failure deserves a message
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        raise SystemExit(f"--hf {args.hf} cannot be loaded: {type(e).__name__}: {first_line}") from e
