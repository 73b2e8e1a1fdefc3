"""`lantern sample`: the command line of ``lantern.sample`` (``sampling``): its options build the job's
``SampleSettings``, which the library checks and runs."""
from __future__ import annotations

import argparse
from dataclasses import fields

from ..sample_settings import DEFAULT_BATCH, DEFAULT_THREADS, SampleSettings, default_of
from .options import add_device_options, add_method_options, add_model_options, add_sampling_options


def settings_of(args: argparse.Namespace) -> SampleSettings:
    """The parsed options as the job's settings (the parser's destinations are the settings' names)."""
    return SampleSettings(**{f.name: getattr(args, f.name) for f in fields(SampleSettings)})


def run_sample(args: argparse.Namespace) -> int:
    from ..sampling import run_sample as run

    run(settings_of(args))
    return 0


def add_sample_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sample", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="many images for evaluation (torchrun data-parallel, resumable): PNGs + one .npz (ADM layout)",
        description="Generate --num-images images into DIR: images/<id>.png, shards/<block>.npz, "
                    "samples.npz (arr_0 uint8 [N, H, W, 3] in id order, the ADM evaluation suite's input), "
                    "config.json and runs/run-<k>.json (tau, forwards, wall time per rank). Launch with "
                    "`torchrun --nproc_per_node N -m lantern sample ...` for N processes (nccl on GPUs, gloo "
                    "on CPUs) or plainly for one. Image i has class classes[i mod len(classes)] (--hf DIR: prompt "
                    "prompts[i mod len(prompts)]). Reproducibility: "
                    "the same settings and numerics (dtype, --fused, --compile, device type and processor, torch "
                    "version, --threads; all recorded in config.json) give bit-identical images whatever the "
                    "number of processes, the order of the blocks and restarts; --resume and ranks with other "
                    "numerics are refused. --batch changes the images only through the last bits the machine's "
                    "matrix products give a row in batches of other shapes: none where they are row-invariant, "
                    "else rare tokens. A killed run continues with --resume (damaged shards are named and made "
                    "again); config.json records the sha256 of each weight file, so a resume with other weights "
                    "is refused. A running job locks DIR (DIR/.lock): a second start there is refused. Every "
                    "option is checked before anything is loaded or written. docs/sampling.md \"Numerics\".")
    p.add_argument("out", metavar="DIR", help="output folder (new or empty; with --resume: a run's folder)")
    p.add_argument("--num-images", type=int, required=True, help="images to generate (ids 0..N-1)")
    p.add_argument("--resume", action="store_true", help="continue the run in DIR (its settings must match)")
    add_model_options(p)
    from ..hf.cli import add_hf_options

    add_hf_options(p, sample=True)
    add_sampling_options(p, classes_help="classes cycled over the image ids (default: every class of the model)")
    run = p.add_argument_group("run")
    add_method_options(p, run)
    run.add_argument("--batch", type=int, metavar="B", help=f"images per block (one batch; the images depend on "
                     f"it only through the machine's rounding, but the folder's shards do, so a resume needs the "
                     f"same; default {DEFAULT_BATCH})")
    add_device_options(run)
    run.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                     help="torch threads per process, pinned and recorded (matrix products may split their sums "
                          "by thread, so the images depend on it; the default is what torchrun gives each process, "
                          "so one process and torchrun compute alike)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(tree=default_of("tree"))
    return p
