"""`lantern sample`: many images, data-parallel over ``torchrun`` ranks, written as resumable shards plus one
``.npz`` that the ADM evaluation suite reads (docs/sampling.md).

Image ids 0..N-1 are cut into blocks of ``batch`` consecutive ids; block j goes to rank j mod world_size and
is generated as one batch. Image i has class ``classes[i mod len(classes)]``. Every method keys its random
numbers by the job's seed and the image id itself (``lantern.generate``'s ``image_ids``), so an image depends
on the settings and the numerics (dtype, fused backend, compile, device and processor, torch, thread count:
``numerics_of``, pinned by ``--threads``), never on the world size, the rank, the order the blocks run in, or
a restart; on the batch size only through the last bits the machine's matrix products give a row in batches
of other shapes (docs/sampling.md "Numerics"). The batch size stays in config.json as the folder's block
layout (shard j holds block j).

Layout of DIR: config.json (the settings), images/<id>.png, shards/<block>.npz (ids, uint8 images: a
block's completion mark, written last and atomically), runs/run-<k>.json (one per run: tau, forwards, wall
time per rank), samples.npz (arr_0 = uint8 [N, H, W, 3] in id order, written once every block is there).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

FORMAT = 3  # of config.json and the folder layout (2: discrete images keyed by image id; 3: the numerics record)
CONFIG_FILE, IMAGES, SHARDS, RUNS, NPZ_FILE = "config.json", "images", "shards", "runs", "samples.npz"
DEFAULT_BATCH = 16
DEFAULT_THREADS = 1  # what torchrun gives each process: one process and N processes compute alike by default
MAX_THREADS = 1024
STOP_AFTER_ENV = "LANTERN_SAMPLE_STOP_AFTER"  # tests: rank 0 SIGKILLs itself after that many of its blocks
_TMP_PREFIX = ".tmp-"
_SHARD_NAME = re.compile(r"^(\d+)\.npz$")


# ---------------------------------------------------------------------------------------------- ranks


@dataclass
class Ranks:
    """This process's place in the job (world 1: a single process, no process group)."""
    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_ranks(device: str):
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK -> (Ranks, this rank's device). With more than one process
    it joins the process group: nccl on CUDA (device cuda:LOCAL_RANK), gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks(), device
    import torch.distributed as dist

    ranks = Ranks(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if torch.device(device).type == "cuda":
        device = f"cuda:{ranks.local}"
        torch.cuda.set_device(ranks.local)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        # the final barrier waits for the slowest rank's last block: a long timeout
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=6))
    return ranks, device


def _broadcast(value, ranks: Ranks):
    """rank 0's value on every rank."""
    if not ranks.distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value, ranks: Ranks) -> list:
    if not ranks.distributed:
        return [value]
    import torch.distributed as dist

    out = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def _barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        import torch.distributed as dist

        dist.barrier()


# ---------------------------------------------------------------------------------------------- ids and seeds


def block_ids(j: int, n: int, batch: int) -> torch.Tensor:
    """The image ids of block j: [j * batch, min((j + 1) * batch, n)) as int64."""
    return torch.arange(j * batch, min((j + 1) * batch, n), dtype=torch.int64)


