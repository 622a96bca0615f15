# Every target sets itself up: a fresh clone needs only python3.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-slow demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch first: otherwise pip resolves torch to a multi-GB CUDA build.
	$(PY) -m pip install --disable-pip-version-check -q torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	# pytest exits 5 when no test is marked slow; that is not a failure.
	$(PY) -m pytest -q -m slow || test $$? -eq 5

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

demo: $(STAMP)
	$(VENV)/bin/dew demo

clean:
	rm -rf $(VENV) runs
