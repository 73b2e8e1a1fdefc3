"""`lantern generate`: sample images, write a PNG grid, print throughput (and quality for the tiny model)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from .. import sources
from ..decoding.compiled import COMPILE_CHOICES
from ..sample_options import check_method_options
from .options import add_device_options, add_method_options, add_model_options, add_sampling_options

MAX_PER_CLASS = 1024  # lantern generate writes one grid; lantern sample makes many images
MAX_REPEATS = 100
_clock = time.perf_counter  # the run's and the speed rounds' clock


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
    spec.add_argument("--repeats", type=int, default=1, metavar="N",
                      help="speed-up rounds after the image run, each timing the run again, compiled AR and eager "
                           "AR in turn; the speed-ups are ratios of the medians (discrete speculative methods)")
    run.add_argument("--batch", type=int, metavar="N", help="generate N images at a time (default: all at once); "
                     "batch i samples with seed + i, and the AR baseline uses the same batches")
    add_device_options(run)
    run.add_argument("--out", default="samples.png", metavar="PATH", help="image grid to write (.png, .jpg, ...; "
                     "its folder must exist)")
    run.add_argument("--json", metavar="PATH", help="also write the run's figures as JSON (.json; a figure that is "
                     "not a number, e.g. the Frechet distance of one image, is null)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    from ..hf.cli import add_hf_options

    add_hf_options(p)
    return p


def check_options(args) -> None:
    """Before any model is loaded: every given option applies to the chosen model, the counts are
    positive, and the output files can be written. SystemExit naming the option otherwise. Then the
    defaults of the model options are filled in."""
    if not 1 <= args.per_class <= MAX_PER_CLASS:
        raise SystemExit(f"--per-class must be >= 1 and at most {MAX_PER_CLASS} (one grid; lantern sample makes "
                         f"many images), got {args.per_class}")
    check_method_options(args, args.parser_default)
    if args.repeats != 1:
        if not 1 <= args.repeats <= MAX_REPEATS:
            raise SystemExit(f"--repeats must be >= 1 and at most {MAX_REPEATS}, got {args.repeats}")
        if args.method in ("ar", "cspd") or sources.is_mar(args) or args.no_ar_baseline:
            raise SystemExit("--repeats applies to the speculative methods of the discrete models with their AR "
                             "baseline (spec, lantern, sjd without --no-ar-baseline)")
    check_outputs(args)


def check_outputs(args) -> None:
    """--out (an image) and --json (JSON) can be written (their extensions differ, so never the same file)."""
    from ..outputs import check_output_path, image_suffixes

    check_output_path(args.out, "--out", image_suffixes(), "an image file")
    if args.json is not None:
        check_output_path(args.json, "--json", [".json"], "a JSON file")


def run_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .._backend import enable_fused
    from ..decoding import generate_ar
    from ..images import save_grid
    from ..outputs import write_json

    if getattr(args, "hf", None):  # a transformers model directory: lantern.hf
        from ..hf.cli import run_generate_hf

        return run_generate_hf(args)
    check_options(args)
    if args.method == "cspd" and not sources.is_mar(args):
        raise SystemExit("--method cspd (continuous speculative decoding) is for MAR models: --model tiny-mar or "
                         "mar-checkpoint")
    if sources.is_mar(args):
        from .generate_mar import run_generate_mar

        return run_generate_mar(args)
    if args.fused:
        enable_fused(args.fused)
    gpt, vq, meta = sources.load_discrete(args)
    cfg_scale, top_k = sources.guidance_and_top_k(args, meta)
    classes = args.classes or (list(range(gpt.config.num_classes)) if args.model == "tiny"
                               else sources.LLAMAGEN_DEMO_CLASSES)
    sources.check_classes(classes, gpt.config.num_classes)
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
        drafter, table = sources.drafter_and_table(args, gpt, vq)
        options = dict(method=args.method, drafter=drafter, neighbours=table, cfg_interval=args.cfg_interval,
                       **sources.method_options(args))
        if args.tree == "auto":
            options["cost_model"] = _cost_model(gpt, drafter, table, chunks[0], options, sampling, figures)
    bar = tqdm(total=len(labels) * L, desc=f"{args.method}: {len(labels)} images", disable=args.no_progress, unit="tok")
    t0 = _clock()
    if args.method == "ar":
        tokens = torch.cat([generate_ar(gpt, chunk, cfg_interval=args.cfg_interval,
                                        on_token=lambda s, n=len(chunk): bar.update(n), compile=compile,
                                        stats=stat, **dict(sampling, seed=seed))
                            for chunk, seed, stat in zip(chunks, seeds, compile_stats)])
        figures.update(tau=1.0, target_forwards=L * len(chunks), draft_forwards=0)
        figures.update(_compile_figures(compile_stats))
    else:
        tokens, all_stats = _speculative(gpt, chunks, seeds, options, compile, sampling,
                                         on_chunk=lambda chunk: bar.update(len(chunk) * L))
        figures.update(_spec_figures(all_stats), tree=args.tree, k=args.k, delta=args.delta, lam=args.lam,
                       budget=args.budget)
        figures.update(_compile_figures([vars(st) for st in all_stats]))
    figures["wall_s"] = _clock() - t0
    bar.close()
    figures["tokens_per_s"] = len(labels) * L / figures["wall_s"]
    if args.method != "ar" and not args.no_ar_baseline:
        rerun = lambda: _speculative(gpt, chunks, seeds, options, compile, sampling)[1]  # noqa: E731
        figures.update(_speed_rounds(rerun, gpt, chunks, seeds, sampling, args.cfg_interval, args.repeats))
    figures.update(_package_figures())
    side = gpt.config.grid_size
    with torch.no_grad():
        images = vq.decode_codes(tokens, side, side)  # [B, 3, H, W]
    pixels = vq.to_uint8(images).cpu()
    save_grid(pixels, rows=len(classes), path=args.out, scale=max(1, 128 // pixels.shape[1]))
    if args.model == "tiny":
        from ..tiny.evaluate import evaluate_samples

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


def _package_figures() -> dict:
    """The AOT-compiled packages this process compiled (the one-off cost, once per machine) and loaded
    (``decoding.aot``), where it used any."""
    from ..decoding import aot

    packages = aot.process_summary()
    return {"aot_packages": packages} if packages["compiled"] or packages["loaded"] else {}


def _speculative(gpt, chunks, seeds, options, compile, sampling, on_chunk=None):
    """The speculative run over the batches: (tokens [B, L], each batch's SpecStats)."""
    from ..decoding import generate

    parts, all_stats = [], []
    for chunk, seed in zip(chunks, seeds):
        part, stats = generate(gpt, chunk, **options, compile=compile, **dict(sampling, seed=seed))
        parts.append(part)
        all_stats.append(stats)
        if on_chunk is not None:
            on_chunk(chunk)
    return torch.cat(parts), all_stats


def _speed_rounds(rerun, gpt, chunks, seeds, sampling, cfg_interval, repeats: int) -> dict:
    """The speed-ups against AR: ``repeats`` rounds after the image run, each timing the speculative run
    again and AR compiled wherever torch.compile works (the fastest AR lantern runs on the device,
    ``compiled.baseline_compile``), in turn first; then, when that AR is compiled, ``repeats`` runs of eager
    AR; ratios of the medians. The image
    run is not timed against them: it is the process's first run (cold caches, first allocations, the
    cost model's calibration before it), while every contender of a round runs warm. Each time leaves out
    the one-off compiles (first calls of new graphs), reported apart."""
    from ..decoding import generate_ar
    from ..decoding.compiled import baseline_compile

    def timed_ar(compile):
        t0, stats = _clock(), [{} for _ in chunks]
        for chunk, seed, stat in zip(chunks, seeds, stats):
            generate_ar(gpt, chunk, cfg_interval=cfg_interval, compile=compile, stats=stat,
                        **dict(sampling, seed=seed))
        figures = _compile_figures(stats)
        return _clock() - t0 - figures["compile_s"], figures

    def timed_run():
        t0 = _clock()
        stats = rerun()
        return _clock() - t0 - _compile_figures([vars(st) for st in stats])["compile_s"]

    ar_choice = baseline_compile(gpt.tok_embeddings.weight.device)
    run_s, ar_s, eager_s, ar_compile = [], [], [], None

    def time_ar():
        nonlocal ar_compile
        seconds, figures = timed_ar(ar_choice)
        ar_s.append(seconds)
        ar_compile = ar_compile or figures

    for i in range(repeats):  # the two take turns going first
        for contender in ((lambda: run_s.append(timed_run())), time_ar)[:: 1 if i % 2 == 0 else -1]:
            contender()
    if ar_compile["compile"].startswith("on"):  # apart: a slow eager run leaves the caches cold for the next
        eager_s = [timed_ar(False)[0] for _ in range(repeats)]
    out = dict(rounds=repeats, run_s=statistics.median(run_s), ar_s=statistics.median(ar_s),
               ar_compile=ar_compile["compile"], ar_compile_s=ar_compile["compile_s"])
    out["speedup_vs_ar"] = out["ar_s"] / out["run_s"]
    if eager_s:
        out.update(ar_eager_s=statistics.median(eager_s), speedup_vs_ar_eager=statistics.median(eager_s) / out["run_s"])
    return out


def _batch_size(batch, n_images: int) -> int:
    if batch is None:
        return n_images
    if batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {batch}")
    return min(batch, n_images)


def _cost_model(gpt, drafter, table, labels, options, sampling, figures):
    """tree=auto: the device's cost model (cached, or calibrated now, before the timed run)."""
    from ..decoding import SpecConfig, aot, resolve_cost_model

    compiled_before = aot.process_summary()["compile_s"]
    config = SpecConfig(method=options["method"], k=options["k"], delta=options["delta"], lam=options["lam"],
                        budget=options["budget"], depth=options["depth"], draft=options["draft"],
                        **{key: options[key] for key in ("window", "coupling", "init") if key in options})
    model = resolve_cost_model(gpt, drafter, labels, table, config=config, cfg_interval=options["cfg_interval"],
                               **sampling)
    figures["cost_model"] = {"source": model.meta["source"], "path": model.meta["path"],
                             "calibration_s": round(model.meta.get("calibration_s", 0.0), 3),
                             "compile_s": round(aot.process_summary()["compile_s"] - compiled_before, 3)}
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
        out["whole_run_plans"] = all(s.planner.get("whole_run") for s in all_stats)
    return out


def _print_figures(f: dict, args) -> None:
    print(f"{f['images']} images x {f['tokens_per_image']} tokens in {f['wall_s']:.2f}s: "
          f"{f['tokens_per_s']:.1f} tokens/s ({args.method}, {args.device}, {f['dtype']}, "
          f"{torch.get_num_threads()} threads)")
    if f.get("compile"):
        graphs = f.get("compiled_graphs", 0)
        print(f"compile {f['compile']}" + (f": {graphs} graphs, {f['compile_s']:.2f}s of first calls (compile "
                                           f"included) in the wall time above" if graphs else ""))
    if "aot_packages" in f:
        p = f["aot_packages"]
        loaded = f"{p['loaded']} loaded in {p['load_s']:.2f}s"
        print(f"compiled forwards: {p['compiled']} packages compiled in {p['compile_s']:.1f}s (once per machine: later "
              f"processes load them), {loaded}" if p["compiled"] else f"compiled forwards: {loaded} from the cache")
    if args.method != "ar":
        print(f"tau {f['tau']:.2f} tokens per target forward; {f['target_forwards']} target forwards, "
              f"{f['draft_forwards']} drafter forwards (batch {f['batch']})")
        if "cost_model" in f:
            cm = f["cost_model"]
            how = "read from the cache" if cm["source"] == "cache" else f"measured in {cm['calibration_s']:.1f}s"
            if cm.get("compile_s"):
                how += f", {cm['compile_s']:.1f}s of it compiling the forwards' packages"
            print(f"tree auto: cost model {how} ({cm['path']})")
        whole = "prediction for the whole run" if f.get("whole_run_plans") else "mean prediction per step"
        for name, p in sorted(f.get("plans", {}).items(), key=lambda kv: -kv[1]["steps"]):
            why = f"{whole}: {name} {p['mean_expected_tokens_per_s']:.1f}"
            if p["runner_up"]:
                why += f", next best {p['runner_up']} {p['runner_up_tokens_per_s']:.1f}"
            if name != "ar":
                why += f", AR {p['ar_expected_tokens_per_s']:.1f}"
            if p["probes"]:
                why += f"; {p['probes']} steps only timed AR"
            print(f"  {name:>7}: {p['steps']:4d} steps, expected {p['expected_tokens_per_s']:7.1f} tokens/s, "
                  f"achieved {p['achieved_tokens_per_s']:7.1f} ({why})")
        if "speedup_vs_ar" in f:
            kind = "compiled" if f["ar_compile"].startswith("on") else "eager"
            rounds = f"median of {f['rounds']} alternated rounds" if f["rounds"] > 1 else "one round"
            print(f"speed-up vs AR ({kind}; {rounds} after the image run, same process, one-off compiles left out): "
                  f"{f['speedup_vs_ar']:.2f}x ({f['run_s']:.2f}s against AR {f['ar_s']:.2f}s"
                  + (f", AR compile {f['ar_compile_s']:.1f}s apart)" if f["ar_compile_s"] else ")"))
            if "speedup_vs_ar_eager" in f:
                print(f"speed-up vs eager AR: {f['speedup_vs_ar_eager']:.2f}x (eager AR {f['ar_eager_s']:.2f}s)")
            if set(f.get("plan_steps", {})) == {"ar"}:
                print("every step was AR (tree auto found no plan faster than AR on this machine): the speed-up vs "
                      "AR compares AR with AR")
    if "class_accuracy" in f:
        print(f"classifier accuracy {100 * f['class_accuracy']:.1f}%  Frechet distance {f['fd']:.2f}")
    print(f"wrote {args.out}")
