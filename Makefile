# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv with Python 3.12 if it is missing and install the project.
SHELL := /bin/bash
# The first candidate that really runs Python 3.12 (a pyenv shim on PATH may not).
PYTHON312 ?= $(shell for c in $$(command -v python3.12 2>/dev/null) $$(ls -d $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12 2>/dev/null) /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	  "$$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 && { echo "$$c"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=4
# Test processes (pytest-xdist; whole files per process, so module fixtures are built once).
# On the 2-core CI machine two take the suite from ~11 to ~8 minutes.
PYTEST_WORKERS ?= 2

.PHONY: venv protos browser pipecat-env test demo demo-assets bench-tiny clean

$(STAMP): pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: Python 3.12 not found (install it, or set PYTHON312=/path/to/python3.12)"; exit 2; fi
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,train]"
	@touch $(STAMP)

venv: $(STAMP)

protos: $(STAMP)
	$(PY) -m characters_jax.protos_build

# The viewer's browser test drives Debian's chromium: installed here when missing (root and
# apt-get), else that test skips with the reason.
browser:
	@bash tools/install_browser.sh >/dev/null

# The Pipecat integration's client environment (pipecat-ai needs protobuf < 7, the worker pins
# 7.36.2): its own venv with the client library and stubs generated for protobuf 5.29+. Made
# once; where the registry cannot be reached its tests skip with pip's reason.
pipecat-env: $(STAMP)
	-$(PY) -m characters_jax.integrations.client_env .venv-pipecat pipecat

# --capture=sys: what the runtime's C++ writes to the process's stderr (XLA's messages before
# it ends a process) reaches the log instead of a capture file that dies with the process.
test: protos browser pipecat-env
	$(PY) -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile --capture=sys --durations=15 tests

# The whole service on localhost (decoder process, generator worker, client): writes
# out/demo.mp4 and out/demo_report.json: the trained talking demonstrator on its held-out
# demo clip, with its lip-sync score.
demo: protos
	$(PY) -m characters_jax.cli demo --out out

# Regenerates the bundled portrait and speech clip (deterministic; committed).
demo-assets: $(STAMP)
	$(PY) -m characters_jax.demo.assets

bench-tiny: $(STAMP)
	$(PY) -m characters_jax.cli bench --config tiny --tp 4 --set cache.mode=ring --steps 50
	$(PY) -m characters_jax.cli bench --config tiny --tp 4 --set cache.mode=launch --steps 50

clean:
	rm -rf $(VENV) .venv-pipecat out build *.egg-info characters_jax/protos_gen
