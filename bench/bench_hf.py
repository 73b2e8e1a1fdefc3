"""lantern.hf: what wrapping a transformers model costs per forward, and what lantern's methods gain on it.
Random weights (lantern.hf.random_models: no download), so the acceptance figures say little about a trained
model's; the forward costs do not depend on the weights.

- overhead: one forward of T nodes over a cache of n committed codes at R rows, the wrapped model
  (``HFTarget``: per-row cache, 4D tree mask, the code embedding and head) against the same decoder called
  plainly (HF's DynamicCache, cropped back after each call; the same embedding and head), timed in
  alternation, medians of --repeats; T = 1 is an AR step, T = 9 a window of 8 drafts;
- decode: whole images by lantern.generate, method "ar" against "sjd" (exact) and "lantern" (SJD with the
  codebook's relaxation) at each batch size, guidance 5, temperature 1: wall time, target forwards, tau.

    python -m bench.bench_hf [--kinds janus chameleon emu3] [--shape tiny|janus-pro-1b|chameleon-7b]
                             [--dtype float32|bfloat16] [--device cpu|cuda] [--batches 1 8] [--repeats 15]
                             [--sections overhead decode] [--clock cpu|wall] [--compile auto|on|off]
                             [--rehearse] [--json PATH]

On a GPU run the model shapes: ``--device cuda --dtype bfloat16 --kinds janus --shape janus-pro-1b`` and
``--kinds chameleon --shape chameleon-7b``. On the CPU only the tiny shape is meant (one thread).
``--compile`` is lantern.generate's (auto: compiled on a GPU; each method's first run, a warm-up, compiles its
graphs); the choice is printed per method. ``--rehearse`` runs every section through once on a cut-down model
of the named shape (its widths and vocabularies, 1 layer, a 4 x 4 image; 2 repeats): the GPU run's code
paths, in seconds, with no meaning in its times.
"""
from __future__ import annotations

import argparse
import time

import torch

import lantern
import lantern.hf
from lantern.decoding.compiled import COMPILE_CHOICES
from lantern.hf.random_models import SHAPES, janus_tokens, random_model

from .common import Report, interleaved_medians

PROMPT = [1, 5, 6, 7, 8]
CACHED = 24  # codes committed before the timed forward
REHEARSAL = dict(layers=1, side=4)  # --rehearse: the shape's widths, one layer, a 4 x 4 image


def build(kind: str, shape: str, dtype, device, **overrides):
    m = random_model(kind, shape, dtype=dtype, device=device, **overrides)
    options = janus_tokens(m.config) if kind == "janus" else {}
    if kind in ("emu3", "chameleon"):
        side = overrides.get("side", SHAPES[shape]["side"])
        options["image_size"] = (side, side)
    return m, lantern.hf.wrap(m, **options)


def prompt_ids(kind: str, m, rows: int, device) -> torch.Tensor:
    ids = list(PROMPT)
    if kind == "janus":
        ids.append(janus_tokens(m.config)["boi_token_id"])
    return torch.tensor([ids], device=device).expand(rows, -1)


def forward_pair(kind, m, target, rows: int, T: int, device):
    """(plain forward, wrapped forward) of T nodes after CACHED codes, each a no-argument function."""
    from transformers import DynamicCache

    rules = target.rules
    ids = prompt_ids(kind, m, rows, device)
    cond = target.encode_prompt(ids)
    view = target.for_prompt(cond)
    view.setup_cache(rows, view.config.cond_len + CACHED + T + 1)
    zero = torch.zeros(rows, dtype=torch.int64, device=device)
    codes = torch.randint(0, rules.n_codes, (rows, CACHED + T), device=device)
    with torch.no_grad():
        view(None, cond, cache_len=zero)
        view(codes[:, :CACHED], cache_len=view.cond_keys.clone())
    cache_len = view.cond_keys + CACHED
    nodes = codes[:, CACHED:]
    positions = CACHED + torch.arange(T, device=device).expand(rows, T)
    mask = lantern.ops.ancestor_mask(torch.arange(-1, T - 1, device=device).expand(rows, T)) if T > 1 else None

    def wrapped():
        with lantern.ops.checks.values_checked_by_caller():  # as inside the decoding loops
            if T == 1:  # an AR step passes no positions and no mask
                return view(nodes, cache_len=cache_len)
            return view(nodes, cache_len=cache_len, positions=positions, tree_mask=mask)

    plain_cache = DynamicCache(config=rules.decoder.config)
    with torch.no_grad():
        text = rules.embed_text(cond[:, 0, 1:].clamp(min=0))
        rules.decoder(inputs_embeds=torch.cat([text, rules.embed_codes(codes[:, :CACHED])], 1), cache=plain_cache,
                      use_cache=True)

    @torch.no_grad()
    def plain():
        hidden = rules.decoder(inputs_embeds=rules.embed_codes(nodes), cache=plain_cache,
                               use_cache=True).last_hidden_state
        plain_cache.crop(-nodes.shape[1])
        return rules.code_logits(hidden).float()

    return plain, wrapped


