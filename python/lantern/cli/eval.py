"""`lantern eval`: quality figures of a `lantern sample` folder or an ADM-layout .npz (``sample_eval``)."""
from __future__ import annotations

import argparse

import torch

from .. import sample_eval
from ..sample_eval import (
    INCEPTION_HINT,
    MAX_EVAL_BATCH,
    REFERENCE_HINT,
    check_inception_weights,
    inception_figures,
    load_samples,
    read_npz_images,
    require_fidelity,
    settings_classes,
    tiny_figures,
)


def run_eval(args: argparse.Namespace) -> int:
    from ..outputs import check_output_path, write_json

    if args.json:
        check_output_path(args.json, "--json", [".json"], "a JSON file")
    _check_eval_options(args)
    images, settings = load_samples(args.samples)
    metrics = args.metrics
    if metrics == "auto":
        model = (settings or {}).get("model")
        metrics = "tiny" if model in ("tiny", "tiny-mar") else "inception"
    if metrics == "tiny":
        classes = args.classes or settings_classes(settings)
        if classes is None:
            raise SystemExit("--classes is needed for an .npz without a sample folder's config.json (image i has "
                             "class classes[i mod len(classes)])")
        figures = tiny_figures(images, classes)
        print(f"{figures['n']} images: classifier accuracy {100 * figures['class_accuracy']:.1f}%  Frechet distance "
              f"{figures['fd']:.2f} (real-image floor at this n: {figures.get('fd_real_floor', float('nan')):.2f})")
    else:
        if args.reference is None:
            raise SystemExit(f"--reference PATH is needed for FID / IS / precision / recall: {REFERENCE_HINT}")
        reference = read_npz_images(args.reference, "--reference")
        check_inception_weights(args.inception)
        require_fidelity()
        figures = inception_figures(images, reference, args.inception, device=args.device, batch=args.batch)
        print(f"{figures['n']} images vs {figures['reference_n']} reference: FID {figures['fid']:.2f}  IS "
              f"{figures['inception_score']:.2f}  precision {figures['precision']:.3f}  recall {figures['recall']:.3f}")
    figures["metrics"] = metrics
    figures["samples"] = str(args.samples)
    if args.json:
        write_json(args.json, figures)
        print(f"wrote {args.json}")
    return 0


def _check_eval_options(args) -> None:
    """The numbers and the device, before any file is read. SystemExit naming the option."""
    if not 1 <= args.batch <= MAX_EVAL_BATCH:
        raise SystemExit(f"--batch must be in [1, {MAX_EVAL_BATCH}], got {args.batch}")
    if args.classes is not None and any(c < 0 for c in args.classes):
        raise SystemExit(f"--classes must be class ids >= 0, got {args.classes}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        raise SystemExit(f"--device {args.device!r} is not a device ({e})") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")


def add_eval_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="quality of sampled images: tiny models' accuracy / FD, official models' FID / IS / "
                            "precision / recall (user-supplied reference batch and Inception weights)",
                       description=sample_eval.__doc__)
    p.add_argument("samples", metavar="PATH", help="a lantern sample folder, or an .npz with arr_0 uint8 [N, H, W, 3]")
    p.add_argument("--metrics", default="auto", choices=["auto", "tiny", "inception"],
                   help="auto: tiny for the tiny models' folders, inception otherwise")
    p.add_argument("--classes", type=int, nargs="+", help="tiny metrics of a bare .npz: classes cycled over the ids")
    p.add_argument("--reference", metavar="NPZ", help=f"inception metrics: {REFERENCE_HINT}")
    p.add_argument("--inception", metavar="PATH", help=f"inception metrics: {INCEPTION_HINT}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64, help="images per Inception forward")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p