def block_count(n: int, batch: int) -> int:
    return -(-n // batch)


def rank_blocks(n_blocks: int, ranks: Ranks) -> List[int]:
    """Blocks j with j mod world == rank (interleaved: every rank's share ends within one block of the others')."""
    return list(range(ranks.rank, n_blocks, ranks.world))


def labels_of(ids: torch.Tensor, classes: Sequence[int]) -> torch.Tensor:
    """Class of each image id: classes[id mod len(classes)] -> int64 [len(ids)]."""
    table = torch.tensor(list(classes), dtype=torch.int64)
    return table[ids % len(table)]


# ---------------------------------------------------------------------------------------------- numerics


def processor_name() -> str:
    """The CPU's model name (/proc/cpuinfo; platform.processor() elsewhere)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """torch's CPU kernel level (torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...) and the
    instruction sets its math libraries choose other kernels for (bf16 dot products, AMX)."""
    features = [name for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"),
                                         ("amx_tile", "_is_amx_tile_supported"),
                                         ("amx_fp16", "_is_amx_fp16_supported"))
                if getattr(torch.cpu, probe, lambda: False)()]
    return "+".join([torch.backends.cpu.get_cpu_capability(), *features])


def numerics_of(args, sampler) -> dict:
    """What the images depend on besides the settings (config.json "numerics", docs/sampling.md "Numerics"):
    the model's dtype, the backend of each lantern op (``--fused``), ``--compile``, the device type and
    processor (GPU name and CUDA version, or CPU model, capability and thread count), torch's and lantern's
    versions. Every rank computes its own; a rank or a resume with other numerics is refused."""
    from . import __version__
    from ._backend import resolved_backends

    device = torch.device(args.device)
    model = getattr(sampler, "gpt", None) or getattr(sampler, "mar")
    try:
        fused = resolved_backends(device)
    except RuntimeError as e:  # a backend for another device type
        raise SystemExit(f"--fused {args.fused}: {e}") from e
    record = dict(dtype=str(next(model.parameters()).dtype).replace("torch.", ""), fused=fused,
                  compile=bool(args.compile), device=device.type, torch=torch.__version__, lantern=__version__)
    if device.type == "cuda":
        record.update(processor=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        record.update(processor=processor_name(), cpu_capability=cpu_capability(), threads=torch.get_num_threads())
    return record


def check_threads(threads) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise SystemExit(f"--threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")
    return threads


def _check_rank_numerics(numerics: list) -> None:
    """Rank 0: SystemExit naming each rank whose numerics differ from rank 0's, and how."""
    lines = [f"rank {rank}: {'; '.join(_differences(numerics[0], theirs, 'rank 0', f'rank {rank}'))}"
             for rank, theirs in enumerate(numerics) if theirs != numerics[0]]
    if lines:
        raise SystemExit("the ranks would compute the images with other numerics (docs/sampling.md \"Numerics\"): "
                         + " | ".join(lines) + ". Run every rank with the same --dtype, --fused, --compile and "
                         "--threads on machines of one kind")


# ---------------------------------------------------------------------------------------------- the folder


def _atomic_write(path: Path, write) -> None:
    """write(file object) into a temporary file beside ``path``, then rename it onto ``path`` (a reader sees
    the whole file or none)."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class SampleFolder:
    """DIR's files (module docstring)."""

    def __init__(self, root):
        self.root = Path(root)
        self.images, self.shards, self.runs = self.root / IMAGES, self.root / SHARDS, self.root / RUNS

    def check_writable(self) -> None:
        """SystemExit naming DIR unless it is (or can be made) a folder that takes new files."""
        if self.root.exists() and not self.root.is_dir():
            raise SystemExit(f"output folder {str(self.root)!r} is a file; give a folder")
        parent = self.root if self.root.exists() else self.root.parent
        while not parent.exists():
            parent = parent.parent
        try:
            with tempfile.TemporaryFile(dir=parent):
                pass
        except OSError as e:
            raise SystemExit(f"output folder {str(self.root)!r} cannot be written ({parent}: "
                             f"{e.strerror or e})") from e

    def prepare(self, settings: dict, resume: bool) -> int:
        """Rank 0, before any image: check DIR against ``settings`` (docs/sampling.md "Resume"), create it and
        its config, remove temporary files a killed run left. -> blocks already done. SystemExit when DIR
        holds another run, or any run without ``resume``."""
        saved = self._saved_settings()
        if saved is None:
            if self.root.exists() and any(self.root.iterdir()):
                raise SystemExit(f"output folder {str(self.root)!r} is not empty and holds no {CONFIG_FILE} of a "
                                 f"lantern sample run; give a new or empty folder")
        else:
            differing = _differences(saved, settings)
            if differing:
                verb = "cannot resume it" if resume else "refusing to write into it"
                raise SystemExit(f"output folder {str(self.root)!r} holds a run with other settings; {verb}. "
                                 f"Differing: {'; '.join(differing)}. Give a new folder, or the run's settings")
            if not resume:
                done = len(self.done_blocks())
                raise SystemExit(f"output folder {str(self.root)!r} already holds this run ({done} blocks done); "
                                 f"pass --resume to continue it, or give a new folder")
        for folder in (self.root, self.images, self.shards, self.runs):
            folder.mkdir(parents=True, exist_ok=True)
        if saved is None:
            text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
            _atomic_write(self.root / CONFIG_FILE, lambda f: f.write(text.encode()))
        for folder in (self.root, self.images, self.shards, self.runs):
            for stray in folder.glob(_TMP_PREFIX + "*"):
                stray.unlink()
        return len(self.done_blocks())

    def _saved_settings(self) -> Optional[dict]:
        path = self.root / CONFIG_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path} cannot be read as JSON ({e}); give a new folder") from e

    def done_blocks(self) -> set:
        """Blocks whose shard exists (written last and atomically: the block is complete)."""
        if not self.shards.exists():
            return set()
        return {int(m.group(1)) for m in map(_SHARD_NAME.match, os.listdir(self.shards)) if m}

    def png_path(self, image_id: int) -> Path:
        return self.images / f"{image_id:06d}.png"

    def shard_path(self, j: int) -> Path:
        return self.shards / f"{j:06d}.npz"

    def write_block(self, j: int, ids: torch.Tensor, pixels: np.ndarray) -> None:
        """pixels uint8 [b, H, W, 3] of ids [b]: each PNG, then the shard (atomically, each)."""
        from PIL import Image

        for image_id, picture in zip(ids.tolist(), pixels):
            _atomic_write(self.png_path(image_id), lambda f, p=picture: Image.fromarray(p).save(f, format="PNG"))
        ids_np = ids.numpy().astype(np.int64)
        _atomic_write(self.shard_path(j), lambda f: np.savez(f, ids=ids_np, images=pixels))

    def gather(self, n: int, batch: int) -> Path:
        """Check that the shards hold each id of 0..n-1 exactly once (and each PNG is there), then write
        samples.npz (arr_0 uint8 [n, H, W, 3] in id order) block by block, atomically. -> its path."""
        n_blocks = block_count(n, batch)
        counts = np.zeros(n, dtype=np.int64)
        stray = []
        shape = None
        for j in sorted(self.done_blocks()):
            with np.load(self.shard_path(j)) as shard:
                ids, images = shard["ids"], shard["images"]
            inside = ids[(ids >= 0) & (ids < n)]
            stray += ids[(ids < 0) | (ids >= n)].tolist()
            np.add.at(counts, inside, 1)
            shape = shape or images.shape[1:]
            if images.shape[1:] != shape or images.dtype != np.uint8 or len(images) != len(ids):
                raise RuntimeError(f"shard {self.shard_path(j)}: images {images.dtype} {images.shape} do not "
                                   f"match ids {ids.shape} and uint8 [*, {shape}]")
        _check_counts(counts, stray, n)
        missing_png = [i for i in range(n) if not self.png_path(i).exists()]
        if missing_png:
            raise RuntimeError(f"{len(missing_png)} PNG files are missing, e.g. ids {missing_png[:10]}")
        path = self.root / NPZ_FILE
        _atomic_write(path, lambda f: self._write_npz(f, n, n_blocks, shape))
        return path

    def _write_npz(self, f, n: int, n_blocks: int, shape) -> None:
        """np.savez's layout (a stored zip member arr_0.npy), streamed one shard at a time."""
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
                  "shape": (n, *shape)}
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                for j in range(n_blocks):
                    with np.load(self.shard_path(j)) as shard:
                        member.write(np.ascontiguousarray(shard["images"]).tobytes())

    def write_run(self, record: dict) -> Path:
        """runs/run-<k>.json, k = the runs before it."""
        from .outputs import finite_or_none

        k = len(list(self.runs.glob("run-*.json")))
        path = self.runs / f"run-{k:03d}.json"
        text = json.dumps(finite_or_none(record), indent=2, allow_nan=False) + "\n"
        _atomic_write(path, lambda f: f.write(text.encode()))
        return path


