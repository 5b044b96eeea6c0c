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

# The C++ step driver (ttsbuild/csrc) is compiled here, against the torch just installed:
# hence no build isolation (an isolated build would compile against another torch).
$(VENV)/.installed: pyproject.toml setup.py ttsbuild/csrc/step_driver.cpp ttsbuild/csrc/graph_while.cu
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=68" wheel
	$(if $(TORCH),$(PIP) install -q "$(TORCH)")
	$(PIP) install -q --no-build-isolation -e ".[engine]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q --no-build-isolation -e ".[test]"
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
	rm -rf $(VENV) $(OUT) build ttsbuild/_driver*.so
