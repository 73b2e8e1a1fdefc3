# lantern: make install | test | test-fast | lint | demo | bench | gpu-check | clean | distclean
# install creates .venv (if missing), installs requirements.txt, then builds lantern._C in place (editable).
# pip byte-compiles at install on purpose: where PYTHONDONTWRITEBYTECODE=1 (as on our machines), a module left
# uncompiled is compiled again in every process that imports it.
# It is cheap the second time: a stamp file remembers the last install, redone when setup.py, pyproject.toml,
# requirements.txt or a csrc/ file changes, or when the built extension is missing.
# gpu-check (on a machine with a CUDA GPU) uses that machine's own $(PYTHON), torch, triton and CUDA toolkit, not
# .venv and no network: in one budgeted run (--budget, default 480 s) it builds lantern in place (pip install
# --no-build-isolation --no-deps -e .), self-checks the kernels on the GPU, compares every CUDA and Triton op with
# the CPU kernels, times the tiny model end to end and LlamaGen-shaped forwards, microbenchmarks the ops, runs
# compute-sanitizer memcheck and one lantern sample under nccl, and writes summary.json + logs.tar.gz to
# bench/results/gpu-check (tools/gpu_check.py; GPU_CHECK_ARGS passes options: --budget, --out, --skip,
# --rehearse runs it on the CPU). It exits non-zero if any step failed, and at once without a GPU.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.lantern-installed
CSRC   := $(shell find csrc -type f -not -path 'csrc/tests/*' 2>/dev/null)

.PHONY: install test test-fast lint demo bench gpu-check clean distclean

install: $(STAMP)

ifeq ($(wildcard python/lantern/_C*.so),)
.PHONY: $(STAMP)
endif

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python requirements.txt setup.py pyproject.toml $(CSRC)
	$(VENV)/bin/pip install -q -r requirements.txt
	CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=$${MAX_JOBS:-2} \
		$(VENV)/bin/pip install -q --no-build-isolation -e .
	$(VENV)/bin/python -c "import lantern; print(lantern.build_info())"
	touch $@

# the suite on TEST_JOBS processes (pytest-xdist), each test file whole in one process (module fixtures are
# built once), the files handed out in collection order, where tests/conftest.py puts the longest first
# (xdist would otherwise start the files with the most tests first, and the long files with few tests last);
# TEST_JOBS=0 runs it in this process
TEST_JOBS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test: install
	$(PYTEST)

# the inner loop (README, "Contributing"; about 2 minutes here): the tests not marked slow -- a test is marked
# slow where it compiles (torch.compile, a build), runs Triton's interpreter (the triton backend's tests:
# tests/conftest.py), draws a statistical sample, starts processes or takes over ~2 s of CPU --, less the files
# that start processes or compilers (the CLI, lantern sample under torchrun, make gpu-check, the sanitizer and
# emulator builds, the sm_90 Triton compiles) and the statistical files; make test runs them all
FAST_IGNORE := --ignore=tests/test_sampling.py --ignore=tests/test_cli.py --ignore=tests/test_cli_mar.py \
	--ignore=tests/hf/test_hf_cli.py --ignore=tests/test_gpu_check.py --ignore=tests/test_fuzz.py \
	--ignore-glob='*test_sanitizers.py' --ignore-glob='*_cuda_emulated.py' --ignore-glob='*triton_compile.py' \
	--ignore-glob='*test_cuda_build.py' --ignore=tests/stats/test_walk_statistics.py \
	--ignore=tests/stats/test_continuous_laws.py --ignore=tests/stats/test_negative_controls.py \
	--ignore=tests/hf/test_laws.py --ignore=tests/decoding/test_spec_statistics.py \
	--ignore=tests/decoding/test_spec_statistics_tiny.py
test-fast: install
	$(PYTEST) -m "not slow" $(FAST_IGNORE)

# ruff (pyproject.toml [tool.ruff]) over the Python, clang-format (.clang-format) over csrc/: check only; fix with
# .venv/bin/ruff check --fix . and .venv/bin/clang-format -i FILES
lint: install
	$(VENV)/bin/ruff check .
	git ls-files -z 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cuh' 'csrc/*.cu' | xargs -0 $(VENV)/bin/clang-format --dry-run --Werror

demo: install
	$(VENV)/bin/lantern generate --method lantern --fused auto --per-class 1 --repeats 3 --out samples.png --json samples.json

bench: install
	$(VENV)/bin/python -m bench

gpu-check:
	$(PYTHON) -m tools.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf build python/*.egg-info *.egg-info python/lantern/_C*.so $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
