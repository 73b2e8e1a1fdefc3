"""The measuring steps of `make gpu-check` (tools/gpu_check.py runs each in a subprocess of its own):

    python -m tools.gpu_check_steps STEP --work DIR --deadline UNIX_TIME [--rehearse]

A step writes <DIR>/<STEP>.json (atomically, after every check): {passed, failed, errors, figures[, skip]}.
Each case runs inside ``Results.case``, which turns an exception into a failed check with its message, so one
broken case never hides the others; a step stops starting new cases when its deadline is near and says which
it left out. ``--rehearse`` runs the same code on the CPU with tiny sizes (the Triton kernels under the
interpreter, gloo instead of nccl, no compute-sanitizer).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

AGREEMENT = 0.999  # verify: share of rows that must agree exactly (tests/op_cases.py: float32 rounding ties)


# ---- results ----------------------------------------------------------------------------------------------

class Results:
    """One step's checks and figures, rewritten atomically to its JSON file after every change."""

    def __init__(self, path: str, deadline: float):
        self.path, self.deadline = path, deadline
        self.data: Dict = dict(passed=0, failed=0, errors=[], figures={}, left_out=[])
        self.save()

    def save(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(self.path))
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, self.path)

    @property
    def figures(self) -> Dict:
        return self.data["figures"]

    def put(self, value, *path: str) -> None:
        """figures[path[0]][path[1]]... = value"""
        node = self.figures
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        self.save()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.data["passed" if ok else "failed"] += 1
        if not ok:
            self.data["errors"].append(f"{name}: {detail}"[:2000])
        print(f"gpu-check-step: {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""),
              flush=True)
        self.save()
        return ok

    def skip(self, reason: str) -> None:
        self.data["skip"] = reason
        self.save()

    def time_left(self) -> float:
        return self.deadline - time.time()

    def has_time(self, name: str, needed_s: float) -> bool:
        """Whether ``needed_s`` seconds remain before the deadline; if not, ``name`` is recorded as left out."""
        if self.time_left() >= needed_s:
            return True
        self.data["left_out"].append(name)
        print(f"gpu-check-step: left out {name}: {self.time_left():.0f} s left, about {needed_s:.0f} s needed",
              flush=True)
        self.save()
        return False

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        """A case whose exception is a failed check (with the error's last lines), not the end of the step."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc().strip().splitlines()
            self.check(name, False, f"{type(e).__name__}: {e} | " + " | ".join(tb[-4:]))


@dataclass
class Context:
    device: torch.device
    rehearse: bool
    work: str

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def gpu_backends(self) -> List[str]:
        """The backends under test: cuda and triton on a GPU; triton (interpreted) in a rehearsal."""
        return ["triton"] if self.rehearse else ["cuda", "triton"]

    def seconds(self, fn: Callable[[], object], repeats: int = 10, warmup: int = 2) -> float:
        """Median seconds of ``fn``: CUDA events on a GPU, the wall clock on the CPU."""
        from bench.common import cuda_median_seconds, median_seconds

        if self.device.type == "cuda":
            return cuda_median_seconds(fn, repeats=repeats, warmup=warmup)
        return median_seconds(fn, repeats=repeats, warmup=warmup)


def _rows_equal(a, b) -> torch.Tensor:
    """[B] bool: row b of every field of two VerifyResults equal."""
    same = torch.ones(a.accept_len.shape[0], dtype=torch.bool)
    for x, y in zip(a, b):
        x, y = x.cpu(), y.cpu()
        same &= (x == y).reshape(x.shape[0], -1).all(dim=1)
    return same


# ---- selfcheck --------------------------------------------------------------------------------------------

def step_selfcheck(r: Results, ctx: Context) -> None:
    import lantern
    from lantern import _backend

    r.put(lantern.build_info(), "build_info")
    r.check("lantern._C imports", _backend._why_unavailable("cpu") is None, str(_backend._why_unavailable("cpu")))
    for backend in ctx.gpu_backends():
        why = _backend._why_unavailable(backend)
        r.put(why or "available", "backends", backend)
        r.check(f"backend {backend} is available", why is None, str(why))
    t0 = time.perf_counter()
    report = lantern.run_self_checks(ctx.device)
    r.put(round(time.perf_counter() - t0, 2), "self_checks_s")
    r.put({f"{b} {op} {dev}": why or "agrees" for (b, op, dev), why in sorted(report.items())}, "self_checks")
    for (backend, op, dev), why in sorted(report.items()):
        r.check(f"self-check {backend} {op} ({dev})", why is None, str(why))
    for backend in ctx.gpu_backends():
        r.check(f"backend {backend} has self-checked kernels", any(b == backend for b, _, _ in report),
                f"no {backend} kernel was checked on {ctx.device}")


# ---- ops: every GPU kernel against the CPU kernels ----------------------------------------------------------

def _verify_cases(rehearse: bool) -> List[tuple]:
    """(label, args on the CPU, kwargs): LlamaGen's shape with LANTERN's settings, sampled drafts (exact), and
    greedy rows; tiny in a rehearsal."""
    from bench.bench_verify import SETTINGS, inputs

    B, T, V, K = (2, 7, 64, 8) if rehearse else (64, 59, 16384, 1000)
    logits, uncond, tokens, parents, neighbours = inputs(B, T=T, V=V, K=K)
    lantern_kw = dict(SETTINGS, k=min(SETTINGS["k"], K), top_k=min(SETTINGS["top_k"], V // 2), uncond_logits=uncond)
    drafts = torch.softmax(logits / 2, dim=-1)
    return [("lantern", (logits, tokens, parents, neighbours), lantern_kw),
            ("sampled drafts", (logits, tokens, parents), dict(draft_probs=drafts, seed=7, offset=3)),
            ("greedy", (logits, tokens, parents, neighbours), dict(lantern_kw, temperature=0.0))]


def _check_verify(r: Results, ctx: Context, backend: str) -> None:
    import lantern
    from lantern import ops

    for label, args, kwargs in _verify_cases(ctx.rehearse):
        name = f"verify {backend} == cpu ({label}, B={args[0].shape[0]}, V={args[0].shape[2]})"
        with r.case(name):
            with lantern.fused("cpu"):
                want = ops.verify(*args, **kwargs)
            moved = [a.to(ctx.device) for a in args]
            kw = {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            with lantern.fused(backend):
                got = ops.verify(*moved, **kw)
            same = _rows_equal(got, want)
            rate = float(same.float().mean())
            r.put(rate, "verify", backend, label)
            bad = same.logical_not().nonzero().flatten().tolist()[:5]
            r.check(name, rate >= AGREEMENT, f"{rate:.4f} of rows agree; first differing rows {bad}")


def _check_exact(r: Results, name: str, got, want) -> None:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    same = all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    r.check(name, same, "results differ")


def _check_latent_neighbours(r: Results, ctx: Context, backend: str) -> None:
    import lantern
    from lantern import ops

    V, d, K = (40, 4, 6) if ctx.rehearse else (16384, 8, 1000)
    codebook = torch.randn(V, d, generator=torch.Generator().manual_seed(3))
    for normalize in (False, True):
        name = f"latent_neighbours {backend} == cpu (V={V}, K={K}, normalize={normalize})"
        with r.case(name):
            # normalised rows are the normalising device's bits (norm rounds differently on a GPU): the cpu
            # kernel gets the rows normalised on ctx.device, so the tables must still agree bit for bit
            rows = F.normalize(codebook.to(ctx.device), dim=1).cpu() if normalize else codebook
            with lantern.fused("cpu"):
                want = ops.latent_neighbours(rows, K, False)
            with lantern.fused(backend):
                got = ops.latent_neighbours(codebook.to(ctx.device), K, normalize)
            _check_exact(r, name, got, want)


def _check_tree_attention(r: Results, ctx: Context, backend: str) -> None:
    import lantern
    from bench.bench_tree_attention import inputs
    from lantern import ops

    shapes = [(8, dict(B=2, H=4, T=5, Dh=16))] if ctx.rehearse else [(256, dict()), (1024, dict(B=8, H=20, T=16))]
    for L, shape in shapes:
        q, k, v, cache_len, mask = inputs(L, **shape)
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            name = f"tree_attention {backend} ~ cpu (L={L}, {dtype})"
            with r.case(name):
                q_, k_, v_ = (t.to(dtype) for t in (q, k, v))
                with lantern.fused("cpu"):
                    want = ops.tree_attention(q_, k_, v_, cache_len, mask).float()
                with lantern.fused(backend):
                    got = ops.tree_attention(*(t.to(ctx.device) for t in (q_, k_, v_, cache_len, mask))).float().cpu()
                err = float((got - want).abs().max())
                r.put(err, "tree_attention_max_abs_err", backend, f"L={L} {dtype}")
                r.check(name, err <= tol, f"max |difference| {err:.3g} > {tol}")


def _check_compact_kv(r: Results, ctx: Context, backend: str) -> None:
    import lantern
    from lantern import ops

    layers, B, Hkv, Lmax, Dh = (2, 2, 2, 12, 8) if ctx.rehearse else (36, 8, 20, 400, 64)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(layers, 2, B, Hkv, Lmax, Dh, generator=g).to(torch.bfloat16)
    cache_len = torch.randint(1, Lmax // 2, (B,), generator=g)
    P = min(6, Lmax // 2 - 1)
    path = torch.stack([torch.randperm(Lmax // 2 - 1, generator=g)[:P] for _ in range(B)])
    n_keep = torch.randint(0, P + 1, (B,), generator=g)
    path[torch.arange(P)[None] >= n_keep[:, None]] = -1
    name = f"compact_kv {backend} == cpu ({layers} layers, B={B}, bf16)"
    with r.case(name):
        want_cache = cache.clone()
        with lantern.fused("cpu"):
            want_len = ops.compact_kv(want_cache, cache_len, path, n_keep)
        got_cache = cache.to(ctx.device)
        with lantern.fused(backend):
            got_len = ops.compact_kv(got_cache, *(t.to(ctx.device) for t in (cache_len, path, n_keep)))
        _check_exact(r, name, (got_len, got_cache), (want_len, want_cache))


def _check_continuous_verify(r: Results, ctx: Context, backend: str) -> None:
    import lantern
    from lantern import ops

    B, N, C = (2, 3, 4) if ctx.rehearse else (32, 8, 16)
    g = torch.Generator().manual_seed(9)
    draft, mu_p, mu_q = (torch.randn(B, N, C, generator=g) for _ in range(3))
    sigma_p, sigma_q = (torch.rand(B, N, C, generator=g) + 0.5 for _ in range(2))
    logsig_p, logsig_q = sigma_p.log().sum(-1), sigma_q.log().sum(-1)
    args = (draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q)
    for rule, settings in (("exact", {}), ("paper", dict(bandwidth=2.0, sigma_ratio="code"))):
        name = f"continuous_verify {backend} == cpu ({rule}, B={B}, N={N}, C={C})"
        with r.case(name):
            with lantern.fused("cpu"):
                want = ops.continuous_verify(*args, rule=rule, **settings, seed=11, offset=2)
            with lantern.fused(backend):
                got = ops.continuous_verify(*(a.to(ctx.device) for a in args), rule=rule, **settings, seed=11,
                                            offset=2)
            same = torch.equal(got.accepted.cpu(), want.accepted) and torch.equal(got.tries.cpu(), want.tries)
            err = float((got.tokens.cpu() - want.tokens).abs().max())
            r.check(name, same and err <= 1e-4, f"decisions equal: {same}, max |token difference| {err:.3g}")


def _check_philox(r: Results, ctx: Context, backend: str) -> None:
    import lantern
    from lantern import ops

    n = 1000 if ctx.rehearse else 1 << 20
    c0 = torch.arange(n, dtype=torch.int64) * 2654435761 % (1 << 32)
    args = (2**64 - 5, c0, 7, torch.arange(4).view(4, 1), 2**32 - 1)
    name = f"philox_uniform {backend} == cpu ({4 * n} uniforms)"
    with r.case(name):
        with lantern.fused("cpu"):
            want = ops.philox_uniform(*args)
        with lantern.fused(backend):
            got = ops.philox_uniform(args[0], c0.to(ctx.device), 7, args[3].to(ctx.device), args[4])
        _check_exact(r, name, got, want)


OP_CHECKS = {
    "verify": _check_verify,
    "latent_neighbours": _check_latent_neighbours,
    "tree_attention": _check_tree_attention,
    "compact_kv": _check_compact_kv,
    "continuous_verify": _check_continuous_verify,
    "philox_uniform": _check_philox,
}


def step_ops(r: Results, ctx: Context) -> None:
    import lantern
    from lantern import _backend

    lantern.enable_fused("cpu")  # loads the backends
    if _backend._why_unavailable("cpu") is not None:
        r.check("the cpu backend (the yardstick) is available", False, _backend._why_unavailable("cpu"))
        return
    for backend in ctx.gpu_backends():
        why = _backend._why_unavailable(backend)
        if not r.check(f"backend {backend} is available", why is None, str(why)):
            continue
        for op, check in OP_CHECKS.items():
            if op not in _backend._REGISTRY[backend]:
                continue  # philox_uniform has no Triton kernel
            if r.has_time(f"{op} on {backend}", 5.0):
                t0 = time.perf_counter()
                with r.case(f"{op} on {backend}"):
                    check(r, ctx, backend)
                r.put(round(time.perf_counter() - t0, 2), "seconds", f"{op} {backend}")
    report = _backend.self_check_report()
    disabled = {f"{b} {op}": why for (b, op, _), why in report.items() if why and b in ctx.gpu_backends()}
    r.check("no kernel under test was disabled by its self-check", not disabled, str(disabled))


# ---- e2e: the tiny model ----------------------------------------------------------------------------------

def _tiny(device: torch.device, dtype=None):
    from lantern.neighbours import neighbour_table
    from lantern.pretrained import load_tiny, load_tiny_drafter

    tiny = load_tiny(str(device), dtype=dtype)
    drafter = load_tiny_drafter(tiny.gpt)
    table = neighbour_table(tiny.vq.quantize.embedding.weight, 1000, normalize=True)
    defaults = tiny.meta.get("sampling", {})
    sampling = dict(cfg_scale=defaults.get("cfg_scale", 2.0), top_k=defaults.get("top_k", 0),
                    top_p=defaults.get("top_p", 1.0), temperature=defaults.get("temperature", 1.0))
    return tiny, drafter, table.to(device), sampling


def _greedy(r: Results, ctx: Context, length: Optional[int]) -> None:
    """Greedy (temperature 0) tokens of the tiny model in float32 (TF32 off) on the device equal the CPU path's;
    exact speculative decoding's greedy tokens on the device equal AR's."""
    import lantern

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    B = 2 if ctx.rehearse else 8
    dev_tiny, drafter, _, sampling = _tiny(ctx.device, torch.float32)
    cpu_tiny = _tiny(torch.device("cpu"), torch.float32)[0]
    labels = torch.arange(B) % dev_tiny.gpt.config.num_classes
    greedy = dict(sampling, temperature=0.0, length=length, seed=0, compile=False)  # the kernels, not graphs
    with lantern.fused("cpu"):
        want = lantern.generate(cpu_tiny.gpt, labels, method="ar", **greedy)[0]
    with lantern.fused("auto"):
        got = lantern.generate(dev_tiny.gpt, labels.to(ctx.device), method="ar", **greedy)[0].cpu()
        spec = lantern.generate(dev_tiny.gpt, labels.to(ctx.device), method="spec", drafter=drafter, tree="dynamic",
                                **greedy)[0].cpu()
    differ = (got != want).nonzero().tolist()
    r.put(not differ, "greedy", "equal")
    r.put(len(differ), "greedy", "tokens_differing")
    r.put(got.numel(), "greedy", "tokens")
    r.check(f"greedy AR tokens on {ctx.device} == cpu ({B} images)", not differ,
            f"{len(differ)} of {got.numel()} tokens differ, first at (image, position) {differ[:3]}")
    r.check(f"greedy speculative tokens == greedy AR tokens on {ctx.device}", torch.equal(spec, got),
            f"{int((spec != got).sum())} tokens differ")


# the contenders of the speed comparison: lantern.generate options (drafter and neighbours added)
E2E_METHODS = {
    "ar": dict(method="ar"),
    "lantern": dict(method="lantern", tree="dynamic", depth=5, n_nodes=15, k=1000, delta=0.1),
    "sjd": dict(method="sjd", tree="chain", window=8),
}


E2E_ORDER = (("reference", "graphs"), ("ar", "graphs"), ("lantern", "graphs"), ("ar", "eager"), ("lantern", "eager"),
             ("sjd", "eager"), ("sjd", "graphs"))


def _reference_ar(gpt, compile: bool):
    """bench/reference_ar.py's compiled AR loop over ``gpt``'s weights (CUDA graphs on a GPU; eager in a
    rehearsal, where inductor's compile would take most of its budget)."""
    from bench.reference_ar import ReferenceAR, ReferenceGPT

    return ReferenceAR(ReferenceGPT.from_lantern(gpt), compile=compile)


def _small_models(device: torch.device):
    """A 2-layer random GPT (dim 64, V 64, 16 tokens), its EAGLE drafter and a neighbour table: the rehearsal's
    stand-in for the tiny model in the speed runs (torch.compile traces it in seconds)."""
    from lantern import ops
    from lantern.models import build_gpt
    from lantern.models.drafter import EagleDrafter

    torch.manual_seed(0)
    gpt = build_gpt("GPT-tiny", n_layer=2, n_head=2, dim=64, vocab_size=64, num_classes=5, block_size=16)
    drafter = EagleDrafter(gpt.config).bind(gpt)
    for p in (*gpt.parameters(), *drafter.parameters()):
        torch.nn.init.normal_(p, std=0.1)
    table = ops.latent_neighbours(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), 16)
    sampling = dict(cfg_scale=2.0, top_k=0, top_p=1.0, temperature=1.0)
    return gpt.to(device).eval(), drafter.to(device).eval(), table.to(device), sampling


