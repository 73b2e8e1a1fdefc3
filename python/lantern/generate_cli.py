"""`lantern generate`: sample images, write a PNG grid, print throughput (and quality for the tiny model)."""
from __future__ import annotations

import argparse
import time

import torch

from .decoding.compiled import COMPILE_CHOICES

LLAMAGEN_DEMO_CLASSES = [207, 360, 387, 974, 88, 979, 417, 279]


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="sample images (tiny default model or official LlamaGen checkpoints) and write a PNG grid",
        description="Sample class-conditional images autoregressively with LlamaGen's semantics (CFG by "
                    "doubled batch, temperature, top-k, top-p, cfg_interval). Each grid row is one class. "
                    "Prints tokens/s; with the tiny default model also the classifier's class accuracy and "
                    "the Frechet distance to the dataset in the classifier's feature space.")
    add_model_options(p)
    samp = add_sampling_options(p, classes_help="class ids, one grid row each (default: every tiny class / "
                                "LlamaGen's demo classes)")
    samp.add_argument("--per-class", type=int, default=4, help="images per class (grid columns)")
    run = p.add_argument_group("run")
    spec = add_method_options(p, run)
    spec.add_argument("--no-ar-baseline", action="store_true",
                      help="skip the AR run (cspd: the target-only MAR run) that measures speedup_vs_ar in the "
                           "same process")
    run.add_argument("--batch", type=int, metavar="N", help="generate N images at a time (default: all at once); "
                     "batch i samples with seed + i, and the AR baseline uses the same batches")
    add_device_options(run)
    run.add_argument("--out", default="samples.png", metavar="PATH", help="image grid to write (.png, .jpg, ...; "
                     "its folder must exist)")
    run.add_argument("--json", metavar="PATH", help="also write the run's figures as JSON (.json; a figure that is "
                     "not a number, e.g. the Frechet distance of one image, is null)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    from .hf.cli import add_hf_options

    add_hf_options(p)
    return p


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model's source (--model and the checkpoint files; shared by generate and sample)."""
    src = p.add_argument_group("model")
    src.add_argument("--model", default="tiny", choices=["tiny", "checkpoint", "tiny-mar", "mar-checkpoint"],
                     help="'tiny': the shipped default (trained by python -m lantern.tiny.train); "
                          "'checkpoint': official LlamaGen files given by --gpt / --vq; "
                          "'tiny-mar': the continuous-token default (trained by python -m lantern.tiny_mar.train); "
                          "'mar-checkpoint': official MAR files given by --mar / --vae")
    src.add_argument("--gpt", metavar="PATH", help="GPT checkpoint (.pt / .pth / .safetensors)")
    src.add_argument("--gpt-name", help="GPT config: GPT-B, GPT-L, GPT-XL (default), GPT-XXL, GPT-3B")
    src.add_argument("--vq", metavar="PATH", help="VQ-16 tokenizer checkpoint")
    src.add_argument("--image-size", type=int, choices=[256, 384, 512],
                     help="official models: image size (16x16, 24x24 or 32x32 tokens; default 256)")
    mar = p.add_argument_group("MAR (--model tiny-mar | mar-checkpoint)")
    mar.add_argument("--mar", metavar="PATH", help="MAR checkpoint (checkpoint-last.pth: its model_ema; or safetensors)")
    mar.add_argument("--mar-name", help="MAR config: MAR-B (default), MAR-L, MAR-H")
    mar.add_argument("--vae", metavar="PATH", help="KL-16 autoencoder checkpoint (kl16.ckpt)")
    mar.add_argument("--vae-name", choices=["KL-16", "KL-tiny"], help="autoencoder config (default KL-16)")
    mar.add_argument("--num-iter", type=int, help="MAR steps (default: the model's recommendation; 64 official)")
    mar.add_argument("--cfg-schedule", choices=["linear", "constant"], help="guidance schedule over the MAR steps "
                     "(default: the model's recommendation, linear)")
    mar.add_argument("--num-sampling-steps", help="official models: diffusion steps of the head (default 100)")


def add_sampling_options(p: argparse.ArgumentParser, classes_help: str):
    """--classes, --seed and the sampling settings (guidance, temperature, filters) -> the group."""
    samp = p.add_argument_group("sampling")
    samp.add_argument("--classes", type=int, nargs="+", help=classes_help)
    samp.add_argument("--seed", type=int, default=0, help="seed of the sampling stream: same seed, same image")
    samp.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale (1 = off; default: the "
                      "model's recommended value, 4.0 for official models)")
    samp.add_argument("--cfg-interval", type=int, default=-1, help="use guidance only up to this step (-1 = always)")
    samp.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    samp.add_argument("--top-k", type=int, help="keep the top-k logits (0 = off; default: the model's, 2000 official)")
    samp.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (1 = off)")
    return samp


def add_method_options(p: argparse.ArgumentParser, run):
    """--method (in ``run``) and each method's options -> the speculative-decoding group."""
    run.add_argument("--method", default="ar", choices=["ar", "spec", "lantern", "sjd", "cspd"],
                     help="ar: one target forward per token (MAR: its own loop); spec: exact speculative decoding; "
                          "lantern: relaxed acceptance over latent neighbours (faster, bounded TV); sjd: Jacobi "
                          "self-drafting, no drafter (exact; relaxed like lantern when given --delta > 0 or --lam); "
                          "cspd: continuous speculative decoding (MAR models)")
    spec = p.add_argument_group("speculative decoding (--method spec | lantern | sjd)")
    spec.add_argument("--tree", default="auto", choices=["auto", "chain", "static", "dynamic"],
                      help="draft tree: auto (each step, the tree or plain AR step that the device's measured "
                           "costs and the run's acceptance predict fastest), chain, fixed static shape (sampled "
                           "drafts), EAGLE-2 dynamic")
    spec.add_argument("--draft", choices=["deterministic", "sampled"],
                      help="draft kind: sampled (drawn from the drafter's distribution, kept with probability "
                           "min(1, p/q): accepts far more on image tokens) or deterministic (the drafter's top "
                           "tokens). Default: sampled for chains and static trees, deterministic for EAGLE-2 "
                           "dynamic trees; with --tree auto, sampled leaves out the dynamic trees and "
                           "deterministic the static ones")
    spec.add_argument("--depth", type=int, default=5, help="draft levels (chain length / EAGLE-2 expansions; "
                      "auto: the deepest candidate)")
    spec.add_argument("--nodes", type=int, default=58, help="EAGLE-2: drafted nodes kept per step (>= 1; for no "
                      "drafts use --method ar)")
    spec.add_argument("--k", type=int, default=1000, help="LANTERN: latent neighbours merged at most")
    spec.add_argument("--delta", type=float, help="LANTERN: total-variation budget (default 0.1 for lantern; sjd: "
                      "0, exact)")
    spec.add_argument("--lam", type=float, help="LANTERN++: multiplicative cap lambda (instead of --delta)")
    spec.add_argument("--budget", default="candidate", choices=["candidate", "node"],
                      help="delta per candidate (upstream) or per tree node (TV <= delta guaranteed)")
    jacobi = p.add_argument_group("Jacobi self-drafting (--method sjd; docs/sjd.md)")
    jacobi.add_argument("--window", type=int, default=8, help="drafts verified per step (--tree chain), or the "
                        "largest window the planner chooses from (--tree auto)")
    jacobi.add_argument("--coupling", action="store_true", help="coupled drafts (SCD): the draws of one image "
                        "position share their random numbers across steps")
    jacobi.add_argument("--init", default="repeat", choices=["repeat", "sample"], help="fresh window slots: copy "
                        "the token to their left, or draw from the last forward's row")
    from .generate_mar_cli import add_cspd_options

    add_cspd_options(p)
    # the command's defaults (its own set_defaults included), to tell which options were given
    p.set_defaults(parser_default=p.get_default)
    return spec


def add_device_options(run) -> None:
    """--fused, --compile, --device, --dtype."""
    run.add_argument("--fused", metavar="BACKEND",
                     help="enable fused ops: auto | cpu | cuda | triton. Faster, and not only faster: the kernels "
                          "round differently from the reference (tree attention most in bfloat16), so some "
                          "tokens can differ (docs/sampling.md \"Numerics\")")
    run.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                     help="target and drafter forwards through torch.compile (inductor; CUDA graphs on a GPU), "
                          "node counts padded to a few buckets. auto (default): on where torch.compile works on "
                          "the device (LANTERN_COMPILE=0 turns it off); --compile alone: on. Compiled graphs are "
                          "cached under $LANTERN_CACHE/inductor; the one-off compile time is reported apart")
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float64"],
                     help="the GPT's compute dtype. auto: bfloat16 on a GPU, and on a CPU with native bf16 dot "
                          "products (AVX512-BF16 / AMX), else float32. float64: slow; last-bit differences "
                          "between kernels (batch shapes, backends) then almost never change a token")


