"""``lantern generate --hf DIR --prompt TEXT ...``: a locally downloaded transformers model directory (its
weights, processor and tokenizer; nothing is downloaded), the prompts through the model's own processor, the
images through its own VQ decoder, written as a grid (one row per prompt) and the run's figures as JSON."""
from __future__ import annotations

import argparse
import os
import time

import torch

CLASSES = {"janus": "JanusForConditionalGeneration", "emu3": "Emu3ForConditionalGeneration",
           "chameleon": "ChameleonForConditionalGeneration"}
DEFAULT_CFG = {"janus": 5.0, "emu3": 3.0, "chameleon": 1.0}  # the models' documented guidance (Chameleon: none)


def add_hf_options(p: argparse.ArgumentParser, sample: bool = False) -> None:
    """--hf, the prompts and --negative-prompt (``sample``: lantern sample's, which cycles its prompts over the
    image ids and also takes them from a file)."""
    hf = p.add_argument_group("transformers models (--hf DIR; docs/hf.md)")
    hf.add_argument("--hf", metavar="DIR", help="a local transformers model directory (Janus / Janus-Pro, Emu3" +
                    ("" if sample else ", Chameleon / Anole") + "): its weights, processor and tokenizer; replaces "
                    "--model")
    if sample:
        hf.add_argument("--prompt", nargs="+", metavar="TEXT", help="--hf: the prompts; image i has prompt i mod "
                        "their number")
        hf.add_argument("--prompts", metavar="FILE", help="--hf: a UTF-8 text file of prompts, one a line (blank "
                        "lines skipped), instead of --prompt")
    else:
        hf.add_argument("--prompt", nargs="+", metavar="TEXT", help="--hf: the prompts, one grid row each")
    hf.add_argument("--negative-prompt", metavar="TEXT", help="--hf (Emu3, Chameleon): the unconditional prompt of "
                    "guidance (unset: the model's rule)")


