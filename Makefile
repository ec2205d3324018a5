# The README's two commands: `make demo` (set up + run the main job on the embedded sample)
# and `make test` (set up + run the tests). Everything is installed into .venv by pip.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The tests run in this many parallel workers (pytest-xdist), each in a network namespace of its own when run as root
# (tests/conftest.py); tests that share a fixture run in one worker, the swarm scenarios start first.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: install browser nat-testbed demo test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[all,dev]'
	touch $@

demo: install
	$(VENV)/bin/ttt demo
	$(VENV)/bin/ttt inspect --dataset ./ttt-data --show 16

# The dashboard's browser tests drive Debian's chromium (Playwright's own browser downloads are not used).
browser:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The NAT tests (tests/test_wan.py) and bench.wan build networks in namespaces: root, nftables and iproute2.
nat-testbed:
	@command -v nft >/dev/null && command -v tc >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2; }

test: install browser nat-testbed
	$(PY) -m ruff check .
	$(PYTEST) --durations=25

# The unit tests only (no dataset, peer, server or browser): about a minute.
test-fast: install
	$(PY) -m ruff check .
	$(PYTEST) -m "not e2e" --durations=10

bench: install browser nat-testbed
	$(PY) -m bench.preprocess --full-vqgan
	$(PY) -m bench.vqgan
	$(PY) -m bench.stream
	$(PY) -m bench.hub
	$(PY) -m bench.train
	$(PY) -m bench.compression
	$(PY) -m bench.generate
	$(PY) -m bench.demo
	$(PY) -m bench.monitor
	$(PY) -m bench.auth
	$(PY) -m bench.robust
	$(PY) -m bench.verify
	$(PY) -m bench.diloco_scores
	$(PY) -m bench.calc
	$(PY) -m bench.diloco
	$(PY) -m bench.wan

clean:
	rm -rf ttt-data ckpt samples inspect.png .pytest_cache
