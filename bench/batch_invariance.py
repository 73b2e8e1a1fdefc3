"""Whether the discrete methods' images depend on the batch (docs/sampling.md "Seeds"): the tiny model's ids
0..5 generated as one batch of 6, as batches of 1, 2 and 4, and as the reversed batch, all keyed by image id
(``lantern.generate(..., image_ids=...)``); and, as the negative control, keyed by row (image_ids=None) in
batches of 2. Prints, per method, which ids' tokens differ from the batch of 6.

    OMP_NUM_THREADS=1 python bench/batch_invariance.py [backend: cpu | reference | triton]
                                                       [methods: ar,spec,lantern,sjd]
"""
from __future__ import annotations

import sys

import torch

import lantern
from lantern.decoding import generate
from lantern.neighbours import neighbour_table
from lantern.pretrained import load_tiny, load_tiny_drafter

N = 6


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ar", "spec", "lantern", "sjd"]
    torch.set_num_threads(1)
    tiny = load_tiny("cpu", dtype=torch.float32)
    gpt, vq = tiny.gpt, tiny.vq
    drafter = load_tiny_drafter(gpt)
    table = neighbour_table(vq.quantize.embedding.weight, 100, normalize=True)
    classes = torch.arange(N) % gpt.config.num_classes
    cfg = tiny.meta.get("sampling", {}).get("cfg_scale", 4.0)

    def run(method, ids, keyed=True):
        opts = dict(method=method, cfg_scale=cfg, seed=3, image_ids=ids if keyed else None)
        if method != "ar":
            opts.update(tree="chain", depth=3, k=100)
        if method == "sjd":
            opts.update(window=4, k=0)
        elif method in ("spec", "lantern"):
            opts.update(drafter=drafter, neighbours=table if method == "lantern" else None)
        return generate(gpt, classes[ids], **opts)[0]

    with lantern.fused(backend):
        for method in methods:
            ids = torch.arange(N)
            whole = run(method, ids)
            differ = lambda out: [i for i in range(N) if not torch.equal(out[i], whole[i])]  # noqa: E731
            report = {f"batch {bs}": differ(torch.cat([run(method, ids[i:i + bs]) for i in range(0, N, bs)]))
                      for bs in (1, 2, 4)}
            report["reversed"] = differ(run(method, ids.flip(0)).flip(0))
            report["keyed by row, batch 2 (control)"] = differ(
                torch.cat([run(method, ids[i:i + 2], keyed=False) for i in range(0, N, 2)]))
            print(f"{method}: ids whose tokens differ from the batch of {N}: {report}", flush=True)


if __name__ == "__main__":
    main()