# options that apply to some models only (dest -> the --model values they apply to)
MODEL_OPTIONS = {
    "gpt": ("checkpoint",), "gpt_name": ("checkpoint",), "vq": ("checkpoint",), "image_size": ("checkpoint",),
    "mar": ("mar-checkpoint",), "mar_name": ("mar-checkpoint",), "vae": ("mar-checkpoint",),
    "vae_name": ("mar-checkpoint",), "num_sampling_steps": ("mar-checkpoint",),
    "num_iter": ("tiny-mar", "mar-checkpoint"), "cfg_schedule": ("tiny-mar", "mar-checkpoint"),
    **{name: ("tiny-mar", "mar-checkpoint") for name in ("gamma", "rule", "bandwidth", "sigma_ratio", "prefill",
                                                         "max_tries")},
    "mar_drafter": ("mar-checkpoint",), "mar_drafter_name": ("mar-checkpoint",),
}
MODEL_DEFAULTS = {"gpt_name": "GPT-XL", "image_size": 256, "mar_name": "MAR-B", "vae_name": "KL-16"}


MAX_PER_CLASS = 1024  # lantern generate writes one grid; lantern sample makes many images
# the options whose applicability depends on the model family, method and tree (dests; decoding/options.py
# names them alike, but for --nodes: n_nodes)
METHOD_OPTIONS = ("tree", "draft", "depth", "nodes", "k", "delta", "lam", "budget", "window", "coupling", "init",
                  "compile", "dtype", "top_k", "top_p", "cfg_interval", "no_ar_baseline", "gamma", "rule", "bandwidth",
                  "sigma_ratio", "prefill", "max_tries", "mar_drafter", "mar_drafter_name")


