# Two entry points, both self-contained on a fresh Linux machine with Python 3.10+:
#   make demo   set up .venv, then run a local swarm on 127.0.0.1
#   make test   set up .venv, then lint, type-check (mypy) and run the test suite
# Set-up is idempotent: it reruns only when pyproject.toml, setup.py or the Cython sources change.

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.p2ptrain-installed
TORCH_VERSION ?= 2.13.0
# Where a CPU-only torch build comes from when none is on this machine already.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# Tests run in parallel, one worker per core this process may use (at most 4): most of a
# multi-process test is waiting (deadlines, timeouts, process start-up), and each test's bounds hold
# on one core (checked with taskset -c 0). The multi-process tests come first (tests/conftest.py) and
# an idle worker takes tests queued for another (worksteal), so no worker ends the run alone.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: demo test lint format install clean browser netlab

demo: $(STAMP)
	$(PY) -m p2ptrain demo

test: $(STAMP) browser netlab
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# Debian's chromium + chromedriver for the status page's browser test. Installed when missing and
# apt-get can (root); where it cannot, that one test is skipped and says why.
browser:
	@if command -v chromedriver >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver (apt-get) for the browser test"; \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "could not install chromium: the browser test will be skipped"; \
	else echo "no chromium and no root apt-get: the browser test will be skipped"; fi

# nftables for the NAT tests (network namespaces with a masquerading router; they need root).
netlab:
	@if command -v nft >/dev/null 2>&1 || [ "$$(id -u)" != 0 ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "installing nftables (apt-get) for the NAT tests"; \
		apt-get install -y -q nftables >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nftables >/dev/null 2>&1; } || \
		echo "could not install nftables: the NAT tests will be skipped"; \
	fi

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

# torch first, so that hivemind's and our own "torch" requirement are already met:
#  - a torch already in the venv (e.g. a CUDA build, or --system-site-packages) is kept;
#  - with an NVIDIA GPU (nvidia-smi present) pip installs the default CUDA build;
#  - otherwise only a CPU build is accepted: a local one first, then the CPU index; never the
#    multi-GB CUDA build that a bare "torch" requirement pulls from PyPI.
$(STAMP): pyproject.toml setup.py $(wildcard cython_ext/*.pyx) | $(PY)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already installed: keeping it"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	else \
		$(PY) -m pip install "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
		$(PY) -m pip install "torch==$(TORCH_VERSION)+cpu" --extra-index-url "$(TORCH_CPU_INDEX)"; \
	fi
	$(PY) -m pip install -e '.[dev]'
	@touch $(STAMP)

clean:
	rm -rf build *.egg-info p2ptrain/_kernels*.so p2ptrain/_sparse*.so cython_ext/*.c .pytest_cache .ruff_cache .mypy_cache
