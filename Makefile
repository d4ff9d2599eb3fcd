# mpflow — the two commands of a new user:
#   make serve   set up everything and serve
#   make test    set up everything and run the tests
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed

.PHONY: setup serve test test-tools lint docs bench bench-quick bench-nab clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=77"  # pyproject.toml's license (PEP 639); wheels built here
	# CPU build of torch first: an unpinned torch would pull gigabytes of CUDA packages.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

serve: setup
	$(PY) -m mpflow serve

# Debian tools some tests drive (headless Chromium for the dashboard, docker-compose to validate the compose
# file, redis-server >= 7 and redis-cli for the local Redis Cluster); best effort, as root with apt only: without
# them those tests skip and say why.
TEST_TOOLS = chromium docker-compose redis-server
test-tools:
	@missing=""; for t in $(TEST_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (apt-get) for the browser and compose tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null 2>&1 \
			|| echo "could not install$$missing: those tests will skip"; \
	fi

# The tests in two runs: all but tests/reliability on both cores (pytest-xdist, one worker per file, so that a
# module's server or cluster fixture starts once), then tests/reliability alone — its fault, soak and isolation
# tests time the service under load and must not share the cores with another test.
SERIAL_TESTS = tests/reliability
test: setup test-tools
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --ignore=$(SERIAL_TESTS)
	$(PY) -m pytest -q -p no:cacheprovider $(SERIAL_TESTS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site into site/ (mkdocs.yml; its generated pages: docs/site_hooks.py); offline, no CDN.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench-quick: setup
	$(PY) -m benchmarks.engine --quick

bench: setup
	$(PY) -m benchmarks.engine

# The Numenta Anomaly Benchmark through the service, scored by NAB's own code (benchmarks/nab.py, docs/benchmarks.md
# "Numenta Anomaly Benchmark"): `make bench-nab NAB=path/to/a/NAB/checkout`. NAB's scorer needs Python 3.6 and
# pandas 0.23.3: .nab-env is made from pyenv's 3.6.15 (or NAB_PYTHON) with them pinned.
NAB_PYTHON ?= $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.6.15/bin/python
NAB_ENV    ?= .nab-env
NAB_STAMP   = $(NAB_ENV)/.installed

$(NAB_STAMP):
	@test -x "$(NAB_PYTHON)" || { echo "need Python 3.6 at $(NAB_PYTHON) for NAB's scorer (pyenv install 3.6.15, or NAB_PYTHON=...)"; exit 1; }
	test -x $(NAB_ENV)/bin/python || "$(NAB_PYTHON)" -m venv $(NAB_ENV)
	$(NAB_ENV)/bin/pip install -q pandas==0.23.3 simplejson==3.11.1
	touch $(NAB_STAMP)

bench-nab: setup $(NAB_STAMP)
	@test -n "$(NAB)" || { echo "usage: make bench-nab NAB=path/to/a/checkout/of/numenta/NAB"; exit 1; }
	$(PY) -m benchmarks.nab --nab "$(NAB)" --nab-python $(abspath $(NAB_ENV))/bin/python

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info site
