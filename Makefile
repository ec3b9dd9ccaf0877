# `make demo` and `make test` work on a fresh machine: they create .venv, install torch first (so no step pulls the
# multi-GB CUDA build from the registry), then the torchvision release made for that torch (0.(minor+15): 0.28 for
# 2.13; any other would replace torch), then opweave (ONNX Runtime and both torch.onnx exporters among its
# dependencies) with its extras, `models` (timm, transformers) and `ray` (Ray Serve: tests/test_serve_ray.py, marked
# `ray`, about 30 s, runs in `make test`; `make test-ray` runs it alone) among them. `make test` runs ruff, mypy on the whole package (pyproject's
# [tool.mypy]: strictly where the code is pure) and the tests.
# Elsewhere: make test TORCH_SPEC='torch>=2.4'
# The torchvision pick reads torch's installed version without importing torch: torch does not require numpy, so
# nothing has installed it yet, and importing torch then prints "Failed to initialize NumPy".
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
TORCHVISION_FOR_TORCH := from importlib.metadata import version; v = version("torch").split("+")[0].split("."); print(f"torchvision==0.{int(v[1]) + 15}.*")
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.opweave-installed

.PHONY: setup demo test test-ray lint docs render-docs bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip show -q torchvision 2>/dev/null || $(BIN)/pip install -q "$$($(BIN)/python -c '$(TORCHVISION_FOR_TORCH)')"
	$(BIN)/pip install -q -e ".[dev,serve,models,ray]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/opweave simulate lios-fig3 --streams 3
	$(BIN)/opweave simulate --model inception_v3 --cost-model gpu --streams 8 --preset h100
	$(BIN)/opweave bench --model inception_v3 --device auto --schedulers default,sequential,lios,opara,nimble --runs 10

test: $(STAMP) docs
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n 2

# The API reference, generated from the docstrings by pdoc into site/api (git ignores it): every public package (a
# package whose __init__ lists names, not its modules, gets its modules named here); a warning (an annotation it
# cannot resolve, a docstring it cannot parse) fails the build.
API_MODULES := opweave opweave.api opweave.errors opweave.outputs opweave.cores opweave.devices \
	opweave.ir opweave.ir.graph opweave.ir.kinds opweave.ir.synth \
	opweave.costs opweave.costs.model opweave.costs.roofline opweave.costs.contention opweave.costs.calibrated \
	opweave.costs.calibrate opweave.costs.links opweave.costs.timing opweave.costs.profile \
	opweave.plan opweave.plan.launchplan opweave.plan.semantics opweave.plan.lower opweave.plan.validate \
	opweave.plan.make opweave.plan.lifetimes opweave.backends \
	opweave.pipeline opweave.pipeline.options opweave.pipeline.compiled opweave.pipeline.memory_pass \
	opweave.pipeline.thread_budgets opweave.pipeline.targets opweave.pipeline.search opweave.pipeline.tiers \
	opweave.pipeline.choose opweave.pipeline.signatures opweave.pipeline.flow \
	opweave.dynamo opweave.evaluate opweave.serve opweave.serve.engine.engine \
	opweave.serve.engine.requests opweave.serve.engine.executors opweave.serve.engine.cpu opweave.serve.engine.cuda \
	opweave.serve.engine.simulation opweave.serve.engine.blocks opweave.serve.engine.combined \
	opweave.serve.engine.policy opweave.serve.engine.policies opweave.serve.engine.top \
	opweave.serve.repository.repository opweave.serve.repository.layout \
	opweave.serve.repository.export opweave.learn opweave.testing opweave.testing.fakecuda opweave.testing.serving \
	opweave.testing.loads

docs: $(STAMP)
	$(BIN)/python -W error::UserWarning -m pdoc $(API_MODULES) --docformat restructuredtext -o site/api

# The figures of README.md and docs/*.md rendered from benchmarks/results/*.json, and the options table from the code:
# run after a benchmark writes new results (a test fails while a page is not its rendering).
render-docs: $(STAMP)
	$(BIN)/python scripts/options_table.py
	$(BIN)/python scripts/render_docs.py

test-ray: $(STAMP)
	$(BIN)/python -m pytest -q -m ray

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
