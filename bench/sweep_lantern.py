"""Sweep LANTERN on the tiny default model: τ, wall-clock speed-up over AR and sample quality against δ
(and λ, k, tree size), all measured in one run. Writes JSON and a figure in the style of the paper's
trade-off plot (τ / speed-up / quality against δ, exact speculative decoding as the reference line).

    python -m bench.sweep_lantern [--quick] [--per-class 20] [--batch 10] [--fused cpu]
                                  [--json bench/results/sweep.json] [--figure bench/results/sweep.png]

Every setting generates the same images (the same classes, seeds and batches) with the committed tiny GPT,
its EAGLE drafter and the VQ codebook's neighbour table. Wall times are sums over the batches of one pass;
the AR wall is the median of three AR passes spread over the run (start, middle, end) so that a change in
the machine's load hits both sides of each ratio alike. Quality is the tiny classifier's accuracy and the
Fréchet distance to the dataset in its feature space (lantern.tiny.evaluate).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch

import lantern
from lantern.decoding import generate
from lantern.neighbours import neighbour_table
from lantern.pretrained import load_tiny, load_tiny_drafter
from lantern.tiny.evaluate import evaluate_samples

from .projection import LLAMAGEN, project

TABLE_K = 1000  # neighbours kept in the table (the codebook has 1024 codes); settings use its first k


@dataclass(frozen=True)
class Setting:
    group: str  # "ar" | "tree" (tree size) | "delta" | "k" | "lam"
    method: str  # "ar" | "spec" | "lantern"
    tree: str = "dynamic"
    n_nodes: int = 58
    depth: int = 5
    k: int = 64
    delta: float = 0.0
    lam: Optional[float] = None

    @property
    def label(self) -> str:
        if self.method == "ar":
            return "ar"
        shape = f"chain{self.depth}" if self.tree == "chain" else f"{self.tree}{self.n_nodes + 1}"
        relax = "" if self.method == "spec" else (f" k={self.k} lam={self.lam}" if self.lam is not None
                                                  else f" k={self.k} delta={self.delta}")
        return f"{self.method} {shape}{relax}"


def settings(quick: bool, main_k: int) -> List[Setting]:
    deltas = (0.05, 0.1, 0.2, 0.4) if quick else (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4)
    sizes = (10, 58) if quick else (4, 10, 20, 40, 58)
    out = [Setting("tree", "spec", tree="chain", depth=4)]
    out += [Setting("tree", "spec", n_nodes=n) for n in sizes]
    out += [Setting("tree", "lantern", tree="chain", depth=4, k=main_k, delta=0.2)]
    out += [Setting("tree", "lantern", n_nodes=n, k=main_k, delta=0.2) for n in sizes]
    out += [Setting("delta", "lantern", k=main_k, delta=d) for d in deltas]
    out += [Setting("k", "lantern", k=k, delta=0.2) for k in ((16, 256) if quick else (8, 16, 256, 1000))]
    out += [Setting("lam", "lantern", k=main_k, lam=lam) for lam in ((2.0,) if quick else (1.5, 2.0, 3.0))]
    return out


class Runner:
    def __init__(self, per_class: int, batch: int, seed: int):
        tiny = load_tiny()
        self.gpt, self.vq = tiny.gpt, tiny.vq
        self.sampling = dict(cfg_scale=tiny.meta["sampling"]["cfg_scale"], top_k=tiny.meta["sampling"]["top_k"],
                             temperature=1.0)
        self.drafter = load_tiny_drafter(self.gpt)
        self.table = neighbour_table(self.vq.quantize.embedding.weight, TABLE_K, normalize=True)
        classes = self.gpt.config.num_classes
        self.labels = torch.arange(classes).repeat(per_class)  # batches mix the classes
        self.batch, self.seed = batch, seed

    def run(self, s: Setting) -> dict:
        """One pass over every image: tokens, wall, and the speculative counters summed over batches."""
        tokens, wall = [], 0.0
        emitted = row_steps = target_fw = draft_fw = steps = 0
        for i, start in enumerate(range(0, len(self.labels), self.batch)):
            labels = self.labels[start : start + self.batch]
            t0 = time.perf_counter()
            out, stats = generate(self.gpt, labels, method=s.method, drafter=self.drafter, neighbours=self.table,
                                  tree=s.tree, k=s.k, delta=s.delta, lam=s.lam, depth=s.depth, n_nodes=s.n_nodes,
                                  seed=self.seed + i, **self.sampling)
            wall += time.perf_counter() - t0
            tokens.append(out)
            if stats is None:  # AR: one target forward per token
                L = out.shape[1]
                emitted, row_steps, target_fw = emitted + out.numel(), row_steps + out.numel(), target_fw + L + 1
            else:
                emitted += stats.emitted + len(labels)  # + the first token, sampled at the prefill
                row_steps += stats.row_steps + len(labels)
                target_fw += stats.target_forwards
                draft_fw += stats.draft_forwards
                steps += stats.steps
        tokens = torch.cat(tokens)
        return dict(tokens=tokens, wall_s=wall, tau=emitted / row_steps, target_forwards=target_fw,
                    draft_forwards=draft_fw, verify_steps=steps)

    def quality(self, tokens: torch.Tensor) -> dict:
        side = self.gpt.config.grid_size
        with torch.no_grad():
            images = self.vq.decode_codes(tokens, side, side).float()
        q = evaluate_samples(images, self.labels)
        return dict(class_accuracy=q["class_accuracy"], fd=q["fd"], fd_real_floor=q.get("fd_real_floor"))


def sweep(args) -> dict:
    runner = Runner(args.per_class, args.batch, args.seed)
    todo = settings(args.quick, args.k)
    ar = Setting("ar", "ar")
    ar_walls, rows = [], []
    ar_result = runner.run(ar)
    ar_walls.append(ar_result["wall_s"])
    ar_row = dict(asdict(ar), label="ar", **{k: v for k, v in ar_result.items() if k != "tokens"},
                  **runner.quality(ar_result["tokens"]))
    print(_line(ar_row), flush=True)
    for i, s in enumerate(todo):
        if i == len(todo) // 2:
            ar_walls.append(runner.run(ar)["wall_s"])
        r = runner.run(s)
        row = dict(asdict(s), label=s.label, **{k: v for k, v in r.items() if k != "tokens"},
                   **runner.quality(r["tokens"]))
        rows.append(row)
        print(_line(row), flush=True)
    ar_walls.append(runner.run(ar)["wall_s"])
    ar_wall = statistics.median(ar_walls)
    ar_row["wall_s"] = ar_wall
    for row in rows:
        row["speedup_vs_ar"] = ar_wall / row["wall_s"]
    return dict(ar=ar_row, ar_walls_s=ar_walls, rows=rows, summary=summarise(ar_row, rows),
                images=len(runner.labels), batch=args.batch, sampling=runner.sampling, fused=args.fused or "reference",
                torch_threads=torch.get_num_threads(), load_average=os.getloadavg())


def summarise(ar_row: dict, rows: List[dict]) -> dict:
    """The figures the issue asks for: the CPU-best tree size, τ(LANTERN)/τ(exact) and the accuracy drop."""
    tree_rows = [r for r in rows if r["group"] == "tree"]
    best = max(tree_rows, key=lambda r: r["speedup_vs_ar"])
    exact = next(r for r in rows if r["group"] == "tree" and r["method"] == "spec" and r["tree"] == "dynamic"
                 and r["n_nodes"] == 58)
    lantern_rows = [r for r in rows if r["group"] == "delta" and 0.1 <= r["delta"] <= 0.25]
    return dict(cpu_best_tree=best["label"], cpu_best_speedup_vs_ar=best["speedup_vs_ar"],
                exact_tau=exact["tau"],
                tau_ratio_vs_exact={r["label"]: r["tau"] / exact["tau"] for r in lantern_rows},
                accuracy_drop_points={r["label"]: 100 * (ar_row["class_accuracy"] - r["class_accuracy"])
                                      for r in lantern_rows},
                PROJECTION_h100=[projected(r) for r in [exact] + lantern_rows])


def projected(row: dict) -> dict:
    """A PROJECTION, not a measurement: the measured τ and drafter forwards per step of a dynamic-tree row
    fed to the roofline model of bench/projection.py (LlamaGen GPT-B and GPT-XL on an H100)."""
    per_step = row["draft_forwards"] / max(row["verify_steps"], 1)
    out = {"setting": row["label"], "tau": row["tau"], "draft_forwards_per_step": per_step}
    for model in ("GPT-B", "GPT-XL"):
        for batch in (1, 8):
            p = project(LLAMAGEN[model], row["tau"], per_step, batch, row["n_nodes"] + 1)
            out[f"{model} batch {batch}"] = p["projected_speedup"]
    return out


def _line(r: dict) -> str:
    speed = f"  speed-up {r['speedup_vs_ar']:.2f}x" if "speedup_vs_ar" in r else ""
    return (f"{r['label']:<36} tau {r['tau']:5.2f}  target fw {r['target_forwards']:5d}  draft fw "
            f"{r['draft_forwards']:5d}  wall {r['wall_s']:7.2f}s{speed}  acc {100 * r['class_accuracy']:5.1f}%  "
            f"FD {r['fd']:.2f}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    delta_rows = sorted((r for r in rows if r["group"] == "delta"), key=lambda r: r["delta"])
    exact = next(r for r in rows if r["group"] == "tree" and r["method"] == "spec" and r["n_nodes"] == 58
                 and r["tree"] == "dynamic")
    ar = result["ar"]
    d = [r["delta"] for r in delta_rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    ax = axes[0]
    ax.plot(d, [r["tau"] for r in delta_rows], "o-", label="LANTERN")
    ax.axhline(exact["tau"], color="gray", ls="--", label="exact spec. decoding")
    ax.axhline(1.75 * exact["tau"], color="gray", ls=":", label="1.75 × exact")
    ax.set(xlabel="δ", ylabel="τ (tokens / target forward)", title="acceptance")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(d, [r["speedup_vs_ar"] for r in delta_rows], "o-", label="LANTERN")
    ax.axhline(exact["speedup_vs_ar"], color="gray", ls="--", label="exact spec. decoding")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xlabel="δ", ylabel="wall-clock speed-up vs AR (CPU)", title="speed")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(d, [100 * r["class_accuracy"] for r in delta_rows], "o-", label="accuracy")
    ax.axhline(100 * ar["class_accuracy"], color="gray", ls="--", label="AR")
    ax.set(xlabel="δ", ylabel="classifier accuracy (%)", title="quality")
    twin = ax.twinx()
    twin.plot(d, [r["fd"] for r in delta_rows], "s-", color="tab:red", label="FD")
    twin.axhline(ar["fd"], color="tab:red", ls=":", lw=0.8)
    twin.set_ylabel("Fréchet distance", color="tab:red")
    ax.legend(fontsize=8, loc="lower left")
    ax = axes[3]
    for method, marker in (("spec", "o-"), ("lantern", "s-")):
        tree = sorted((r for r in rows if r["group"] == "tree" and r["method"] == method and r["tree"] == "dynamic"),
                      key=lambda r: r["n_nodes"])
        ax.plot([r["n_nodes"] + 1 for r in tree], [r["speedup_vs_ar"] for r in tree], marker,
                label="exact" if method == "spec" else "LANTERN δ=0.2")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set(xlabel="dynamic tree size (nodes)", ylabel="speed-up vs AR (CPU)", title="tree size")
    ax.legend(fontsize=8)
    fig.suptitle(f"tiny model, {result['images']} images, batch {result['batch']}, backend {result['fused']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer settings and images")
    parser.add_argument("--per-class", type=int, help="images per class (default 20; --quick 5)")
    parser.add_argument("--batch", type=int, default=10, help="images per generate call")
    parser.add_argument("--k", type=int, default=64, help="neighbours merged in the δ / λ / tree sweeps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused", help="run with lantern.enable_fused(BACKEND)")
    parser.add_argument("--json", default="bench/results/sweep.json")
    parser.add_argument("--figure", default="bench/results/sweep.png")
    args = parser.parse_args(argv)
    args.per_class = args.per_class or (5 if args.quick else 20)
    if args.fused:
        lantern.enable_fused(args.fused)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    result = sweep(args)
    print(json.dumps(result["summary"], indent=2))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")
    plot(result, args.figure)


if __name__ == "__main__":
    main()