def check_options(args) -> None:
    """Before any model is loaded: every given option applies to the chosen model, the counts are
    positive, and the output files can be written. SystemExit naming the option otherwise. Then the
    defaults of the model options are filled in."""
    if not 1 <= args.per_class <= MAX_PER_CLASS:
        raise SystemExit(f"--per-class must be >= 1 and at most {MAX_PER_CLASS} (one grid; lantern sample makes "
                         f"many images), got {args.per_class}")
    check_method_options(args)
    check_outputs(args)


def is_mar(args) -> bool:
    return args.model in ("tiny-mar", "mar-checkpoint")


def given_options(args) -> dict:
    """The method options set to something other than the command's defaults (options.py's names)."""
    default = getattr(args, "parser_default", lambda dest: None)
    return {"n_nodes" if dest == "nodes" else dest: getattr(args, dest) for dest in METHOD_OPTIONS
            if hasattr(args, dest) and getattr(args, dest) != default(dest)}


def check_method_options(args) -> None:
    """The model and method options of ``generate`` and ``sample``: each given option applies to the chosen
    model, method and tree (``decoding/options.py``), every number is in its bounds (SystemExit naming the
    option otherwise); fills in the model defaults and --delta."""
    from .decoding.options import OptionError, check_applicable, cli_message

    for dest, models in MODEL_OPTIONS.items():
        if getattr(args, dest, None) is not None and args.model not in models:
            flag = "--" + dest.replace("_", "-")
            raise SystemExit(f"{flag} does not apply to --model {args.model} (it is for --model "
                             f"{' / '.join(models)})")
    for dest, value in MODEL_DEFAULTS.items():
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
        check_numbers(args)
        family = "mar" if is_mar(args) else "gpt"
        check_applicable(family, args.method, given_options(args), tree=args.tree, relaxed=relaxed(args), cli=True)
    except OptionError as e:
        raise SystemExit(cli_message(e)) from e
    if not is_mar(args):
        check_jacobi_options(args)


