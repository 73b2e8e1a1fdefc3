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

The job's settings are a ``sample_settings.SampleSettings``. Every option is checked before anything is
loaded or written (``sample_options``); rank 0 then takes DIR's
lock for the whole run (``sample_folder``: the layout of DIR, config.json, shards, the gather into
samples.npz).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import torch

from . import sources
from ._version import __version__
from .decoding.compiled import COMPILE_CHOICES, resolve_compile
from .sample_folder import (  # noqa: F401 re-exported
    CONFIG_FILE,
    FORMAT,
    IMAGES,
    LOCK_FILE,
    NPZ_FILE,
    RUNS,
    SHARDS,
    SampleFolder,
    block_count,
    block_ids,
    differences,
    digest,
)
from .sample_options import MAR_MODELS, check_sample_options
from .sample_settings import DEFAULT_BATCH, DEFAULT_THREADS, SampleSettings  # noqa: F401 re-exported

STOP_AFTER_ENV = "LANTERN_SAMPLE_STOP_AFTER"  # tests: rank 0 SIGKILLs itself after that many of its blocks
PROGRESS_POLL_S = 0.5


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


def _agree(ranks: Ranks, step):
    """Rank 0 runs step() and every rank gets its value, or every rank raises SystemExit with the message of
    what rank 0 raised (so no rank waits on a collective that rank 0 will never reach)."""
    outcome, failure = None, None
    if ranks.main:
        try:
            outcome = ("ok", step())
        except SystemExit as e:
            failure, outcome = e, ("refused", str(e))
        except BaseException as e:
            failure, outcome = e, ("refused", f"rank 0 failed: {type(e).__name__}: {e}")
    outcome = _broadcast(outcome, ranks)
    if failure is not None:
        raise failure
    if outcome[0] != "ok":
        raise SystemExit(outcome[1])
    return outcome[1]


# ---------------------------------------------------------------------------------------------- ids


def rank_blocks(n_blocks: int, ranks: Ranks) -> range:
    """Blocks j with j mod world == rank (interleaved: every rank's share ends within one block of the others')."""
    return range(ranks.rank, n_blocks, ranks.world)


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


def _compile_record(choice: str, device: torch.device) -> bool:
    """Whether the forwards run compiled (compiled graphs round differently from eager ones)."""
    return resolve_compile(COMPILE_CHOICES[choice], device).on


