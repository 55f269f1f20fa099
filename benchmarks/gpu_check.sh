#!/usr/bin/env bash
# The GPU measurements of docs/scaling.md in one run, on a machine with an NVIDIA GPU and the project's packages:
#
#   benchmarks/gpu_check.sh OUT [bench|tests|all] [pytest arguments...]
#
# bench: `python -m benchmarks.throughput --device cuda` at the default LLM's shape and a 7B shape (random weights,
#        bfloat16): IG, the build workers, the monitors, the RAG loop -> OUT/throughput_gpu.json
# tests: the tests marked `gpu` on the GPU (DYNRAG_TEST_DEVICE=cuda; tests/conftest.py): the tiny pipeline's build
#        stages and training, the recorder, the monitors, the RAG loop, and tests/test_cuda.py's CPU/CUDA parity
#        -> OUT/tests.log, OUT/junit.xml
# TOKENIZER=DIR names the tokenizer directory when `data/llm` (the prepare stage's output) is not there; PYTHON the
# interpreter (default python3).
# Every part runs even when one before it failed; the exit status is 1 when any failed.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT [bench|tests|all] [pytest arguments...]}
part=${2:-all}
shift $(($# < 2 ? $# : 2))
mkdir -p "$out"
export DYNRAG_TEST_DEVICE=${DYNRAG_TEST_DEVICE:-cuda} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    | tee -a "$out/gpu.txt"
if [[ $part == bench || $part == all ]]; then
    "$py" -m benchmarks.throughput --device "$DYNRAG_TEST_DEVICE" --shape smollm2-135m llama2-7b \
        ${TOKENIZER:+--tokenizer "$TOKENIZER"} --out "$out/throughput_gpu.json" 2>&1 | tee "$out/bench.log" || status=1
fi
if [[ $part == tests || $part == all ]]; then
    "$py" -m pytest -q -m gpu -p no:cacheprovider --junitxml "$out/junit.xml" "$@" 2>&1 | tee "$out/tests.log" \
        || status=1
fi
exit $status
