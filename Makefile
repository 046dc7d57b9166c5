# Two commands set up and run everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch lies on disk; pinning it first keeps pip from pulling
# several GB of CUDA wheels when a dependency asks for "torch".
TORCH  := torch==2.13.0

.PHONY: install demo test lint docs fuzz bench check-wheel clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[test,sweep,docs,hf,lightning,ray]" $(TORCH)
	@# an editable install compiles no bytecode: the first `make demo` would pay it
	$(PY) -m compileall -q hftc >/dev/null
	touch $@

install: $(VENV)/.installed

# The main job: a real fused Optuna sweep (48 trials of a CNN on 8x8 digits, 16 per fused
# array), its leaderboard and its measured speedup.
demo: install
	$(VENV)/bin/hftc demo

test: install
	$(PY) -m pytest -q -x --timeout=900 tests

lint: install
	$(VENV)/bin/ruff check .

# The documentation site (guides, reference from the docstrings) in build/site; any warning
# (a broken link or anchor, a name the reference cannot find) fails it. Its examples run in
# tests/test_docs.py.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The long fuzzing profile: HFTC_FUZZ_EXAMPLES random architectures (default 5000) per
# fusion test (tests/test_fuzz.py; recurrent, attention, embedding, transposed / 3-d conv,
# upsampling, autocast, export and mismatched models in tests/test_fuzz_families.py), and
# as many random optimizer runs against stock torch.optim.
fuzz: install
	rm -f fuzz.log
	HFTC_FUZZ_PROFILE=fuzz HFTC_FUZZ_LOG=fuzz.log $(PY) -m pytest -q -x tests/test_fuzz.py \
		tests/test_fuzz_families.py tests/test_fuzz_optim.py --hypothesis-show-statistics
	@echo "examples checked: $$(wc -l < fuzz.log)"

bench: install
	$(VENV)/bin/hftc bench

# The wheel in a fresh venv next to the pinned torch (minutes: it installs torch there).
check-wheel: install
	HFTC_CHECK_WHEEL_SITE=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
		scripts/check_wheel.sh $(PY)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
