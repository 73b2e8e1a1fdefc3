"""End-to-end decoding of the tiny model (lantern.pretrained.load_tiny): `lantern.generate` with the cpu
backend (`lantern.fused("cpu")`) against the reference ops, timed in alternation in the same run, for
method "ar" and for LANTERN speculative decoding with the CLI's defaults (dynamic tree, depth 5, 58 nodes,
k = 1000, δ = 0.1; python/lantern/cli/generate.py). The drafter is the shipped EAGLE drafter
(python/lantern/weights/tiny/drafter.safetensors) when present, else a copy of the target used as its own
drafter (GPTDrafter), which the output says. Both backends must emit the same tokens (SPEC §5: same seed,
same result), which the bench checks and records."""
from __future__ import annotations

import copy

import torch

import lantern

from .common import Report, interleaved_medians

CLI_SPEC = dict(tree="dynamic", depth=5, n_nodes=58, k=1000, delta=0.1)


def tiny_setup(quick: bool):
    """(gpt, vq, labels [B], sampling settings, drafter, drafter name)."""
    from lantern.models.drafter import GPTDrafter
    from lantern.pretrained import load_tiny, load_tiny_drafter

    tiny = load_tiny("cpu")
    defaults = tiny.meta.get("sampling", {})
    sampling = dict(cfg_scale=defaults.get("cfg_scale", 2.0), top_k=defaults.get("top_k", 0),
                    top_p=defaults.get("top_p", 1.0), temperature=defaults.get("temperature", 1.0), seed=0)
    n_classes = tiny.gpt.config.num_classes
    labels = torch.arange(2 if quick else n_classes)  # [B] one image per class
    try:
        drafter, drafter_name = load_tiny_drafter(tiny.gpt), "EAGLE drafter (shipped)"
    except FileNotFoundError:
        drafter, drafter_name = GPTDrafter(copy.deepcopy(tiny.gpt)), "target as its own drafter (no drafter shipped)"
    return tiny, labels, sampling, drafter, drafter_name


def run(report: Report, quick: bool = False) -> None:
    from lantern.neighbours import neighbour_table

    if not lantern.fused_ops("cpu").get("verify"):
        print("decode: the cpu backend is unavailable; skipped", flush=True)
        return
    tiny, labels, sampling, drafter, drafter_name = tiny_setup(quick)
    table = neighbour_table(tiny.vq.quantize.embedding.weight, CLI_SPEC["k"], normalize=True)  # [V, k] int32
    L = tiny.gpt.config.block_size
    print(f"{'decode':>18} tiny model, {len(labels)} images x {L} tokens, {drafter_name}, "
          f"sampling {sampling}", flush=True)
    methods = {
        "ar": lambda: lantern.generate(tiny.gpt, labels, method="ar", **sampling),
        "lantern": lambda: lantern.generate(tiny.gpt, labels, method="lantern", drafter=drafter, neighbours=table,
                                            **CLI_SPEC, **sampling),
    }
    for method, fn in methods.items():
        case = f"{method} B={len(labels)} L={L}" + (" k=1000 d=0.1 dynamic" if method != "ar" else "")
        outputs = {}

        def on(backend):
            def call():
                with lantern.fused(backend):
                    outputs[backend] = fn()
            return call

        times = interleaved_medians({"reference": on("reference"), "cpu": on("cpu")},
                                    repeats=1 if quick else 3, warmup=1)
        for name, t in times.items():
            report.add("decode", case, name, t)
        (ref_tokens, stats), (cpu_tokens, _) = outputs["reference"], outputs["cpu"]
        same = bool(torch.equal(ref_tokens, cpu_tokens))
        tau = None if stats is None else stats.tau
        report.rows.append(dict(bench="decode", case=case, check="cpu tokens == reference tokens", value=same,
                                tau=tau, drafter=drafter_name))
        print(f"{'decode':>18} {case:<34} cpu tokens == reference tokens: {same}"
              + ("" if tau is None else f"; tau {tau:.2f}"), flush=True)
        report.ratio("decode", case, "reference", "cpu")
