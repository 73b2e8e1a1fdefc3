# lantern: make install | test | demo | bench | clean | distclean
# install creates .venv (if missing), installs requirements.txt, then builds lantern._C in place (editable).
# It is cheap the second time: a stamp file remembers the last install, redone when setup.py, pyproject.toml,
# requirements.txt or a csrc/ file changes, or when the built extension is missing.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.lantern-installed
CSRC   := $(shell find csrc -type f 2>/dev/null)

.PHONY: install test demo bench clean distclean

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
	touch $@

test: install
	$(VENV)/bin/python -m pytest -q

demo: install
	$(VENV)/bin/lantern generate --method lantern --fused auto --out samples.png --json samples.json

bench: install
	$(VENV)/bin/python -m bench

clean:
	rm -rf build python/*.egg-info *.egg-info python/lantern/_C*.so $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
