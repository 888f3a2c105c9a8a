#!/usr/bin/env bash
# The wheels benchmarks/checks/gpu_check.py needs on a GPU machine that has torch but no network (docs/benchmarks.md, "The
# GPU check"): downloaded here into .whl/ (git-ignored) for Python 3.12 on x86-64 Linux, then carried with the
# checkout and installed there with pip --no-index --no-deps --target. The versions are constraints.txt's; the
# machine's own torch, accelerate, numpy, safetensors, tokenizers, pyarrow, sacrebleu and scipy are used as they are.
#   bash benchmarks/checks/gpu_wheels.sh [--no-quantization]   # without bitsandbytes (43 MB): the QLoRA step is skipped
#   bash benchmarks/checks/gpu_wheels.sh --study   # the budget study's (gpu_budget.py): gguf in, bitsandbytes out of
#                                                  # .whl/ (removed if there: the model's parts need the room)
set -euo pipefail
cd "$(dirname "$0")/../.."
version() { grep -i -E "^$1==" constraints.txt | cut -d= -f3; }
names=(transformers peft jsonargparse docstring_parser datasets dill multiprocess)
case "${1:-}" in
    --no-quantization) ;;
    --study) names+=(gguf); rm -f .whl/bitsandbytes-*.whl ;;
    *) names+=(bitsandbytes) ;;
esac
mkdir -p .whl
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
for name in "${names[@]}"; do
    pinned="$(version "$name")"
    [ -n "$pinned" ] || { echo "gpu_wheels: $name is not in constraints.txt" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "$name==$pinned"
done
du -sh .whl
