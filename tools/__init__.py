"""Developer tools run from the repository root (not installed with the package): the nvcc wrapper that keeps
ptxas's reports, parsers of ptxas / cuobjdump output, and `make gpu-check` (tools/gpu_check.py)."""
