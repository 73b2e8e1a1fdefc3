"""bench/bench_hf.py runs every section end to end (--rehearse: one-layer models, a 4 x 4 image, 2 repeats) and
writes its report: the per-forward rows (wrapped and plain) and the decode rows (AR, SJD, SJD + relaxation, with
their compile choice) at each batch size. No timing is asserted."""
import json

from bench import bench_hf


def test_the_rehearsal_runs_every_section_and_reports_each_contender(tmp_path):
    out = tmp_path / "hf.json"
    bench_hf.main(["--rehearse", "--kinds", "janus", "--dtype", "bfloat16", "--batches", "1", "2",
                   "--compile", "off", "--json", str(out)])
    rows = json.loads(out.read_text())
    timed = {(r["bench"], r["case"], r["impl"]) for r in rows if "impl" in r}
    for batch in (1, 2):
        for T in (1, 9):
            assert {("hf_forward", f"janus rows {batch} T {T}", impl) for impl in ("plain", "wrapped")} <= timed
        assert {("hf_decode", f"janus batch {batch}", m) for m in ("ar", "sjd", "sjd+relaxed")} <= timed
    decode = [r for r in rows if r["bench"] == "hf_decode" and "impl" in r]
    assert all(r["compile"] == "off (compile=False)" for r in decode)
    assert all(r["target_forwards"] >= 1 and r["tau"] >= 1.0 for r in decode if r["impl"] != "ar")
    ratios = {(r["case"], r["ratio"]) for r in rows if "ratio" in r}
    assert ("janus batch 2", "ar/sjd+relaxed") in ratios and ("janus rows 2 T 9", "wrapped/plain") in ratios
