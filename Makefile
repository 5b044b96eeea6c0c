# Two set-up commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# A CPU build of torch on CPU-only machines (this release installs quickly here); a GPU host
# that already has torch can use `make install TORCH=` to keep its own.
TORCH  ?= torch==2.13.0
OUT    ?= out

.PHONY: install install-test demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH),$(PIP) install -q "$(TORCH)")
	$(PIP) install -q -e ".[engine]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	# The official implementation, for parity tests only; --no-deps skips its UI extras.
	$(PIP) install -q --no-deps qwen-tts==0.1.1
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# The main job on the embedded default: a tiny random-weight stand-in in the official layout.
demo: install
	$(PY) -m ttsbuild.demo --out $(OUT)

lint: install-test
	$(VENV)/bin/ruff check ttsbuild tests benchmarks

test: install-test lint
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) $(OUT)