def _time_generate(r: Results, ctx: Context, B: int, key: str, generate: Callable, repeats: int):
    """Median seconds of ``generate(seed)`` over ``repeats`` calls after a first call (which compiles the
    graphs) and the last call's stats; recorded under ``B=<B>`` / ``key``."""
    t0 = time.perf_counter()
    generate(0)
    ctx.sync()
    r.put(round(time.perf_counter() - t0, 2), "first_call_s", f"B={B}", key)
    runs, stats = [], None
    for i in range(repeats):
        t0 = time.perf_counter()
        _, stats = generate(1 + i)
        ctx.sync()
        runs.append(time.perf_counter() - t0)
    seconds = statistics.median(runs)
    r.put(round(seconds, 4), "seconds", f"B={B}", key)
    return seconds, stats


def _e2e_speed(r: Results, ctx: Context) -> None:
    import lantern

    if ctx.rehearse:
        gpt, drafter, table, sampling = _small_models(ctx.device)
    else:
        tiny, drafter, table, sampling = _tiny(ctx.device)
        gpt = tiny.gpt
    compile_opt = {"backend": "aot_eager"} if ctx.rehearse else True  # True: reduce-overhead (CUDA graphs)
    batches = (1,) if ctx.rehearse else (1, 8, 64)
    repeats = 1 if ctx.rehearse else 3
    reference = _reference_ar(gpt, compile=not ctx.rehearse)
    for B in batches:
        labels = (torch.arange(B) % gpt.config.num_classes).to(ctx.device)
        times, taus = {}, {}
        for name, mode in E2E_ORDER:
            key = f"{name} {mode}"
            if name == "reference":  # the gpt-fast-style loop every speed-up is held against (bench/reference_ar.py)
                if r.has_time(f"B={B} {key}", 20.0):
                    with r.case(f"e2e B={B} {key}"):
                        times[key], _ = _time_generate(r, ctx, B, key, lambda seed: (reference.generate(
                            labels, cfg_scale=sampling["cfg_scale"], temperature=sampling["temperature"],
                            top_k=sampling["top_k"], seed=seed), None), repeats)
                        r.check(f"e2e B={B} {key} ran", True)
                continue
            options = dict(E2E_METHODS[name])
            if name == "lantern":
                options.update(drafter=drafter, neighbours=table, k=min(options["k"], table.shape[1]))
            options["compile"] = compile_opt if mode == "graphs" else False  # "auto" would compile on a GPU
            if not r.has_time(f"B={B} {key}", 20.0 if mode == "graphs" else 5.0):
                continue
            with r.case(f"e2e B={B} {key}"):
                times[key], stats = _time_generate(
                    r, ctx, B, key, lambda seed: lantern.generate(gpt, labels, **options, **sampling, seed=seed),
                    repeats)
                if stats is not None:
                    taus[key] = round(stats.emitted / max(stats.row_steps, 1), 3)
                    r.put(taus, "tau", f"B={B}")
                r.check(f"e2e B={B} {key} ran", True)
            base = times.get("ar graphs")
            if base:
                r.put({k: round(base / t, 3) for k, t in times.items()}, "speedups", f"B={B}")
            anchor = times.get("reference graphs")
            if anchor:
                r.put({k: round(anchor / t, 3) for k, t in times.items()}, "vs_reference", f"B={B}")
            if B == 1 and key == "lantern graphs" and key in times and r.has_time("B=1 lantern graphs profile", 10.0):
                with r.case("e2e B=1 lantern graphs profile"):
                    _profile_generate(r, ctx, lambda: lantern.generate(gpt, labels, **options, **sampling, seed=99))


