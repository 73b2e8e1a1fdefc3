"""Continuous speculative decoding on the tiny MAR pair (issue 12) against target-only MAR at the same
settings (one token per MAR step, num_iter = L = 64; guidance and schedule from tiny_mar.json; exact rule,
so last-step noise on both sides), fused cpu backend, one thread. All ratios come from one run:

- speed: per batch size, target-only MAR, CSpD at each gamma and MAR with fewer steps (num_iter = L / gamma,
  the baseline the official repository never ran) are timed in alternation (medians of --repeats); per
  CSpD run the acceptance (overall and by block position), the residual tries and capped fallbacks, the
  forwards, and the time split into transformer, head and verify;
- quality: --quality-images images (classes cycled, keyed by image index) of each contender, scored by the
  tiny classifier (accuracy) and the Frechet distance of its features (``lantern.tiny.evaluate``);
- acceptance effects at batch 8: trajectory alignment off (align=False), pre-fill 0 against 0.05 (the
  first steps' acceptance), and the paper rule at bandwidth 1 and 42 (code ratio);
- the rules' distortion: one context (image 0 after the pre-fill) copied into 500 rows with independent
  noise, one verified block of gamma = 8 under each rule; printed are the energy distance (latent units,
  the block's tokens flattened) to the target's one-step samples of the same positions with the rule's
  last-step setting, next to the floor (two target samples against each other), and the RMS distance of
  the tokens from the target's last-step mean at the same trajectories (the target's own: its last-step
  std, or 0 without last-step noise);
- the H100 projection for MAR-H drafted by MAR-B (``bench.projection.project_cspd``), labelled as such.

    python -m bench.bench_cspd [--quick] [--batches 1 8 32] [--gammas 4 8 16 32] [--repeats 3]
                               [--quality-images 100] [--tiny-dir DIR] [--sections speed ...] [--clock wall|cpu]
                               [--json PATH]

``python -m bench`` includes it (--quick there) when the tiny MAR weights exist.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import lantern

from .common import Report, interleaved_medians
from .projection import MAR, project_cspd

PREFILL = 0.05


def setup(directory=None):
    """(target, drafter, vae, sampling settings) of the tiny MAR pair: num_iter = L, the model's guidance."""
    from lantern.tiny_mar import TINY_MAR_DIR, load_tiny_mar

    tiny = load_tiny_mar("cpu", directory=Path(directory) if directory else TINY_MAR_DIR)
    defaults = tiny.meta["sampling"]
    sampling = dict(num_iter=tiny.mar.config.seq_len, cfg=defaults["cfg"], cfg_schedule=defaults["cfg_schedule"],
                    temperature=defaults.get("temperature", 1.0), seed=0)
    return tiny.mar, tiny.drafter, tiny.vae, sampling


