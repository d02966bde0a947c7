# edgellm's command index. `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
PIP    ?= $(PYTHON) -m pip
STAMP  := .setup-done

.PHONY: setup browser demo test test-fast lint bench bench-ortgenai bench-quality arm64 clean help

help:            ## list the targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

# torch first and pinned exactly: any other spec pulls several GB of CUDA packages.
$(STAMP): pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[host,dev]'
	@touch $(STAMP)

setup: $(STAMP)  ## install edgellm with the host and dev extras (torch pinned ==2.13.0)

demo: $(STAMP)   ## the main job: train the embedded default, export, quantize, run, diff (out/demo)
	$(PYTHON) -m edgellm demo -o out/demo

# tests/test_diff_browser.py opens the diff report in headless Chromium. As root (CI) it is installed with apt
# when missing; elsewhere a note, and the test skips with the reason (it fails under CI=true instead).
browser:         ## headless Chromium for the report's browser test (apt-get install as root)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	command -v google-chrome >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: no chromium and not root: tests/test_diff_browser.py will skip (apt-get install -y chromium)"; fi; }

# -n auto: one worker per core, each test file on one worker (its module fixtures built once), heaviest files
# first (tests/conftest.py)
test: $(STAMP) browser  ## the whole test suite (what CI runs)
	$(PYTHON) -m pytest tests -n auto --dist loadfile --no-loadscope-reorder --durations=15

test-fast: $(STAMP) browser  ## the suite without the slow end-to-end tests
	$(PYTHON) -m pytest tests -m 'not slow'

lint: $(STAMP)   ## ruff
	$(PYTHON) -m ruff check edgellm export runtime quant tests bench

bench: $(STAMP)  ## speed/memory benchmarks (results go in docs/benchmarks.md)
	$(PYTHON) bench/run_all.py

bench-ortgenai: $(STAMP)  ## the same workload against onnxruntime-genai (bench-only extra)
	$(PIP) install -q -e '.[bench]'
	$(PYTHON) bench/ortgenai.py

bench-quality: $(STAMP)  ## quantization quality vs llama.cpp on SmolLM2-135M and Gemma 3 270M (bench-only extra; build/bench/quality*)
	$(PIP) install -q -e '.[bench]'
	$(PYTHON) bench/quant_vs_llamacpp.py --root build/bench/quality --speed
	$(PYTHON) bench/quant_vs_llamacpp.py --model gemma3 --root build/bench/quality-gemma3

arm64: $(STAMP)  ## prove the runtime on aarch64 under qemu (numpy + onnxruntime only)
	bash bench/arm64_check.sh

clean:           ## remove build and demo outputs
	rm -rf out build *.egg-info .pytest_cache $(STAMP)