def synced(fn, device):
    if device.type != "cuda":
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call


def overhead(report: Report, kind, m, target, batches, repeats, device, clock):
    for rows in batches:
        for T in (1, 9):
            plain, wrapped = forward_pair(kind, m, target, rows, T, device)
            case = f"{kind} rows {rows} T {T}"
            medians = interleaved_medians({"plain": synced(plain, device), "wrapped": synced(wrapped, device)},
                                          repeats=repeats, warmup=2, clock=clock)
            for name, seconds in medians.items():
                report.add("hf_forward", case, name, seconds)
            report.ratio("hf_forward", case, "wrapped", "plain")


def decode(report: Report, kind, m, target, batches, device, repeats: int, compile="auto"):
    methods = {"ar": dict(method="ar"), "sjd": dict(method="sjd", tree="chain", window=8),
               "sjd+relaxed": dict(method="lantern", tree="chain", window=8, k=min(1000, target.rules.n_codes - 1),
                                   delta=0.2)}
    for rows in batches:
        ids = prompt_ids(kind, m, rows, device)
        case = f"{kind} batch {rows}"
        stats = {}

        def run(options, name):
            def go():
                run_stats = {} if options["method"] == "ar" else None
                extra = {"stats": run_stats} if run_stats is not None else {}
                codes, st = lantern.generate(target, ids, cfg_scale=5.0, seed=0, compile=compile, **options, **extra)
                stats[name] = st if st is not None else run_stats
                return codes
            return synced(go, device)

        medians = interleaved_medians({name: run(o, name) for name, o in methods.items()}, repeats=repeats, warmup=1)
        for name, seconds in medians.items():
            st = stats[name]
            if isinstance(st, dict):  # AR: generate_ar's stats
                extra = dict(compile=st["compile"])
            else:
                extra = dict(tau=st.tau, target_forwards=st.target_forwards, compile=st.compile)
            report.add("hf_decode", case, name, seconds, **extra)
            figures = "" if isinstance(st, dict) else f"tau {st.tau:.2f}, {st.target_forwards} target forwards, "
            print(f"{'':>18} {case:<34} {name}: {figures}compile {extra['compile']}")
        for name in ("sjd", "sjd+relaxed"):
            report.ratio("hf_decode", case, "ar", name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["janus", "chameleon", "emu3"])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--sections", nargs="+", default=["overhead", "decode"], choices=["overhead", "decode"])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the tiny models' forwards)")
    parser.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                        help="overhead on the CPU: this process's CPU time (one thread: an idle machine's wall time)")
    parser.add_argument("--compile", default="auto", choices=sorted(COMPILE_CHOICES),
                        help="lantern.generate's compile for the decode section (auto: compiled on a GPU)")
    parser.add_argument("--rehearse", action="store_true",
                        help="every section once on a cut-down model of --shape (1 layer, 4 x 4 image), 2 repeats")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    overrides = dict(REHEARSAL) if args.rehearse else {}
    if args.rehearse:
        args.repeats, args.decode_repeats = 2, 1
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    clock = time.process_time if device.type == "cpu" and args.clock == "cpu" else time.perf_counter
    report = Report()
    print(f"lantern.hf bench: shape {args.shape}, {args.dtype}, {device}, transformers "
          f"{__import__('transformers').__version__}")
    for kind in args.kinds:
        t0 = time.perf_counter()
        m, target = build(kind, args.shape, dtype, device, **overrides)
        print(f"{kind}: built in {time.perf_counter() - t0:.1f} s")
        torch.manual_seed(0)
        if "overhead" in args.sections:
            overhead(report, kind, m, target, args.batches, args.repeats, device, clock)
        if "decode" in args.sections:
            decode(report, kind, m, target, args.batches, device, args.decode_repeats,
                   COMPILE_CHOICES[args.compile])
        del m, target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        report.write(args.json)


if __name__ == "__main__":
    main()