PROFILE_TOP = 15


def _profile_generate(r: Results, ctx: Context, generate: Callable) -> None:
    """One ``generate`` under torch.profiler: per step, the aten op events on the host (nested ones included;
    a replayed CUDA graph's ops are one cudaGraphLaunch), the kernels and graphs launched, and the ops and
    kernels that took the most time; under ``profile/B=1 lantern graphs``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _, stats = generate()
        ctx.sync()
    steps = max(stats.steps, 1)
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    launches = sum(n for name, n in count.items() if name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    aten = [e for e in events if e.key.startswith("aten::")]
    device_time = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    kernels = [e for e in events if getattr(e, device_time, 0) > 0 and not e.key.startswith(("aten::", "lantern"))]
    figures = dict(
        steps=stats.steps,
        aten_op_events_per_step=round(sum(e.count for e in aten) / steps, 1),
        kernel_launches_per_step=round(launches / steps, 1),
        graph_launches_per_step=round(count.get("cudaGraphLaunch", 0) / steps, 1),
        syncs_per_step=round(sum(count.get(k, 0) for k in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                             "aten::_local_scalar_dense")) / steps, 1),
        top_host_ops_us_per_step={e.key: round(e.self_cpu_time_total / steps, 1) for e in
                                  sorted(aten, key=lambda e: -e.self_cpu_time_total)[:PROFILE_TOP]},
        top_kernels_us_per_step={e.key[:80]: round(getattr(e, device_time) / steps, 1) for e in
                                 sorted(kernels, key=lambda e: -getattr(e, device_time))[:PROFILE_TOP]},
    )
    r.put(figures, "profile", "B=1 lantern graphs")
    r.check("e2e B=1 lantern graphs profiled", stats.steps > 0)


def step_e2e(r: Results, ctx: Context) -> None:
    import lantern

    lantern.enable_fused("auto")
    with r.case("greedy tokens"):
        _greedy(r, ctx, 8 if ctx.rehearse else None)
    _e2e_speed(r, ctx)


# ---- cost curve: LlamaGen shapes ---------------------------------------------------------------------------

COST_NODES = (1, 4, 8, 16, 32, 64)


def _graph_forward(ctx: Context, forward: Callable[[], object]) -> Callable[[], object]:
    """``forward`` replayed from a CUDA graph on a GPU (captured after a warm-up on a side stream); itself on
    the CPU."""
    if ctx.device.type != "cuda":
        return forward
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def _tree_parents(T: int) -> torch.Tensor:
    from bench.bench_verify import dynamic_tree_parents

    return dynamic_tree_parents(T)


def _cost_model(r: Results, ctx: Context, name: str, config: dict, batches, nodes, drafter_depth: int = 5) -> None:
    import lantern
    from lantern.models import build_gpt
    from lantern.models.drafter import EagleDrafter
    from lantern.ops import checks
    from lantern.ops.reference.tree import ancestor_mask

    with torch.device(ctx.device):
        model = build_gpt(*config["args"], **config.get("kwargs", {})).to(torch.bfloat16).eval()
        drafter = EagleDrafter(model.config).bind(model).to(torch.bfloat16).eval()
    cfg = model.config
    prefix = cfg.cond_len + cfg.block_size // 2  # mid-image
    r.put(dict(layers=cfg.n_layer, dim=cfg.dim, params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1)),
          name, "shape")
    for B in batches:
        rows = 2 * B  # classifier-free guidance
        if not r.has_time(f"{name} B={B}", 10.0):
            continue
        with r.case(f"cost curve {name} B={B}"), torch.inference_mode(), checks.values_checked_by_caller(), \
                lantern.fused("auto"):
            model.setup_cache(rows, prefix + max(nodes) + 1)
            cache_len = torch.full((rows,), prefix, dtype=torch.int64, device=ctx.device)
            times = {}
            for T in nodes:
                tokens = torch.zeros(rows, T, dtype=torch.int64, device=ctx.device)
                positions = (torch.arange(T, device=ctx.device) + prefix - cfg.cond_len).expand(rows, T).contiguous()
                mask = ancestor_mask(_tree_parents(T).to(ctx.device).expand(rows, T).contiguous())
                replay = _graph_forward(ctx, lambda: model(tokens, cache_len=cache_len, positions=positions,
                                                           tree_mask=mask))
                times[T] = ctx.seconds(replay, repeats=3 if ctx.rehearse else 10, warmup=1)
                del replay
            drafter.reset(None, rows, prefix + max(nodes) + 1)
            drafter.cache_len = torch.full((rows,), prefix - 1, dtype=torch.int64, device=ctx.device)
            width = 4
            d_tokens = torch.zeros(rows, width, dtype=torch.int64, device=ctx.device)
            d_parents = (torch.arange(width, device=ctx.device) - 1).expand(rows, width).contiguous()
            state = torch.randn(rows, width, cfg.dim, device=ctx.device, dtype=torch.bfloat16)
            d_positions = (torch.arange(width, device=ctx.device) + prefix - 1).expand(rows, width).contiguous()
            depth_s = ctx.seconds(lambda: drafter.expand(d_tokens, d_parents, state, d_positions),
                                  repeats=3 if ctx.rehearse else 10, warmup=1)
            drafter.release()
            model.free_cache()
            row = {f"T={T}": round(t * 1e3, 4) for T, t in times.items()}
            row["drafter_depth_ms"] = round(depth_s * 1e3, 4)
            if 16 in times:
                row["t16_over_t1"] = round(times[16] / times[1], 3)
            r.put(row, name, f"B={B}")
            r.check(f"cost curve {name} B={B} measured", all(t > 0 for t in times.values()))
            _projection(r, name, B, times, depth_s, drafter_depth)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


def _projection(r: Results, name: str, B: int, times: Dict[int, float], depth_s: float, depth: int) -> None:
    """Speed-up over AR of a LANTERN step of a 16-node tree (or the largest measured) and ``depth`` drafter
    depths, with the tiny model's measured tau: tau * t(1) / (t(tree) + depth * t(drafter depth))."""
    e2e = _read(os.path.join(r.path.rsplit(os.sep, 1)[0], "e2e.json"))
    taus = ((e2e or {}).get("figures", {}).get("tau", {}) or {}).get("B=1", {})
    tau = taus.get("lantern eager") or taus.get("lantern graphs")
    tree = 16 if 16 in times else max(times)
    if tau is None:
        r.put("no tau: the e2e step measured no LANTERN run", name, f"B={B}", "projected_speedup")
        return
    step = times[tree] + depth * depth_s
    r.put(dict(tau=tau, tree_nodes=tree, drafter_depths=depth, speedup=round(tau * times[1] / step, 3)),
          name, f"B={B}", "projected_speedup")


