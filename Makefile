# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.amber-installed
# Extra pip arguments for the torch install, e.g. PyTorch's CPU-only wheel index on a machine
# with internet access. torch is installed alone and first, pinned, so that resolving the
# project's own range never pulls a multi-GB CUDA build.
TORCH_INDEX ?=

.PHONY: demo test bench clean

# (an editable install builds the native decoder in place: its sources are prerequisites too)
$(STAMP): pyproject.toml $(wildcard amber_store/codecs/native/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 $(TORCH_INDEX)
	$(PY) -m pip install --quiet -e ".[test]"
	# torchtitan for its integration's tests, without its `datasets` (which caps fsspec below the
	# s3fs/gcsfs the tests use, and sends pip's resolver back through every lightning release):
	# what torchtitan's checkpointer, optimizers and dataloader import
	$(PY) -m pip install --quiet --no-deps "torchtitan>=0.3,<0.4" spmd_types==0.2.3
	$(PY) -m pip install --quiet "tyro>=0.9" "torchdata>=0.8"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/amber-store demo

# Azurite (Azure Blob Storage emulator) for the tests, from npm, pinned by its lock file.
AZURITE := backends/node/node_modules/.bin/azurite-blob

$(AZURITE): backends/node/package-lock.json
	npm ci --prefix backends/node --no-audit --no-fund --loglevel=error
	touch $(AZURITE)

test: $(STAMP) $(AZURITE)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) amber-demo amber-demo-lossy .pytest_cache backends/node/node_modules