def check_numbers(args) -> None:
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
    """--method sjd verifies its window as a chain (its other options: ``check_method_options``). Fills in
    --delta: 0.1 for lantern, 0 (exact) for sjd."""
    if args.method == "sjd":
        if args.tree not in ("auto", "chain"):
            raise SystemExit(f"--method sjd verifies its window as a chain: --tree must be auto or chain, got "
                             f"{args.tree}")
        if args.draft is not None:
            raise SystemExit("--draft does not apply to --method sjd (its drafts are the target's own samples)")
    if args.delta is None:
        args.delta = 0.0 if args.method == "sjd" else 0.1


def relaxed(args) -> bool:
    """Whether verify relaxes over latent neighbours: lantern, or sjd given a TV budget or a lambda cap."""
    return args.method == "lantern" or (args.method == "sjd" and ((args.delta or 0) > 0 or args.lam is not None))


def check_outputs(args) -> None:
    """--out (an image) and --json (JSON) can be written (their extensions differ, so never the same file)."""
    from .outputs import check_output_path, image_suffixes

    check_output_path(args.out, "--out", image_suffixes(), "an image file")
    if args.json is not None:
        check_output_path(args.json, "--json", [".json"], "a JSON file")


def check_classes(classes, num_classes: int) -> None:
    """--classes must be ids of the model's classes, [0, num_classes)."""
    bad = [c for c in classes if not 0 <= c < num_classes]
    if bad:
        raise SystemExit(f"--classes must be class ids in [0, {num_classes}) for this model "
                         f"({num_classes} classes), got {bad}")