def numerics_of(args, sampler) -> dict:
    """What the images depend on besides the settings (config.json "numerics", docs/sampling.md "Numerics"):
    the model's dtype, the backend of each lantern op (``--fused``), ``--compile``, the device type and
    processor (GPU name and CUDA version, or CPU model, capability and thread count), torch's and lantern's
    versions. Every rank computes its own; a rank or a resume with other numerics is refused."""
    from ._backend import resolved_backends

    device = torch.device(args.device)
    model = getattr(sampler, "gpt", None) or getattr(sampler, "mar", None) or sampler.model
    record = dict(dtype=str(next(model.parameters()).dtype).replace("torch.", ""), fused=resolved_backends(device),
                  compile=_compile_record(args.compile, device), device=device.type, torch=torch.__version__,
                  lantern=__version__)
    if getattr(args, "hf", None) is not None:  # the model's code is transformers'
        import transformers

        record["transformers"] = transformers.__version__
    if device.type == "cuda":
        record.update(processor=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        record.update(processor=processor_name(), cpu_capability=cpu_capability(), threads=torch.get_num_threads())
    return record


def check_rank_numerics(numerics: list) -> None:
    """Rank 0: SystemExit naming each rank whose numerics differ from rank 0's, and each differing item with both
    values (``sample_folder.differences``: nested items by dotted name)."""
    lines = []
    for rank, theirs in enumerate(numerics):
        differing = differences(numerics[0], theirs)
        if differing:
            lines.append(f"rank {rank}: " + "; ".join(f"{d.key} (rank 0: {d.saved!r}, rank {rank}: {d.now!r})"
                                                      for d in differing))
    if lines:
        raise SystemExit("the ranks would compute the images with other numerics (docs/sampling.md \"Numerics\"): "
                         + " | ".join(lines) + ". Run every rank with the same --dtype, --fused, --compile and "
                         "--threads on machines of one kind")


# ---------------------------------------------------------------------------------------------- samplers


class DiscreteSampler:
    """A LlamaGen-architecture model through ``lantern.generate`` (ar, spec, lantern, sjd)."""

    def __init__(self, args):
        self.gpt, self.vq, meta = _loaded(sources.load_discrete, args)
        cfg_scale, top_k = sources.guidance_and_top_k(args, meta)
        self.num_classes = self.gpt.config.num_classes
        side = self.gpt.config.grid_size * self.vq.config.downsample
        self.image_shape = (side, side)
        self.weight_files = _discrete_weight_files(args)
        self.sampling = dict(cfg_scale=cfg_scale, temperature=args.temperature, top_k=top_k, top_p=args.top_p,
                             cfg_interval=args.cfg_interval)
        self.method, self.L = args.method, self.gpt.config.block_size
        self.options = dict(method=args.method, compile=COMPILE_CHOICES[args.compile])
        self.settings = dict(self.sampling)
        if args.method != "ar":
            codes = self.vq.quantize.embedding.weight.shape[0]
            if sources.relaxed(args) and args.k > codes - 1:
                raise SystemExit(f"--k must be at most {codes - 1} for this model (the other codes of its "
                                 f"{codes}-code codebook), got {args.k}")
            drafter, table = sources.drafter_and_table(args, self.gpt, self.vq)
            spec = sources.method_options(args)
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
        sources.check_mar_method(args)
        self.config = sources.cspd_config(args) if args.method == "cspd" else None
        self.mar, self.drafter, self.vae, defaults, _ = _loaded(sources.load_mar_models, args)
        cfg, num_iter, schedule = sources.mar_settings(args, self.mar, defaults, self.config)
        if num_iter > self.mar.config.seq_len:  # later steps would predict no token
            raise SystemExit(f"--num-iter must be at most the model's {self.mar.config.seq_len} tokens per image, "
                             f"got {num_iter}")
        self.num_classes = self.mar.config.class_num
        config = self.mar.config
        side = config.seq_side * config.patch_size * self.vae.config.downsample
        self.image_shape = (side, side)
        self.weight_files = _mar_weight_files(args)
        self.sampling = dict(cfg_scale=cfg, temperature=args.temperature, num_iter=num_iter, cfg_schedule=schedule)
        self.settings = dict(self.sampling, diffusion_steps=self.mar.diffloss.gen_diffusion.num_timesteps)
        self.options = dict(method=args.method, drafter=self.drafter)
        if self.config is not None:
            cspd = {k: getattr(self.config, k) for k in sources.CSPD_DEFAULTS}
            self.settings.update(cspd, last_step_noise=self.config.resolved_last_step_noise())
            self.options.update(cspd)
        self.args = args

    @torch.no_grad()
    def sample(self, ids: torch.Tensor, labels: torch.Tensor, seed: int):
        from .decoding import generate
        from .models import to_uint8

        tokens, stats = generate(self.mar, labels.to(self.args.device), **self.options, **self.sampling, seed=seed,
                                 image_ids=ids)
        pixels = np.concatenate([to_uint8(sources.decode_mar(self.mar, self.vae, row[None])).cpu().numpy()
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


def _loaded(load, args):
    """load(args), or SystemExit naming the model's files and the loader's complaint (its first line): a
    checkpoint the user names is input, and a bad one deserves a message, not a traceback."""
    try:
        return load(args)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - every loader failure: unreadable, wrong format, wrong tensors
        files = ", ".join(f"--{dest.replace('_', '-')} {getattr(args, dest)}" for dest in
                          ("gpt", "vq", "mar", "vae", "mar_drafter") if getattr(args, dest, None))
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        raise SystemExit(f"the {args.model} model cannot be loaded{f' ({files})' if files else ''}: "
                         f"{type(e).__name__}: {first_line}") from e


def _discrete_weight_files(args) -> Dict[str, str]:
    """name -> path of every weight file a discrete run reads (their digests go into config.json)."""
    if args.model == "tiny":
        from .pretrained import TINY_DIR

        files = {"gpt": TINY_DIR / "gpt.safetensors", "vq": TINY_DIR / "vq.safetensors"}
        if args.method in ("spec", "lantern"):
            files["drafter"] = TINY_DIR / "drafter.safetensors"
        return {name: str(path) for name, path in files.items()}
    return {"gpt": args.gpt, "vq": args.vq}


def _mar_weight_files(args) -> Dict[str, str]:
    if args.model == "tiny-mar":
        from .tiny_mar import TINY_MAR_DIR

        names = ("mar", "vae", "drafter") if args.method == "cspd" else ("mar", "vae")
        return {name: str(TINY_MAR_DIR / f"{name}.safetensors") for name in names}
    files = {"mar": args.mar, "vae": args.vae}
    if args.method == "cspd":
        files["mar_drafter"] = args.mar_drafter
    return files


# ---------------------------------------------------------------------------------------------- the job


def settings_of(args, sampler) -> dict:
    """The settings that decide the images (config.json): model, the sha256 of each weight file it reads,
    method, ids, seed and every sampling option after the model's defaults are filled in; and the batch, which
    decides the folder's block layout. What the arithmetic depends on (dtype, --fused, --compile, device,
    processor, --threads) is ``numerics_of``'s, recorded beside them. Reads every weight file once (rank 0)."""
    if args.hf is not None:  # a transformers model directory (sample_hf)
        return dict(format=FORMAT, **sampler.record(args))
    model = {"model": args.model}
    if args.model not in ("tiny", "tiny-mar"):
        model.update({key: getattr(args, key) for key in ("gpt", "gpt_name", "vq", "image_size", "mar", "mar_name",
                                                          "vae", "vae_name", "num_sampling_steps", "mar_drafter",
                                                          "mar_drafter_name")
                      if getattr(args, key, None) is not None and args.model in sources.MODEL_OPTIONS[key]})
    for key in ("gpt", "vq", "mar", "vae", "mar_drafter"):
        if key in model:
            model[key] = os.path.abspath(model[key])
    sha256 = {name: digest(path) for name, path in sampler.weight_files.items()}
    return dict(format=FORMAT, **model, sha256=sha256, method=args.method, num_images=args.num_images,
                batch=args.batch, seed=args.seed, classes=list(args.classes), **sampler.settings)


def _check_classes(args, num_classes: int) -> None:
    if args.classes is None:
        args.classes = list(range(num_classes))
    sources.check_classes(args.classes, num_classes)


def run_sample(settings: SampleSettings) -> Path:
    """The job on this rank (module docstring), at ``threads`` torch threads and with ``fused``'s backend: the
    caller's thread count and backend are restored afterwards. -> the path of samples.npz. The caller's
    settings are left as they are (the defaults are filled into a copy)."""
    args = dataclasses.replace(settings)
    check_sample_options(args)
    folder = SampleFolder(args.out)
    threads_before = torch.get_num_threads()
    ranks, args.device = init_ranks(args.device)
    try:
        torch.set_num_threads(args.threads)
        _agree(ranks, lambda: _open_folder(folder))
        from ._backend import fused

        with fused(args.fused) if args.fused else contextlib.nullcontext():
            _run_locked(args, ranks, folder)
    finally:
        torch.set_num_threads(threads_before)
        folder.unlock()
        if ranks.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return Path(args.out) / NPZ_FILE


def _open_folder(folder: SampleFolder) -> None:
    """Rank 0, before any model is loaded: DIR can be written, is locked by this run, and its layout holds no
    surprise."""
    folder.check_writable()
    folder.check_layout()  # first without the lock: a folder refused gets no lock file
    folder.lock()
    folder.check_layout()


def _run_locked(args, ranks: Ranks, folder: SampleFolder) -> None:
    if args.hf is not None:
        from .sample_hf import HFSampler

        sampler = HFSampler(args)
    else:
        sampler = MARSampler(args) if args.model in MAR_MODELS else DiscreteSampler(args)
        _check_classes(args, sampler.num_classes)
    numerics = _all_gather(numerics_of(args, sampler), ranks)
    settings = dict(settings_of(args, sampler), numerics=numerics[0]) if ranks.main else None

    def prepare():
        check_rank_numerics(numerics)
        done = folder.prepare(settings, args.resume, args.num_images, args.batch, sampler.image_shape)
        return done, secrets.token_hex(8)  # the token keys this run's progress counter

    images_before, token = _agree(ranks, prepare)
    record = _generate_share(args, ranks, folder, sampler, images_before, token)
    records = _all_gather(record, ranks)
    if ranks.main:
        _finish(args, folder, sampler, settings, records, ranks)


def _generate_share(args, ranks: Ranks, folder: SampleFolder, sampler, images_before: int, token: str) -> dict:
    """Every block of this rank's share that is not done yet. -> this rank's record for the run JSON. The
    bookkeeping is one scan of shards/ (a bool per block) and O(1) per block."""
    n, batch = args.num_images, args.batch
    mine = rank_blocks(block_count(n, batch), ranks)
    done = folder.done_blocks(block_count(n, batch))[mine.start::mine.step]  # bool [len(mine)]
    progress = _Progress.start(args, ranks, images_before, token)
    stop_after = int(os.environ.get(STOP_AFTER_ENV, "0")) if ranks.main else 0  # (torchrun then ends the others)
    counts: Dict[str, float] = {}
    images = blocks = 0
    t0 = time.perf_counter()
    for k, j in enumerate(mine):
        if done[k]:
            continue
        ids = block_ids(j, n, batch)
        labels = None if args.classes is None else labels_of(ids, args.classes)  # --hf: prompts by id instead
        pixels, block_counts = sampler.sample(ids, labels, args.seed)
        folder.write_block(j, ids, pixels)
        images, blocks = images + len(ids), blocks + 1
        for key, value in block_counts.items():
            counts[key] = counts.get(key, 0) + value
        progress.add(len(ids))
        if stop_after and blocks >= stop_after:
            os.kill(os.getpid(), signal.SIGKILL)  # tests: a kill between two blocks
    wall = time.perf_counter() - t0
    progress.finish()
    counts["blocks_run"] = blocks
    return dict(rank=ranks.rank, blocks=blocks, images=images, wall_s=wall,
                images_per_s=images / wall if wall > 0 else None,
                **sampler.figures(counts, images))


class _Progress:
    """Rank 0's bar over every rank's images: the images done before this run plus a counter in the process
    group's key-value store to which every rank adds each of its blocks (O(1) per block, whatever the number
    of shards). Once its own share is done, rank 0 waits on an asynchronous barrier, reading the counter every
    half second, so the bar runs until the slowest rank ends."""

    def __init__(self, bar, ranks: Ranks, store, key: str, before: int):
        self.bar, self.ranks, self.store, self.key, self.before = bar, ranks, store, key, before
        self.mine = 0

    @classmethod
    def start(cls, args, ranks: Ranks, before: int, token: str) -> "_Progress":
        bar = None
        if ranks.main:
            from tqdm import tqdm

            bar = tqdm(total=args.num_images, initial=before, unit="img", disable=args.no_progress,
                       desc=f"{args.method}: {args.num_images} images on {ranks.world} "
                            f"rank{'s' if ranks.world > 1 else ''}")
        return cls(bar, ranks, _store(ranks), f"lantern-sample/{token}/images", before)

    def add(self, images: int) -> None:
        self.mine += images
        made = self.store.add(self.key, images) if self.store is not None else self.mine
        if self.bar is not None:
            self.bar.update(self.before + int(made) - self.bar.n)

    def finish(self) -> None:
        if self.ranks.distributed:
            import torch.distributed as dist

            work = dist.barrier(async_op=True)
            while self.bar is not None and not work.is_completed():
                self.add(0)
                time.sleep(PROGRESS_POLL_S)
            work.wait()
        if self.bar is not None:
            self.add(0)
            self.bar.close()


def _store(ranks: Ranks):
    """The process group's key-value store (torchrun's), or None (one process, or a group without one)."""
    if not ranks.distributed:
        return None
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _finish(args, folder: SampleFolder, sampler, settings: dict, records: list, ranks: Ranks) -> None:
    """Rank 0 after every rank is done: the checked gather into samples.npz, and the run's JSON."""
    npz = folder.gather(args.num_images, args.batch, sampler.image_shape)
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


# ---------------------------------------------------------------------------------------------- API


def sample(out, num_images: int, **options) -> Path:
    """Python API of ``lantern sample``: generate ``num_images`` images into the folder ``out`` (under torchrun:
    this rank's share, docs/sampling.md). ``options`` are the settings of ``SampleSettings`` (the CLI's options
    by their Python names: model="tiny", method="ar", batch=16, seed=0, classes=None, resume=False,
    cfg_scale=..., tree="chain", k=..., ...), of the types the CLI converts its text to (TypeError otherwise,
    naming the option), checked as the CLI checks them (SystemExit). -> the path of samples.npz."""
    return run_sample(SampleSettings.from_options(out, num_images, **options))