def model_kind(directory: str) -> str:
    """The model_type of DIR's config ("janus", "emu3" or "chameleon"); SystemExit naming --hf otherwise."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        raise SystemExit(f"--hf {directory}: no transformers model config there ({type(e).__name__}: "
                         f"{first_line})") from e
    kind = config.model_type
    if kind not in CLASSES:
        raise SystemExit(f"--hf {directory}: model_type {kind!r} is not supported (lantern.hf takes "
                         f"{', '.join(CLASSES)})")
    return kind


def hf_dtype(name: str, device) -> torch.dtype:
    """--dtype of an --hf run: as given, else (auto) bfloat16 on a GPU and float32 on a CPU."""
    if name not in (None, "auto"):
        return getattr(torch, name)
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load(directory: str, device, dtype):
    """(kind, the model on ``device`` in ``dtype``, its processor) from the local directory; nothing is
    downloaded."""
    import transformers

    kind = model_kind(directory)
    cls = getattr(transformers, CLASSES[kind])
    model = cls.from_pretrained(directory, local_files_only=True, dtype=dtype).to(device)
    processor = transformers.AutoProcessor.from_pretrained(directory, local_files_only=True)
    return kind, model, processor


def wrapped(kind: str, model, processor, first_prompt: str, device):
    """lantern.hf.wrap(model) with the image size the processor gives (Emu3) -> HFTarget."""
    from . import wrap

    _, _, image_size = encode_prompts(kind, processor, [first_prompt], device)
    return wrap(model, **({"image_size": image_size} if image_size else {}))


def generation_options(args, kind: str, target) -> dict:
    """lantern.generate's keywords from the parsed options (or a SampleSettings) of an --hf run, the prompts
    and the negative prompt aside: the method, guidance (unset: the model's documented scale), the sampling
    filters and seed, and the Jacobi / relaxation options of the methods that draft (--k at most the
    codebook's codes less one; --delta unset: 0.1)."""
    cfg_scale = args.cfg_scale if args.cfg_scale is not None else DEFAULT_CFG[kind]
    options = dict(method=args.method, cfg_scale=cfg_scale, temperature=args.temperature, top_k=args.top_k or 0,
                   top_p=args.top_p, cfg_interval=args.cfg_interval, seed=args.seed)
    if args.method == "sjd" and (args.delta or args.lam):  # relaxed like lantern, over the model's codebook
        options["neighbours"] = target.neighbour_table(min(args.k, target.rules.n_codes - 1))
    if args.method != "ar":
        options.update(tree=args.tree, k=args.k, delta=args.delta if args.delta is not None else 0.1,
                       lam=args.lam, budget=args.budget, window=args.window, coupling=args.coupling, init=args.init)
    return options


def negative_prompt_options(processor, negative_prompt, count: int, cfg_scale, device) -> dict:
    """negative_prompt_ids / _attention_mask for ``count`` rows (Emu3, Chameleon), or {} when there is none or
    guidance is off."""
    if not negative_prompt or cfg_scale == 1:
        return {}
    ids, mask, _ = encode_prompts("chameleon", processor, [negative_prompt] * count, device)
    return dict(negative_prompt_ids=ids, negative_prompt_attention_mask=mask)


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """The VQ decoder's images [B, 3, h, w] in [-1, 1] -> uint8 [B, h, w, 3] on the CPU."""
    images = images.float().clamp(-1, 1)
    return ((images + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def encode_prompts(kind: str, processor, texts, device):
    """-> (input_ids, attention_mask, image_size or None) as the model's processor builds them for image
    generation."""
    if kind == "janus":
        out = processor(text=texts, generation_mode="image", return_tensors="pt", padding=True)
        return out["input_ids"].to(device), out["attention_mask"].to(device), None
    if kind == "emu3":
        out = processor(text=texts, return_for_image_generation=True, return_tensors="pt", padding=True)
        height, width = (int(s) for s in out["image_sizes"][0])
        return out["input_ids"].to(device), out["attention_mask"].to(device), (height, width)
    out = processor.tokenizer(texts, return_tensors="pt", padding=True)
    return out["input_ids"].to(device), out["attention_mask"].to(device), None


def run_generate_hf(args: argparse.Namespace) -> int:
    from ..decoding import generate
    from ..images import save_grid
    from ..outputs import check_output_path, write_json

    if not args.prompt:
        raise SystemExit("--hf needs --prompt TEXT [TEXT ...]")
    if not os.path.isdir(args.hf):
        raise SystemExit(f"--hf {args.hf}: not a directory (a locally downloaded transformers model)")
    if args.method == "cspd":
        raise SystemExit("--method cspd is for MAR models; --hf takes ar, sjd, spec or lantern")
    if args.per_class < 1:
        raise SystemExit(f"--per-class must be >= 1, got {args.per_class}")
    check_output_path(args.out, "--out", [".png", ".jpg", ".jpeg"], "an image file")
    if args.json:
        check_output_path(args.json, "--json", [".json"], "a JSON file")
    kind, model, processor = load(args.hf, args.device, hf_dtype(args.dtype, args.device))
    texts = [t for t in args.prompt for _ in range(args.per_class)]
    ids, mask, _ = encode_prompts(kind, processor, texts, args.device)
    target = wrapped(kind, model, processor, texts[0], args.device)
    options = generation_options(args, kind, target)
    cfg_scale = options["cfg_scale"]
    options.update(negative_prompt_options(processor, args.negative_prompt, len(texts), cfg_scale, args.device))
    t0 = time.perf_counter()
    codes, stats = generate(target, ids, attention_mask=mask, **options)
    wall = time.perf_counter() - t0
    figures = dict(model=CLASSES[kind], directory=args.hf, prompts=list(args.prompt), images=len(texts),
                   codes_per_image=codes.shape[1], method=args.method, cfg_scale=cfg_scale,
                   temperature=args.temperature, seed=args.seed, wall_s=wall, out=args.out,
                   tau=1.0 if stats is None else stats.tau,
                   target_forwards=codes.shape[1] if stats is None else stats.target_forwards,
                   codes=codes.tolist())
    try:
        with torch.no_grad():
            pixels = to_pixels(target.decode_images(codes))  # [B, h, w, 3]
    except NotImplementedError as err:
        figures.update(out=None, note=str(err))
        print(f"{err}: the codes are in the JSON figures instead of an image")
    else:
        save_grid(pixels, rows=len(args.prompt), path=args.out, scale=max(1, 128 // pixels.shape[1]))
        print(f"wrote {args.out}")
    print(f"{kind} {args.method}: {len(texts)} images in {wall:.2f} s, tau {figures['tau']:.2f}, "
          f"{figures['target_forwards']} target forwards")
    if args.json:
        write_json(args.json, figures)
        print(f"wrote {args.json}")
    return 0