def _read(path: str) -> Optional[Dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def step_cost_curve(r: Results, ctx: Context) -> None:
    if ctx.rehearse:
        tiny = dict(n_head=2, dim=64, vocab_size=64, num_classes=5, block_size=64)
        shapes = {"GPT-B": dict(args=("GPT-tiny",), kwargs=dict(tiny, n_layer=2)),
                  "GPT-XL": dict(args=("GPT-tiny",), kwargs=dict(tiny, n_layer=3))}
        batches, nodes = (1,), (1, 4, 16)
    else:
        shapes = {"GPT-B": dict(args=("GPT-B",)), "GPT-XL": dict(args=("GPT-XL",))}
        batches, nodes = (1, 8, 32), COST_NODES
    r.put("random weights, bfloat16, rows = 2 x batch (guidance), CUDA graphs on a GPU, ms per forward", "note")
    for name, config in shapes.items():
        _cost_model(r, ctx, name, config, batches, nodes)


# ---- microbench -------------------------------------------------------------------------------------------

def _copy_bandwidth(ctx: Context) -> float:
    """Bytes read + written per second by a device-to-device copy of a large buffer."""
    n = (16 if ctx.rehearse else 1024) << 20
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return 2 * n / ctx.seconds(lambda: dst.copy_(src), repeats=5 if ctx.rehearse else 20, warmup=2)


def _micro_cases(ctx: Context) -> Dict[str, tuple]:
    """name -> (op, args builder on the device, bytes the op must move at least)."""
    from bench.bench_tree_attention import inputs as attention_inputs
    from bench.bench_verify import SETTINGS
    from bench.bench_verify import inputs as verify_inputs

    dev = ctx.device
    cases = {}
    T, V, K = (7, 64, 8) if ctx.rehearse else (59, 16384, 1000)
    for B in ((1, 2) if ctx.rehearse else (1, 8, 64)):
        logits, uncond, tokens, parents, neighbours = (t.to(dev) for t in verify_inputs(B, T=T, V=V, K=K))
        kw = dict(SETTINGS, k=min(SETTINGS["k"], K), top_k=min(SETTINGS["top_k"], V // 2), uncond_logits=uncond)
        cases[f"verify B={B} T={T} V={V}"] = (
            "verify", lambda a=(logits, tokens, parents, neighbours), kw=kw: (a, kw), 2 * logits.numel() * 4)
    L = 32 if ctx.rehearse else 1024
    q, k, v, cache_len, mask = (t.to(dev) for t in attention_inputs(L, **(dict(B=2, H=2, T=5, Dh=16)
                                                                             if ctx.rehearse else {})))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    cases[f"tree_attention L={L} bf16"] = ("tree_attention", lambda: ((q, k, v, cache_len, mask), {}),
                                            2 * (q.numel() + k.numel() + v.numel() + q.numel()))
    layers, B, Hkv, Lmax, Dh, keep = (2, 2, 2, 12, 8, 3) if ctx.rehearse else (36, 8, 20, 400, 64, 4)
    cache = torch.zeros(layers, 2, B, Hkv, Lmax, Dh, dtype=torch.bfloat16, device=dev)
    cache_lens = torch.full((B,), 5, device=dev)
    path = torch.arange(keep, device=dev).expand(B, keep).contiguous()
    n_keep = torch.full((B,), keep, device=dev)
    cases[f"compact_kv {layers} layers B={B} keep {keep}"] = (
        "compact_kv", lambda: ((cache, cache_lens, path, n_keep), {}), 2 * 2 * layers * 2 * B * Hkv * keep * Dh)
    Bc, N, C = (2, 3, 4) if ctx.rehearse else (32, 8, 16)
    draft, mu_p, mu_q = (torch.randn(Bc, N, C, device=dev) for _ in range(3))
    sigma_p, sigma_q = (torch.rand(Bc, N, C, device=dev) + 0.5 for _ in range(2))
    sums = (sigma_p.log().sum(-1), sigma_q.log().sum(-1))
    cases[f"continuous_verify B={Bc} N={N} C={C}"] = (
        "continuous_verify", lambda: ((draft, mu_p, sigma_p, mu_q, sigma_q, *sums), dict(seed=1)),
        4 * (6 * draft.numel() + 2 * sums[0].numel()))
    Vn, Kn = (40, 6) if ctx.rehearse else (16384, 1000)
    codebook = torch.randn(Vn, 8, device=dev)
    cases[f"latent_neighbours V={Vn} K={Kn}"] = ("latent_neighbours", lambda: ((codebook, Kn), {}), 4 * Vn * Kn)
    counters = torch.arange(1000 if ctx.rehearse else 1 << 22, device=dev)
    cases[f"philox_uniform {counters.numel()}"] = (
        "philox_uniform", lambda: ((5, counters, 0, 0, 0), {}), 8 * counters.numel() + 4 * counters.numel())
    return cases


def step_microbench(r: Results, ctx: Context) -> None:
    import lantern
    from lantern import _backend
    from lantern.ops import checks

    lantern.enable_fused("auto")
    bandwidth = _copy_bandwidth(ctx)
    r.put(round(bandwidth / 1e9, 1), "copy_GB_per_s")
    r.check("copy bandwidth measured", bandwidth > 0)
    backends = ["cpu"] if ctx.rehearse else ctx.gpu_backends()
    for name, (op, build, min_bytes) in _micro_cases(ctx).items():
        for backend in backends:
            impl = _backend._REGISTRY[backend].get(op)
            if impl is None or _backend._why_unavailable(backend) is not None:
                continue
            if not r.has_time(f"{name} {backend}", 3.0):
                continue
            with r.case(f"microbench {name} {backend}"), checks.values_checked_by_caller():
                args, kwargs = build()
                seconds = ctx.seconds(lambda: impl(*args, **kwargs), repeats=5 if ctx.rehearse else 20, warmup=2)
                achieved = min_bytes / seconds
                r.put(dict(us=round(seconds * 1e6, 2), GB_per_s=round(achieved / 1e9, 2),
                           of_copy_bandwidth=round(achieved / bandwidth, 4)), "ops", name, backend)
                r.check(f"microbench {name} {backend} timed", seconds > 0)
                if name.startswith("verify B=1 "):
                    over = round(seconds / (min_bytes / bandwidth), 2)
                    best = r.figures.get("verify_over_logits_read")
                    r.put(over if best is None else min(best, over), "verify_over_logits_read")


# ---- memcheck ---------------------------------------------------------------------------------------------

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def step_memcheck(r: Results, ctx: Context) -> None:
    from tools.cuda_resources import cuda_home, find_tool

    driver = [sys.executable, "-m", "tools.sanitize_cuda_ops"]
    env = dict(os.environ)
    if ctx.rehearse:  # no compute-sanitizer: the driver's calls on the cpu backend
        argv = driver + ["--rehearse"]
    else:
        sanitizer = find_tool("compute-sanitizer")
        if sanitizer is None:
            r.skip(f"compute-sanitizer not found in {cuda_home()}/bin or on PATH")
            return
        argv = [sanitizer, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "200"] + driver
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # each tensor its own allocation: memcheck sees overruns
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(r.time_left(), 5.0))
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text, code = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), None
    print(text[-20000:], flush=True)
    ran = re.findall(r"sanitize_cuda_ops: (\w+) ran", text)
    r.put(ran, "ops_ran")
    for op in ran:
        r.check(f"memcheck: {op} ran", True)
    r.check("the driver finished", "sanitize_cuda_ops: OK" in text, f"exit status {code}")
    if not ctx.rehearse:
        errors = [int(m) for m in _ERROR_SUMMARY.findall(text)]
        r.put(sum(errors) if errors else None, "errors")
        r.check("memcheck reports 0 errors", errors == [0] * len(errors) and bool(errors),
                f"ERROR SUMMARY: {errors or 'missing'}")


# ---- sample -----------------------------------------------------------------------------------------------

def step_sample(r: Results, ctx: Context) -> None:
    """One ``lantern sample`` in a process group of one rank per GPU (nccl; gloo in a rehearsal), launched by
    torchrun: with one GPU, NCCL allows one rank (two ranks may not share a device), so the run checks the
    launch, the group and a collective on the device around the sampler."""
    nproc = 1 if ctx.rehearse else max(1, torch.cuda.device_count())
    out = os.path.join(tempfile.mkdtemp(prefix="lantern-gpu-check-sample-"), "run")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "tools.gpu_check_steps", "sample-rank", "--work", ctx.work, "--deadline", str(r.deadline),
            "--out", out] + (["--rehearse"] if ctx.rehearse else [])
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=max(r.time_left(), 5.0))
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text, code = str(e.stdout or "") + str(e.stderr or ""), None
    print(text[-20000:], flush=True)
    rank = _read(os.path.join(ctx.work, "sample-rank0.json")) or {}
    r.put(rank, "rank0")
    r.check("torchrun finished", code == 0, f"exit status {code}")
    r.check(f"{rank.get('backend', '?')} group: all_reduce over {rank.get('world', '?')} rank(s)",
            rank.get("all_reduce_ok") is True, str(rank.get("error", "no result from rank 0")))
    images = rank.get("images")
    r.check("lantern sample wrote every image and samples.npz", bool(images) and rank.get("npz") is True,
            f"images {images}, npz {rank.get('npz')}")


