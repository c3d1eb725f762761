# kvmesh: `make up` runs the local mesh, `make test` runs the suite. Both install into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
TORCH_CPU ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test up bench clean protos

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m kvmesh.kernels.native
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

up: $(STAMP)
	$(VENV)/bin/kvmesh up

bench: $(STAMP)
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis

# Regenerates kvmesh/v1/*_pb2*.py from protos/; tests/test_protos.py fails when they are stale.
protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvmesh/v1/*.proto
