"""Benchmarks: `python -m bench` runs them all, prints medians and same-run ratios, writes JSON."""
