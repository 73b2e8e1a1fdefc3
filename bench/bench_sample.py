"""`lantern sample` throughput: one process against ``torchrun --nproc_per_node 2`` (gloo, CPU), one thread
per process, on the shipped tiny model. The two are run in alternation, each into a fresh folder; printed:
medians over ``--repeats`` of the generation rate (images of the run / the slowest rank's generation wall
time, from the run's JSON) and of the whole command's wall time (process start, model loading and the final
gather included), and the ratios 2 processes / 1 process measured in the same run. Both runs' images are
checked to be identical.

    python -m bench.bench_sample [--images 24] [--batch 4] [--method ar] [--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _command(nproc: int, out: Path, args) -> list:
    sample = ["-m", "lantern", "sample", str(out), "--num-images", str(args.images), "--batch", str(args.batch),
              "--method", args.method, "--no-progress", *args.extra]
    if nproc == 1:
        return [sys.executable, *sample]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *sample]


def _one(nproc: int, out: Path, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(_command(nproc, out, args), capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc} process(es) failed:\n{proc.stderr[-3000:]}")
    run = json.loads((out / "runs" / "run-000.json").read_text())
    with np.load(out / "samples.npz") as data:
        images = data["arr_0"]
    return dict(command_s=wall, images_per_s=run["images_per_s"], images=images)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--method", default="ar")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("extra", nargs="*", help="more `lantern sample` options (after --)")
    args = p.parse_args(argv)
    results = {1: [], 2: []}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for nproc in (1, 2):
                r = _one(nproc, Path(tmp) / f"p{nproc}-{rep}", args)
                if reference is None:
                    reference = r["images"]
                if not np.array_equal(r["images"], reference):
                    raise RuntimeError(f"{nproc} process(es), repeat {rep}: other images than the first run's")
                results[nproc].append(r)
    medians = {n: {key: statistics.median(r[key] for r in rs) for key in ("images_per_s", "command_s")}
               for n, rs in results.items()}
    out = dict(images=args.images, batch=args.batch, method=args.method, repeats=args.repeats,
               load_average=os.getloadavg(), medians={str(n): m for n, m in medians.items()},
               rate_ratio=medians[2]["images_per_s"] / medians[1]["images_per_s"],
               command_speedup=medians[1]["command_s"] / medians[2]["command_s"], identical_images=True)
    print(f"lantern sample, tiny model, {args.method}, {args.images} images, batch {args.batch}, 1 thread per "
          f"process, medians of {args.repeats} (load average {out['load_average'][0]:.2f}):")
    for n in (1, 2):
        print(f"  {n} process{'es' if n > 1 else '  '}: {medians[n]['images_per_s']:6.2f} images/s generating, "
              f"{medians[n]['command_s']:6.1f} s for the whole command")
    print(f"  2 processes / 1: {out['rate_ratio']:.2f}x the generation rate, {out['command_speedup']:.2f}x faster "
          f"end to end; the images are identical")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