def _check_counts(counts: np.ndarray, stray: list, n: int) -> None:
    """RuntimeError naming the ids that appear twice, never, or outside 0..n-1."""
    duplicated = np.flatnonzero(counts > 1).tolist()
    missing = np.flatnonzero(counts == 0).tolist()
    problems = []
    if stray:
        problems.append(f"ids outside [0, {n}): {stray[:10]}")
    if duplicated:
        problems.append(f"{len(duplicated)} duplicated ids, e.g. {duplicated[:10]}")
    if missing:
        problems.append(f"{len(missing)} missing ids, e.g. {missing[:10]}")
    if problems:
        raise RuntimeError(f"the shards do not hold each of the {n} images exactly once: " + "; ".join(problems))


def _flat(settings: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys ({"numerics": {"threads": 1}} -> {"numerics.threads": 1})."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _differences(saved: dict, now: dict, was: str = "the folder's run", is_: str = "now") -> List[str]:
    """Each differing setting (nested ones by dotted name) with both values."""
    saved, now = _flat(saved), _flat(now)
    keys = sorted(set(saved) | set(now))
    return [f"{key} ({was}: {saved.get(key, '<unset>')!r}, {is_}: {now.get(key, '<unset>')!r})"
            for key in keys if saved.get(key) != now.get(key)]


# ---------------------------------------------------------------------------------------------- samplers


class DiscreteSampler:
    """A LlamaGen-architecture model through ``lantern.generate`` (ar, spec, lantern, sjd)."""

    def __init__(self, args):
        from . import generate_cli as gc

        self.gpt, self.vq, meta = gc._load(args)
        cfg_scale, top_k = gc.guidance_and_top_k(args, meta)
        self.num_classes = self.gpt.config.num_classes
        self.sampling = dict(cfg_scale=cfg_scale, temperature=args.temperature, top_k=top_k, top_p=args.top_p,
                             cfg_interval=args.cfg_interval)
        self.method, self.L = args.method, self.gpt.config.block_size
        self.options = dict(method=args.method, compile=args.compile)
        self.settings = dict(self.sampling)
        if args.method != "ar":
            drafter, table = gc._drafter_and_table(args, self.gpt, self.vq)
            spec = gc.method_options(args)
            self.settings.update(spec)
            self.options.update(spec, drafter=drafter, neighbours=table)
        self.args = args

    @torch.no_grad()
    def sample(self, ids: torch.Tensor, labels: torch.Tensor, seed: int):
        """-> (uint8 [b, H, W, 3] numpy, the block's counts). Every draw is keyed by (seed, image id)."""
        from .decoding import generate

        tokens, stats = generate(self.gpt, labels.to(self.args.device), **self.options, **self.sampling,
                                 seed=seed, image_ids=ids)
        side = self.gpt.config.grid_size
        # one image at a time: a pixel depends on its image's tokens, not on the rows decoded beside them
        pixels = np.concatenate([self.vq.to_uint8(self.vq.decode_codes(row[None], side, side)).cpu().numpy()
                                 for row in tokens])
        b = len(ids)
        if stats is None:  # AR: one target forward per token
            counts = dict(emitted=b * self.L, row_steps=b * self.L, target_forwards=self.L, draft_forwards=0)
        else:
            counts = dict(emitted=stats.emitted, row_steps=stats.row_steps, target_forwards=stats.target_forwards,
                          draft_forwards=stats.draft_forwards)
            for name, steps in stats.plan_counts.items():
                counts[f"plan_steps_{name}"] = steps
        return pixels, counts

    @staticmethod
    def figures(counts: dict, images: int) -> dict:
        return dict(tau=counts.get("emitted", 0) / max(counts.get("row_steps", 0), 1), **counts)


class MARSampler:
    """A MAR model through ``lantern.generate`` (ar: target-only MAR; cspd), every number keyed by image id."""

    def __init__(self, args):
        from . import generate_mar_cli as gm

        gm._check_options(args)
        self.config = gm._cspd_config(args) if args.method == "cspd" else None
        self.mar, self.drafter, self.vae, defaults, _ = gm._load(args)
        cfg, num_iter, schedule = gm.mar_settings(args, self.mar, defaults, self.config)
        self.num_classes = self.mar.config.class_num
        self.sampling = dict(cfg_scale=cfg, temperature=args.temperature, num_iter=num_iter, cfg_schedule=schedule)
        self.settings = dict(self.sampling, diffusion_steps=self.mar.diffloss.gen_diffusion.num_timesteps)
        self.options = dict(method=args.method, drafter=self.drafter)
        if self.config is not None:
            cspd = {k: getattr(self.config, k) for k in gm.CSPD_DEFAULTS}
            self.settings.update(cspd, last_step_noise=self.config.resolved_last_step_noise())
            self.options.update(cspd)
        self.args = args

    @torch.no_grad()
    def sample(self, ids: torch.Tensor, labels: torch.Tensor, seed: int):
        from .decoding import generate
        from .generate_mar_cli import _decode
        from .models import to_uint8

        tokens, stats = generate(self.mar, labels.to(self.args.device), **self.options, **self.sampling, seed=seed,
                                 image_ids=ids)
        pixels = np.concatenate([to_uint8(_decode(self.mar, self.vae, row[None])).cpu().numpy()
                                 for row in tokens])  # one image at a time, as DiscreteSampler
        if self.config is None:
            counts = dict(target_forwards=stats.transformer_forwards, head_evaluations=stats.head_evaluations,
                          transformer_s=stats.transformer_s, head_s=stats.head_s, steps=stats.steps)
        else:
            counts = {name: getattr(stats, name) for name in (
                "target_forwards", "drafter_forwards", "target_head_evaluations", "drafter_head_evaluations",
                "prefill_tokens", "drafted", "accepted", "residual_fallbacks", "transformer_s", "head_s",
                "verify_s")}
            counts["image_forwards"] = len(ids) * stats.target_forwards
        return pixels, counts

    def figures(self, counts: dict, images: int) -> dict:
        if self.config is None:  # tokens per image per forward: L / num_iter
            return dict(tau=self.mar.config.seq_len / max(self.sampling["num_iter"], 1), **counts)
        # CSpDStats.tokens_per_target_forward over blocks of any sizes: tokens per (image x target forward)
        tau = (counts.get("prefill_tokens", 0) + counts.get("drafted", 0)) / max(counts.get("image_forwards", 0), 1)
        return dict(tau=tau, acceptance=counts.get("accepted", 0) / max(counts.get("drafted", 0), 1), **counts)


# ---------------------------------------------------------------------------------------------- the job


def settings_of(args, sampler) -> dict:
    """The settings that decide the images (config.json): model, method, ids, seed and every sampling option
    after the model's defaults are filled in; and the batch, which decides the folder's block layout. What the
    arithmetic depends on (dtype, --fused, --compile, device, processor, --threads) is ``numerics_of``'s."""
    model = {key: getattr(args, key) for key in ("model", "gpt", "gpt_name", "vq", "image_size", "mar", "mar_name",
                                                 "vae", "vae_name", "num_sampling_steps", "mar_drafter",
                                                 "mar_drafter_name") if getattr(args, key, None) is not None}
    if args.model in ("tiny", "tiny-mar"):
        model = {"model": args.model}
    for key in ("gpt", "vq", "mar", "vae", "mar_drafter"):
        if key in model:
            model[key] = os.path.abspath(model[key])
    return dict(format=FORMAT, **model, method=args.method, num_images=args.num_images, batch=args.batch,
                seed=args.seed, classes=list(args.classes), **sampler.settings)


def _check_job_options(args) -> None:
    from .generate_cli import check_method_options

    if args.num_images is None or args.num_images < 1:
        raise SystemExit(f"--num-images must be >= 1, got {args.num_images}")
    if args.num_images > 10**8:
        raise SystemExit(f"--num-images must be <= 10^8 (image ids are 32-bit counters), got {args.num_images}")
    if args.batch is None:
        args.batch = DEFAULT_BATCH
    if args.method == "cspd" and args.model not in ("tiny-mar", "mar-checkpoint"):
        raise SystemExit("--method cspd (continuous speculative decoding) is for MAR models: --model tiny-mar or "
                         "mar-checkpoint")
    check_method_options(args)
    if args.model in ("tiny", "checkpoint") and args.method != "ar" and args.tree == "auto":
        raise SystemExit("lantern sample needs a fixed draft tree (--tree chain, static or dynamic): --tree auto "
                         "picks each step's tree from timings, so the images would depend on the machine and the "
                         "batch (docs/sampling.md)")


def _check_classes(args, num_classes: int) -> None:
    if args.classes is None:
        args.classes = list(range(num_classes))
    from .generate_cli import check_classes

    check_classes(args.classes, num_classes)


def run_sample(args: argparse.Namespace) -> int:
    """The job on this rank (module docstring), at ``--threads`` torch threads and with ``--fused``'s backend
    (the caller's thread count and backend are restored afterwards)."""
    import contextlib

    from . import fused

    _check_job_options(args)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(check_threads(args.threads))
    try:
        with fused(args.fused) if args.fused else contextlib.nullcontext():
            return _run_sample(args)
    finally:
        torch.set_num_threads(threads_before)


def _run_sample(args: argparse.Namespace) -> int:
    folder = SampleFolder(args.out)
    ranks, args.device = init_ranks(args.device)
    try:
        refusal = _broadcast(_guarded(folder.check_writable) if ranks.main else None, ranks)
        if isinstance(refusal, str):
            raise SystemExit(refusal)
        sampler = MARSampler(args) if args.model in ("tiny-mar", "mar-checkpoint") else DiscreteSampler(args)
        _check_classes(args, sampler.num_classes)
        numerics = _all_gather(numerics_of(args, sampler), ranks)
        settings = dict(settings_of(args, sampler), numerics=numerics[ranks.rank])

        def prepare():
            _check_rank_numerics(numerics)
            return folder.prepare(settings, args.resume)

        verdict = _guarded(prepare) if ranks.main else None
        verdict = _broadcast(verdict, ranks)
        if isinstance(verdict, str):
            raise SystemExit(verdict)
        record = _generate_share(args, ranks, folder, sampler)
        records = _all_gather(record, ranks)
        _barrier(ranks)
        if ranks.main:
            _finish(args, folder, sampler, settings, records, ranks)
    finally:
        if ranks.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _guarded(step):
    """step() -> its value, or the message of the SystemExit it raised (broadcast to every rank)."""
    try:
        return step()
    except SystemExit as e:
        return str(e)


def _generate_share(args, ranks: Ranks, folder: SampleFolder, sampler) -> dict:
    """Every block of this rank's share that is not done yet. -> this rank's record for the run JSON."""
    n, batch = args.num_images, args.batch
    n_blocks = block_count(n, batch)
    done = folder.done_blocks()
    todo = [j for j in rank_blocks(n_blocks, ranks) if j not in done]
    bar = _progress(args, ranks, n, folder, n_blocks)
    stop_after = int(os.environ.get(STOP_AFTER_ENV, "0")) if ranks.main else 0  # (torchrun then ends the others)
    counts: Dict[str, float] = {}
    images = 0
    t0 = time.perf_counter()
    for k, j in enumerate(todo):
        ids = block_ids(j, n, batch)
        pixels, block_counts = sampler.sample(ids, labels_of(ids, args.classes), args.seed)
        folder.write_block(j, ids, pixels)
        images += len(ids)
        for key, value in block_counts.items():
            counts[key] = counts.get(key, 0) + value
        if bar is not None:
            bar.refresh_from_folder()
        if stop_after and k + 1 >= stop_after:
            os.kill(os.getpid(), signal.SIGKILL)  # tests: a kill between two blocks
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.wait_for_all()
    counts["blocks_run"] = len(todo)
    return dict(rank=ranks.rank, blocks=len(todo), images=images, wall_s=wall,
                images_per_s=images / wall if wall > 0 else None,
                **sampler.figures(counts, images))


class _FolderProgress:
    """Rank 0's bar over every rank's images: the shards in DIR, counted after each of rank 0's blocks and,
    once its share is done, every half second until every block is there (docs/sampling.md)."""

    def __init__(self, bar, folder: SampleFolder, n: int, batch: int, n_blocks: int):
        self.bar, self.folder, self.n, self.batch, self.n_blocks = bar, folder, n, batch, n_blocks

    def _images_done(self) -> int:
        done = self.folder.done_blocks()
        return sum(len(block_ids(j, self.n, self.batch)) for j in done if j < self.n_blocks)

    def refresh_from_folder(self) -> int:
        now = self._images_done()
        self.bar.update(now - self.bar.n)
        return now

    def wait_for_all(self) -> None:
        while self.refresh_from_folder() < self.n:
            time.sleep(0.5)
        self.bar.close()


def _progress(args, ranks: Ranks, n: int, folder: SampleFolder, n_blocks: int) -> Optional[_FolderProgress]:
    if not ranks.main:
        return None
    from tqdm import tqdm

    progress = _FolderProgress(None, folder, n, args.batch, n_blocks)
    bar = tqdm(total=n, initial=progress._images_done(), unit="img", disable=args.no_progress,
               desc=f"{args.method}: {n} images on {ranks.world} rank{'s' if ranks.world > 1 else ''}")
    progress.bar = bar
    return progress


def _finish(args, folder: SampleFolder, sampler, settings: dict, records: list, ranks: Ranks) -> None:
    """Rank 0 after every rank is done: the checked gather into samples.npz, and the run's JSON."""
    npz = folder.gather(args.num_images, args.batch)
    images = sum(r["images"] for r in records)
    wall = max(r["wall_s"] for r in records)
    summed: Dict[str, float] = {}
    for r in records:
        for key, value in r.items():
            if key not in ("rank", "wall_s", "images_per_s", "tau", "acceptance", "cost_model") and \
                    isinstance(value, (int, float)) and not isinstance(value, bool):
                summed[key] = summed.get(key, 0) + value
    overall = sampler.figures(summed, images)
    record = dict(settings=settings, world_size=ranks.world, device=args.device, fused=args.fused,
                  compile=args.compile, images_this_run=images, wall_s=wall,
                  images_per_s=images / wall if wall > 0 else None, tau=overall.get("tau"),
                  totals=overall, per_rank=records, npz=str(npz))
    run = folder.write_run(record)
    rate = f", {record['images_per_s']:.2f} images/s over {ranks.world} rank(s)" if images else ""
    print(f"{args.num_images} images in {args.out} ({images} generated by this run in {wall:.1f}s{rate}); "
          f"wrote {npz} and {run}")


def sample(out, num_images: int, **options) -> Path:
    """Python API of ``lantern sample``: generate ``num_images`` images into the folder ``out`` (under torchrun:
    this rank's share, docs/sampling.md). ``options`` are the CLI's options by their Python names (model="tiny",
    method="ar", batch=16, seed=0, classes=None, resume=False, cfg_scale=..., tree="chain", k=..., ...).
    -> the path of samples.npz."""
    from .cli import build_parser

    args = build_parser().parse_args(["sample", str(out), "--num-images", str(num_images)])
    for key, value in options.items():
        if not hasattr(args, key) or key in ("func", "command"):
            raise TypeError(f"sample() got an unknown option {key!r}")
        setattr(args, key, value)
    run_sample(args)
    return Path(out) / NPZ_FILE


def add_sample_parser(sub) -> argparse.ArgumentParser:
    from .generate_cli import add_device_options, add_method_options, add_model_options, add_sampling_options

    p = sub.add_parser(
        "sample", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="many images for evaluation (torchrun data-parallel, resumable): PNGs + one .npz (ADM layout)",
        description="Generate --num-images images into DIR: images/<id>.png, shards/<block>.npz, "
                    "samples.npz (arr_0 uint8 [N, H, W, 3] in id order, the ADM evaluation suite's input), "
                    "config.json and runs/run-<k>.json (tau, forwards, wall time per rank). Launch with "
                    "`torchrun --nproc_per_node N -m lantern sample ...` for N processes (nccl on GPUs, gloo "
                    "on CPUs) or plainly for one. Image i has class classes[i mod len(classes)]. Reproducibility: "
                    "the same settings and numerics (dtype, --fused, --compile, device type and processor, torch "
                    "version, --threads; all recorded in config.json) give bit-identical images whatever the "
                    "number of processes, the order of the blocks and restarts; --resume and ranks with other "
                    "numerics are refused. --batch changes the images only through the last bits the machine's "
                    "matrix products give a row in batches of other shapes: none where they are row-invariant, "
                    "else rare tokens. A killed run continues with --resume. docs/sampling.md \"Numerics\".")
    p.add_argument("out", metavar="DIR", help="output folder (new or empty; with --resume: a run's folder)")
    p.add_argument("--num-images", type=int, required=True, help="images to generate (ids 0..N-1)")
    p.add_argument("--resume", action="store_true", help="continue the run in DIR (its settings must match)")
    add_model_options(p)
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
    p.set_defaults(tree="chain")
    return p