def _load(args):
    """(gpt, vq, meta) for the chosen source."""
    if args.model == "tiny":
        from .pretrained import load_tiny

        tiny = load_tiny(args.device, dtype=_dtype(args))
        return tiny.gpt, tiny.vq, tiny.meta
    if not args.gpt or not args.vq:
        raise SystemExit("--model checkpoint needs --gpt PATH and --vq PATH")
    from .models import load_gpt, load_vq

    block = (args.image_size // 16) ** 2
    gpt = load_gpt(args.gpt, args.gpt_name, block_size=block, device=args.device, dtype=_dtype(args)).eval()
    vq = load_vq(args.vq, "VQ-16", decoder_only=True, device=args.device).eval()
    return gpt, vq, {"sampling": {"cfg_scale": 4.0, "top_k": 2000}}


def _dtype(args) -> torch.dtype:
    from .models import decode_dtype

    return decode_dtype(args.device) if args.dtype == "auto" else getattr(torch, args.dtype)


def _drafter_and_table(args, gpt, vq):
    """(drafter, neighbour table): sjd has no drafter, and a table only when relaxed."""
    from .neighbours import neighbour_table

    table = None
    if relaxed(args):
        V = vq.quantize.embedding.weight.shape[0]
        if args.k > V:
            raise SystemExit(f"--k must be at most the codebook's {V} codes (latent neighbours merged at most), got "
                             f"{args.k}")
        K = max(args.k, 1)
        table = neighbour_table(vq.quantize.embedding.weight, K, normalize=True)
    if args.method == "sjd":
        return None, table
    if args.model != "tiny":
        raise SystemExit("--method spec/lantern with official checkpoints needs a trained drafter; "
                         "today the CLI ships one for the tiny model only (see README); --method sjd needs none")
    from .pretrained import load_tiny_drafter

    return load_tiny_drafter(gpt), table


def guidance_and_top_k(args, meta: dict):
    """--cfg-scale and --top-k, or the model's recommendation (meta["sampling"]), or LlamaGen's 4.0 / off."""
    defaults = meta.get("sampling", {})
    cfg_scale = args.cfg_scale if args.cfg_scale is not None else defaults.get("cfg_scale", 4.0)
    top_k = args.top_k if args.top_k is not None else defaults.get("top_k", 0)
    return cfg_scale, top_k


def method_options(args) -> dict:
    """The speculative methods' ``lantern.generate`` options from the command line (drafter and table aside)."""
    options = dict(tree=args.tree, k=args.k, delta=args.delta, lam=args.lam, budget=args.budget, depth=args.depth,
                   n_nodes=args.nodes, draft=args.draft)
    if args.method == "sjd":
        options.update(window=args.window, coupling=args.coupling, init=args.init)
    return options


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import enable_fused
    from .decoding import generate, generate_ar
    from .images import save_grid
    from .outputs import write_json

    if getattr(args, "hf", None):  # a transformers model directory: lantern.hf
        from .hf.cli import run_generate_hf

        return run_generate_hf(args)
    check_options(args)
    if args.method == "cspd" and args.model not in ("tiny-mar", "mar-checkpoint"):
        raise SystemExit("--method cspd (continuous speculative decoding) is for MAR models: --model tiny-mar or "
                         "mar-checkpoint")
    if args.model in ("tiny-mar", "mar-checkpoint"):
        from .generate_mar_cli import run_generate_mar

        return run_generate_mar(args)
    if args.fused:
        enable_fused(args.fused)
    gpt, vq, meta = _load(args)
    cfg_scale, top_k = guidance_and_top_k(args, meta)
    classes = args.classes or (list(range(gpt.config.num_classes)) if args.model == "tiny" else LLAMAGEN_DEMO_CLASSES)
    check_classes(classes, gpt.config.num_classes)
    labels = torch.tensor(classes, device=args.device).repeat_interleave(args.per_class)  # [B]
    batch = _batch_size(args.batch, len(labels))
    L = gpt.config.block_size
    sampling = dict(cfg_scale=cfg_scale, temperature=args.temperature, top_k=top_k, top_p=args.top_p, seed=args.seed)
    figures = dict(method=args.method, images=len(labels), batch=batch, tokens_per_image=L, **sampling, out=args.out,
                   dtype=str(gpt.tok_embeddings.weight.dtype).replace("torch.", ""))
    chunks = list(labels.split(batch))
    if args.seed + len(chunks) > 2**64:
        raise SystemExit(f"--seed: batch i samples with seed + i, so the seed must be below 2^64 - {len(chunks) - 1} "
                         f"for {len(chunks)} batches, got {args.seed}")
    seeds = [args.seed + i for i in range(len(chunks))]
    options = {}
    compile_stats = [{} for _ in chunks]  # AR: filled by generate_ar
    compile = COMPILE_CHOICES[args.compile]  # --compile -> lantern.generate's compile
    if args.method != "ar":
        drafter, table = _drafter_and_table(args, gpt, vq)
        options = dict(method=args.method, drafter=drafter, neighbours=table, cfg_interval=args.cfg_interval,
                       **method_options(args))
        if args.tree == "auto":
            options["cost_model"] = _cost_model(gpt, drafter, table, chunks[0], options, sampling, figures)
    bar = tqdm(total=len(labels) * L, desc=f"{args.method}: {len(labels)} images", disable=args.no_progress, unit="tok")
    t0 = time.perf_counter()
    if args.method == "ar":
        tokens = torch.cat([generate_ar(gpt, chunk, cfg_interval=args.cfg_interval,
                                        on_token=lambda s, n=len(chunk): bar.update(n), compile=compile,
                                        stats=stat, **dict(sampling, seed=seed))
                            for chunk, seed, stat in zip(chunks, seeds, compile_stats)])
        figures.update(tau=1.0, target_forwards=L * len(chunks), draft_forwards=0)
        figures.update(_compile_figures(compile_stats))
    else:
        parts, all_stats = [], []
        for chunk, seed in zip(chunks, seeds):
            part, stats = generate(gpt, chunk, **options, compile=compile, **dict(sampling, seed=seed))
            parts.append(part)
            all_stats.append(stats)
            bar.update(len(chunk) * L)
        tokens = torch.cat(parts)
        figures.update(_spec_figures(all_stats), tree=args.tree, k=args.k, delta=args.delta, lam=args.lam,
                       budget=args.budget)
        figures.update(_compile_figures([vars(st) for st in all_stats]))
    figures["wall_s"] = time.perf_counter() - t0
    bar.close()
    figures["tokens_per_s"] = len(labels) * L / figures["wall_s"]
    if args.method != "ar" and not args.no_ar_baseline:
        figures.update(_ar_baselines(gpt, chunks, seeds, sampling, args.cfg_interval, figures))
    side = gpt.config.grid_size
    with torch.no_grad():
        images = vq.decode_codes(tokens, side, side)  # [B, 3, H, W]
    pixels = vq.to_uint8(images).cpu()
    save_grid(pixels, rows=len(classes), path=args.out, scale=max(1, 128 // pixels.shape[1]))
    if args.model == "tiny":
        from .tiny.evaluate import evaluate_samples

        figures.update(evaluate_samples(images.cpu(), labels.cpu()))
    _print_figures(figures, args)
    if args.json:
        write_json(args.json, figures)
        print(f"wrote {args.json}")
    return 0


def _compile_figures(stats) -> dict:
    """What compile resolved to, the one-off compile time (first calls of each new graph, part of wall_s) and
    the graphs compiled."""
    return dict(compile=next((s.get("compile") for s in stats if s.get("compile")), ""),
                compile_s=sum(s.get("compile_s", 0.0) for s in stats),
                compiled_graphs=sum(s.get("compiled_graphs", 0) for s in stats))


def _ar_baselines(gpt, chunks, seeds, sampling, cfg_interval, figures) -> dict:
    """The same images by AR, after the run: compiled wherever torch.compile works (the fastest AR lantern
    runs on the device, ``compiled.baseline_compile``), and eagerly beside it. Speed-ups compare times
    without the one-off compiles (first calls of new graphs), which are reported apart."""
    from .decoding import generate_ar
    from .decoding.compiled import baseline_compile

    def timed(compile):
        t0, stats = time.perf_counter(), [{} for _ in chunks]
        for chunk, seed, stat in zip(chunks, seeds, stats):
            generate_ar(gpt, chunk, cfg_interval=cfg_interval, compile=compile, stats=stat,
                        **dict(sampling, seed=seed))
        return time.perf_counter() - t0, _compile_figures(stats)

    run_s = figures["wall_s"] - figures["compile_s"]
    wall, compiled = timed(baseline_compile(gpt.tok_embeddings.weight.device))
    out = dict(ar_wall_s=wall, ar_compile=compiled["compile"], ar_compile_s=compiled["compile_s"])
    out["speedup_vs_ar"] = (wall - compiled["compile_s"]) / run_s
    if compiled["compile"].startswith("on"):
        eager_s, _ = timed(False)
        out.update(ar_eager_wall_s=eager_s, speedup_vs_ar_eager=eager_s / run_s)
    return out


def _batch_size(batch, n_images: int) -> int:
    if batch is None:
        return n_images
    if batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {batch}")
    return min(batch, n_images)


def _cost_model(gpt, drafter, table, labels, options, sampling, figures):
    """tree=auto: the device's cost model (cached, or calibrated now, before the timed run)."""
    from .decoding import SpecConfig, resolve_cost_model

    config = SpecConfig(method=options["method"], k=options["k"], delta=options["delta"], lam=options["lam"],
                        budget=options["budget"], depth=options["depth"], draft=options["draft"],
                        **{key: options[key] for key in ("window", "coupling", "init") if key in options})
    model = resolve_cost_model(gpt, drafter, labels, table, config=config, cfg_interval=options["cfg_interval"],
                               **sampling)
    figures["cost_model"] = {"source": model.meta["source"], "path": model.meta["path"],
                             "calibration_s": round(model.meta.get("calibration_s", 0.0), 3)}
    return model


def _spec_figures(all_stats) -> dict:
    """Figures of the speculative batches together: tau, forwards, and per plan steps, expected and
    achieved tokens/s (tree=auto)."""
    emitted = sum(s.emitted for s in all_stats)
    row_steps = sum(s.row_steps for s in all_stats)
    out = dict(tau=emitted / max(row_steps, 1), target_forwards=sum(s.target_forwards for s in all_stats),
               draft_forwards=sum(s.draft_forwards for s in all_stats))
    counts = {}
    for s in all_stats:
        for name, n in s.plan_counts.items():
            counts[name] = counts.get(name, 0) + n
    out["plan_steps"] = counts
    plans = {}
    for s in all_stats:
        for name, rec in s.planner.get("plans", {}).items():
            acc = plans.setdefault(name, {"steps": 0, "probes": 0, "expected_tokens": 0.0, "predicted_s": 0.0,
                                          "tokens": 0, "measured_s": 0.0, "runner_up": {},
                                          "runner_up_tokens_per_s": 0.0, "ar_expected_tokens_per_s": 0.0,
                                          "mean_expected_tokens_per_s": 0.0})
            for key in ("steps", "probes", "expected_tokens", "predicted_s", "tokens", "measured_s"):
                acc[key] += rec[key]
            for key in ("runner_up_tokens_per_s", "ar_expected_tokens_per_s", "mean_expected_tokens_per_s"):
                acc[key] += (rec[key] or 0.0) * rec["steps"]
            if rec["runner_up"]:
                acc["runner_up"][rec["runner_up"]] = acc["runner_up"].get(rec["runner_up"], 0) + rec["steps"]
    for acc in plans.values():
        acc["expected_tokens_per_s"] = acc["expected_tokens"] / acc["predicted_s"] if acc["predicted_s"] else None
        acc["achieved_tokens_per_s"] = acc["tokens"] / acc["measured_s"] if acc["measured_s"] else None
        for key in ("runner_up_tokens_per_s", "ar_expected_tokens_per_s", "mean_expected_tokens_per_s"):
            acc[key] = acc[key] / acc["steps"] if acc["steps"] else None  # step-weighted means
        acc["runner_up"] = max(acc["runner_up"], key=acc["runner_up"].get) if acc["runner_up"] else None
    if plans:
        out["plans"] = plans
        out["chain_rate_per_depth"] = all_stats[-1].planner.get("chain_rate_per_depth")
    return out


def _print_figures(f: dict, args) -> None:
    print(f"{f['images']} images x {f['tokens_per_image']} tokens in {f['wall_s']:.2f}s: "
          f"{f['tokens_per_s']:.1f} tokens/s ({args.method}, {args.device}, {f['dtype']}, "
          f"{torch.get_num_threads()} threads)")
    if f.get("compile", "").startswith("on"):
        print(f"compiled {f['compile']}: {f['compiled_graphs']} graphs, {f['compile_s']:.2f}s of first calls "
              f"(compile included) in the wall time above")
    elif f.get("compile"):
        print(f"eager: compile {f['compile']}")
    if args.method != "ar":
        print(f"tau {f['tau']:.2f} tokens per target forward; {f['target_forwards']} target forwards, "
              f"{f['draft_forwards']} drafter forwards (batch {f['batch']})")
        if "cost_model" in f:
            cm = f["cost_model"]
            how = "read from the cache" if cm["source"] == "cache" else f"measured in {cm['calibration_s']:.1f}s"
            print(f"tree auto: cost model {how} ({cm['path']})")
        for name, p in sorted(f.get("plans", {}).items(), key=lambda kv: -kv[1]["steps"]):
            why = f"mean prediction per step: {name} {p['mean_expected_tokens_per_s']:.1f}"
            if p["runner_up"]:
                why += f", next best {p['runner_up']} {p['runner_up_tokens_per_s']:.1f}"
            if name != "ar":
                why += f", AR {p['ar_expected_tokens_per_s']:.1f}"
            if p["probes"]:
                why += f"; {p['probes']} steps only timed AR"
            print(f"  {name:>7}: {p['steps']:4d} steps, expected {p['expected_tokens_per_s']:7.1f} tokens/s, "
                  f"achieved {p['achieved_tokens_per_s']:7.1f} ({why})")
        if "speedup_vs_ar" in f:
            run_s = f["wall_s"] - f["compile_s"]
            kind = "compiled, same process, one-off compiles left out" if f["ar_compile"].startswith("on") else \
                "eager, same process"
            print(f"speed-up vs AR ({kind}): {f['speedup_vs_ar']:.2f}x "
                  f"({run_s:.2f}s against AR {f['ar_wall_s'] - f['ar_compile_s']:.2f}s"
                  + (f", AR compile {f['ar_compile_s']:.1f}s apart)" if f["ar_compile_s"] else ")"))
            if "speedup_vs_ar_eager" in f:
                print(f"speed-up vs eager AR: {f['speedup_vs_ar_eager']:.2f}x (eager AR {f['ar_eager_wall_s']:.2f}s)")
    if "class_accuracy" in f:
        print(f"classifier accuracy {100 * f['class_accuracy']:.1f}%  Frechet distance {f['fd']:.2f}")
    print(f"wrote {args.out}")