def sample_rank(work: str, out: str, rehearse: bool) -> int:
    """One torchrun rank: join the group, run `lantern sample`, all_reduce the image count on the device."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    record: Dict = dict(rank=rank)
    try:
        cuda = torch.cuda.is_available() and not rehearse
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(device)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend)
        record.update(backend=backend, world=dist.get_world_size())
        from lantern.cli import main as lantern_main

        n = 2 if rehearse else 8
        # --compile off: this step checks sampling under nccl. With the default (CUDA graphs on a GPU, each
        # graph's first call 26-55 s in e2e on an H200) it ran past its 48 s there; e2e times the compiled loops
        code = lantern_main(["sample", out, "--num-images", str(n), "--batch", str(n), "--device", device.split(":")[0],
                             "--fused", "auto", "--method", "lantern", "--no-progress", "--seed", "3",
                             "--compile", "off"])
        images = len(os.listdir(os.path.join(out, "images"))) if os.path.isdir(os.path.join(out, "images")) else 0
        record.update(exit_status=code, images=images, npz=os.path.exists(os.path.join(out, "samples.npz")))
        count = torch.tensor([images], device=device)
        dist.all_reduce(count)
        record["all_reduce_ok"] = int(count) == images * dist.get_world_size()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (recorded for the step)
        record["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    path = os.path.join(work, f"sample-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    return 0 if "error" not in record else 1


# ---- main -------------------------------------------------------------------------------------------------

STEPS: Dict[str, Callable[[Results, Context], None]] = {
    "selfcheck": step_selfcheck,
    "ops": step_ops,
    "e2e": step_e2e,
    "cost_curve": step_cost_curve,
    "microbench": step_microbench,
    "memcheck": step_memcheck,
    "sample": step_sample,
}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=[*STEPS, "sample-rank"])
    parser.add_argument("--work", required=True, help="folder for <step>.json")
    parser.add_argument("--deadline", type=float, required=True, help="unix time by which to finish")
    parser.add_argument("--rehearse", action="store_true", help="on the CPU, tiny sizes")
    parser.add_argument("--out", help="sample-rank: the lantern sample folder")
    args = parser.parse_args(argv)
    if args.step == "sample-rank":
        return sample_rank(args.work, args.out, args.rehearse)
    device = torch.device("cpu" if args.rehearse else "cuda")
    r = Results(os.path.join(args.work, f"{args.step}.json"), args.deadline)
    ctx = Context(device, args.rehearse, args.work)
    print(f"gpu-check-step {args.step} on {device}: {r.time_left():.0f} s", flush=True)
    with r.case(f"{args.step} (outside its cases)"):
        STEPS[args.step](r, ctx)
    return 1 if r.data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