def contenders(target, drafter, gammas, sampling):
    """name -> (function(labels, image_ids) -> (tokens, stats or None)) for target-only MAR, CSpD at each gamma
    and MAR at L / gamma steps."""
    from lantern.decoding import CSpDConfig, generate_cspd, sample_mar

    L = target.config.seq_len
    calls = {"mar": lambda labels, ids: (sample_mar(target, labels, image_ids=ids, last_step_noise=True,
                                                    **sampling).tokens, None)}
    for g in gammas:
        config = CSpDConfig(gamma=g, prefill=PREFILL)

        def cspd(labels, ids, config=config):
            out = generate_cspd(target, drafter, labels, config=config, image_ids=ids, **sampling)
            return out.tokens, out.stats

        calls[f"cspd g{g}"] = cspd
        fewer = dict(sampling, num_iter=max(1, L // g))
        calls[f"mar {fewer['num_iter']} steps"] = (
            lambda labels, ids, fewer=fewer: (sample_mar(target, labels, image_ids=ids, last_step_noise=True,
                                                         **fewer).tokens, None))
    return calls


def speed(report: Report, target, drafter, batches, gammas, repeats, sampling, clock: str = "wall") -> dict:
    from .bench_plans import CLOCKS

    calls = contenders(target, drafter, gammas, sampling)
    summary = {}
    for B in batches:
        labels, ids = torch.arange(B) % target.config.class_num, torch.arange(B)
        last = {}

        def timed(name):
            def go():
                last[name] = calls[name](labels, ids)[1]
            return go

        medians = interleaved_medians({name: timed(name) for name in calls}, repeats=repeats, warmup=0,
                                      clock=CLOCKS[clock])
        case = f"B={B} L={target.config.seq_len}" + ("" if clock == "wall" else f" ({clock} clock)")
        row = {}
        for name, seconds in medians.items():
            report.add("cspd", case, name, seconds, **(cspd_extra(last[name]) if last[name] else {}))
        for name in calls:
            if name != "mar":
                row[name] = report.ratio("cspd", case, "mar", name)
        for g in gammas:
            s = last[f"cspd g{g}"]
            by_position = " ".join(f"{a:.2f}" for a in s.acceptance_by_block_position())
            print(f"{'cspd':>18} {case:<34} g{g}: acceptance {s.acceptance:.3f} (by block position: {by_position}); "
                  f"residual tries {s.residual_tries_mean:.2f} (max {s.residual_tries_max}), capped "
                  f"{s.residual_fallbacks}; transformer {s.transformer_s:.2f}s / head {s.head_s:.2f}s / verify "
                  f"{s.verify_s:.3f}s; {s.target_forwards} target, {s.drafter_forwards} drafter forwards", flush=True)
        summary[B] = row
    return summary


def cspd_extra(s) -> dict:
    return dict(acceptance=s.acceptance, acceptance_by_block_position=s.acceptance_by_block_position(),
                residual_tries_mean=s.residual_tries_mean, residual_tries_max=s.residual_tries_max,
                residual_fallbacks=s.residual_fallbacks, transformer_s=s.transformer_s, head_s=s.head_s,
                verify_s=s.verify_s, target_forwards=s.target_forwards, drafter_forwards=s.drafter_forwards)


def quality(report: Report, target, drafter, vae, gammas, n_images: int, sampling, batch: int = 32) -> dict:
    from lantern.tiny.evaluate import evaluate_samples

    calls = contenders(target, drafter, gammas, sampling)
    labels = torch.arange(n_images) % target.config.class_num
    out = {}
    for name, call in calls.items():
        t0 = time.perf_counter()
        tokens = torch.cat([call(labels[ids], ids)[0] for ids in torch.arange(n_images).split(batch)])
        with torch.no_grad():
            images = torch.cat([vae.decode_tokens(target.unpatchify(t)) for t in tokens.split(64)])
        scores = evaluate_samples(images, labels)
        out[name] = dict(class_accuracy=scores["class_accuracy"], fd=scores["fd"],
                         fd_real_floor=scores["fd_real_floor"])
        report.rows.append(dict(bench="cspd-quality", case=f"{n_images} images", impl=name, **out[name],
                                sample_s=time.perf_counter() - t0))
        print(f"{'cspd-quality':>18} {n_images} images {name:<22} accuracy {100 * scores['class_accuracy']:5.1f}%  "
              f"FD {scores['fd']:.2f} (real-image floor {scores['fd_real_floor']:.2f})", flush=True)
    return out


def acceptance_effects(report: Report, target, drafter, sampling, batch: int = 8, gamma: int = 8) -> dict:
    """Acceptance at batch 8: aligned / unaligned; pre-fill 0.05 / 0 (and the acceptance of the steps a 0.05
    pre-fill would have given to the target); the paper rule at bandwidth 1 and 42 (code ratio)."""
    from lantern.decoding import CSpDConfig, generate_cspd

    labels = torch.arange(batch) % target.config.class_num
    settings = {"exact": CSpDConfig(gamma=gamma), "exact, unaligned": CSpDConfig(gamma=gamma, align=False),
                "exact, no pre-fill": CSpDConfig(gamma=gamma, prefill=0.0),
                "paper b=1": CSpDConfig(gamma=gamma, rule="paper"),
                "paper b=42 code": CSpDConfig(gamma=gamma, rule="paper", bandwidth=42.0, sigma_ratio="code")}
    early = math.ceil(PREFILL * sampling["num_iter"])
    out = {}
    for name, config in settings.items():
        s = generate_cspd(target, drafter, labels, config=config, **sampling).stats
        by_step = [a for a in s.acceptance_by_step()[:early] if not math.isnan(a)]
        out[name] = dict(acceptance=s.acceptance, early_steps=sum(by_step) / len(by_step) if by_step else math.nan,
                         residual_fallbacks=s.residual_fallbacks)
        report.rows.append(dict(bench="cspd-acceptance", case=f"B={batch} gamma={gamma}", impl=name, **out[name]))
        print(f"{'cspd-acceptance':>18} B={batch} g{gamma} {name:<18} acceptance {s.acceptance:.3f}"
              + (f" (first {early} steps {out[name]['early_steps']:.3f})" if by_step else ""), flush=True)
    return out


def distortion(report: Report, target, drafter, sampling, rows: int = 500, gamma: int = 8) -> dict:
    """Per-token shift of each rule from the target's law at one context (module docstring)."""
    from lantern.decoding import CSpDConfig
    from lantern.decoding.cspd import CSpDRun
    from lantern.decoding.cspd_context import block_from_context, one_step_from_context
    from lantern.decoding.mar import sample_orders

    first = math.ceil(PREFILL * sampling["num_iter"])
    L, C = target.config.seq_len, target.config.token_embed_dim
    label, seed = torch.tensor([3]), sampling["seed"]
    common = dict(cfg=sampling["cfg"], cfg_schedule=sampling["cfg_schedule"], temperature=sampling["temperature"],
                  seed=seed)
    run = CSpDRun(target, drafter, label, 1, torch.tensor([0]), sampling["num_iter"], CSpDConfig(gamma=gamma),
                  common["cfg"], common["cfg_schedule"], common["temperature"], seed)
    tokens, mask = torch.zeros(1, L, C), torch.ones(1, L, dtype=torch.bool)
    for step in range(first):  # the context: image 0 after the target's pre-fill
        tokens, mask, _ = run.prefill_step(tokens, mask, step)
    tokens, mask = tokens.expand(rows, L, C).contiguous(), mask.expand(rows, L).contiguous()
    labels, ids = label.expand(rows), torch.arange(1, rows + 1)
    order = sample_orders(seed, torch.tensor([0]), L)[0]
    rules = {"exact": CSpDConfig(gamma=gamma), "paper b=1": CSpDConfig(gamma=gamma, rule="paper"),
             "paper b=42 code": CSpDConfig(gamma=gamma, rule="paper", bandwidth=42.0, sigma_ratio="code")}
    out, targets = {}, {}
    flat = lambda t: t.reshape(rows, -1)
    for name, config in rules.items():
        noise = config.resolved_last_step_noise()
        got, positions, mask_len, stats = block_from_context(target, drafter, tokens, mask, order, labels, ids,
                                                             num_iter=sampling["num_iter"], first=first,
                                                             config=config, **common)
        one_step = lambda first_id: one_step_from_context(target, tokens, mask, positions, labels, ids + first_id,
                                                          mask_len=mask_len, last_step_noise=noise, **common)
        if noise not in targets:  # the target at the block's trajectories, and two independent samples
            targets[noise] = (*one_step(0), one_step(10**6)[0], one_step(2 * 10**6)[0])
        own, mean0, _, want, floor_sample = targets[noise]
        out[name] = dict(acceptance=stats.acceptance, last_step_noise=noise,
                         energy_distance=energy_distance(flat(got), flat(want)),
                         energy_floor=energy_distance(flat(floor_sample), flat(want)),
                         rms_from_target_mean=float((got - mean0).pow(2).mean().sqrt()),
                         target_rms_from_its_mean=float((own - mean0).pow(2).mean().sqrt()))
        report.rows.append(dict(bench="cspd-distortion", case=f"{rows} rows, {len(positions)} tokens", impl=name,
                                **out[name]))
        r = out[name]
        print(f"{'cspd-distortion':>18} {name:<16} acceptance {r['acceptance']:.3f}  energy distance to the "
              f"target's one-step law {r['energy_distance']:.4f} (floor {r['energy_floor']:.4f}); RMS from the "
              f"target's last-step mean {r['rms_from_target_mean']:.4f} (the target's own "
              f"{r['target_rms_from_its_mean']:.4f})", flush=True)
    _, mean_p, std_p, _, _ = targets[True]  # the target at the exact rule's trajectories (last-step noise)
    out["head gap"] = head_gap(report, drafter, mean_p, std_p, tokens, mask, positions, labels, ids, mask_len,
                               common)
    return out


def head_gap(report: Report, drafter, mean_p, std_p, tokens, mask, positions, labels, ids, mask_len,
             common) -> dict:
    """How far apart the two heads' last-step Gaussians are at the same context and aligned noise: per token,
    d = |(mu_q0 - mu_p0) / sigma_p0| (the norm over channels, in the target's last-step std). Two Gaussians with
    one std and means d apart overlap by 2 Phi(-d / 2): the exact rule's acceptance when the stds agree."""
    from lantern.decoding.cspd_context import one_step_from_context

    _, mean_q, std_q = one_step_from_context(drafter, tokens, mask, positions, labels, ids, mask_len=mask_len,
                                             last_step_noise=True, **common)
    d = ((mean_q - mean_p) / std_p).norm(dim=-1).flatten()  # [rows * N]
    overlap = 2 * torch.distributions.Normal(0.0, 1.0).cdf(-d / 2)
    gap = dict(median_d=float(d.median()), p10_d=float(d.quantile(0.1)), mean_overlap=float(overlap.mean()),
               std_ratio_median=float((std_q / std_p).median()), channels=int(mean_p.shape[-1]))
    report.rows.append(dict(bench="cspd-head-gap", case=f"{len(d)} tokens", impl="drafter vs target", **gap))
    print(f"{'cspd-head-gap':>18} last-step means apart by d = {gap['median_d']:.1f} target stds (median over "
          f"{len(d)} tokens, 10th percentile {gap['p10_d']:.1f}; {gap['channels']} channels); Gaussian overlap "
          f"{gap['mean_overlap']:.2e}; std ratio q/p {gap['std_ratio_median']:.2f}", flush=True)
    return gap


def energy_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """2 E|X - Y| - E|X - X'| - E|Y - Y'| between samples [n, d] (V-statistic; 0 iff the laws are equal, and
    about the sampling floor for equal laws)."""
    a, b = a.double(), b.double()
    return float(2 * torch.cdist(a, b).mean() - torch.cdist(a, a).mean() - torch.cdist(b, b).mean())


def projection(report: Report, acceptance: float, batches=(1, 8, 32), gammas=(4, 8, 16, 32)) -> list:
    from .projection import print_cspd

    rows = [project_cspd(MAR["MAR-H"], MAR["MAR-B"], g, b, acceptance) for b in batches for g in gammas]
    print_cspd(rows)
    report.rows += [dict(bench="cspd-projection", **r) for r in rows]
    return rows


SECTIONS = ("speed", "acceptance", "distortion", "quality", "projection")


def run(report: Report, batches=(1, 8, 32), gammas=(4, 8, 16, 32), repeats: int = 3, quality_images: int = 100,
        directory=None, sections=SECTIONS, clock: str = "wall") -> dict:
    from lantern.tiny_mar import TINY_MAR_DIR, WEIGHT_FILES

    folder = Path(directory) if directory else TINY_MAR_DIR
    if not all((folder / name).exists() for name in WEIGHT_FILES):
        print(f"cspd: the tiny MAR weights are not in {folder} (python -m lantern.tiny_mar.train); skipped", flush=True)
        return {}
    if not lantern.fused_ops("cpu").get("continuous_verify"):
        print("cspd: the cpu backend is unavailable; skipped", flush=True)
        return {}
    target, drafter, vae, sampling = setup(directory)
    print(f"cspd: tiny MAR pair, num_iter {sampling['num_iter']}, cfg {sampling['cfg']} {sampling['cfg_schedule']}, "
          f"temperature {sampling['temperature']}, {target.diffloss.gen_diffusion.num_timesteps} diffusion steps, "
          f"exact rule, pre-fill {PREFILL}", flush=True)
    summary = {}
    with torch.no_grad(), lantern.fused("cpu"):
        if "speed" in sections:
            summary["speed"] = speed(report, target, drafter, batches, gammas, repeats, sampling, clock)
        if "acceptance" in sections or "projection" in sections:
            summary["acceptance"] = acceptance_effects(report, target, drafter, sampling)
        if "distortion" in sections:
            summary["distortion"] = distortion(report, target, drafter, sampling)
        if "quality" in sections and quality_images:
            summary["quality"] = quality(report, target, drafter, vae, gammas, quality_images, sampling)
    if "projection" in sections:
        summary["projection"] = projection(report, summary["acceptance"]["exact"]["acceptance"], batches, gammas)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, gammas 8 and 32, 1 repeat, 20 images")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--gammas", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-images", type=int, default=100,
                        help="images per contender for accuracy / FD (0: none)")
    parser.add_argument("--tiny-dir", help="the tiny MAR weights (default: the package's)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (one thread: the wall time of an idle machine; bench_plans)")
    parser.add_argument("--json", default="bench/results/cspd.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.batches, args.gammas, args.repeats, args.quality_images = [1, 8], [8, 32], 1, 20
    report = Report()
    run(report, args.batches, args.gammas, args.repeats, args.quality_images, args.tiny_dir, args.sections, args.clock)
    report.write(args.json)


if __name__ == "__main__":
    main()
