#!/usr/bin/env bash
# The GPU measurements of docs/scaling.md in one run, on a machine with an NVIDIA GPU and the project's packages:
#
#   benchmarks/gpu_check.sh OUT [bench|tests|all] [pytest arguments...]
#
# bench: `python -m benchmarks.throughput --device cuda` at the default LLM's shape and a 7B shape (random weights,
#        bfloat16): IG, the build workers, the monitors, the RAG loop -> OUT/throughput_gpu.json
#        (SHAPES and SECTIONS choose; REPEATS sets its --repeats)
# tests: the tests marked `gpu` on the GPU (DYNRAG_TEST_DEVICE=cuda; tests/conftest.py): the tiny pipeline's build
#        stages and training, the recorder, the monitors, the RAG loop, and tests/test_cuda.py's CPU/CUDA parity
#        -> OUT/tests.log, OUT/junit.xml; only the test files with such tests are collected, on WORKERS pytest-xdist
#        workers (default 8; each takes its share of the cores for PyTorch's threads)
# TOKENIZER=DIR names the tokenizer directory when `data/llm` (the prepare stage's output) is not there; PYTHON the
# interpreter (default python3).
# Where `.gpu/manifest.json` was carried (a machine without the project's packages: `python -m benchmarks.gpu_bundle
# build` here), it first takes the call's part of the bundle; until the last part is there it stops (status 0), then
# unpacks it and runs with `.gpu/site` and the project on PYTHONPATH and `.gpu/tokenizer` as TOKENIZER.
# Every part runs even when one before it failed; the exit status is 1 when any failed.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT [bench|tests|all] [pytest arguments...]}
part=${2:-all}
shift $(($# < 2 ? $# : 2))
mkdir -p "$out"
export DYNRAG_TEST_DEVICE=${DYNRAG_TEST_DEVICE:-cuda} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
py=${PYTHON:-python3}
if [[ -f .gpu/manifest.json ]]; then
    "$py" -m benchmarks.gpu_bundle collect --dir .gpu
    case $? in
        0) export PYTHONPATH=$PWD/.gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the project, as `pip install -e .`
           [[ -z ${TOKENIZER:-} && ! -d data/llm ]] && export TOKENIZER=$PWD/.gpu/tokenizer ;;
        3) exit 0 ;;  # parts are still to come
        *) exit 1 ;;
    esac
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
"$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    | tee -a "$out/gpu.txt"
if [[ $part == bench || $part == all ]]; then
    # shellcheck disable=SC2086  # SHAPES and SECTIONS are lists of words
    "$py" -m benchmarks.throughput --device "$DYNRAG_TEST_DEVICE" --shape ${SHAPES:-smollm2-135m llama2-7b} \
        ${SECTIONS:+--sections $SECTIONS} ${REPEATS:+--repeats "$REPEATS"} ${TOKENIZER:+--tokenizer "$TOKENIZER"} \
        --out "$out/throughput_gpu.json" 2>&1 | tee "$out/bench.log" || status=1
fi
if [[ $part == tests || $part == all ]]; then
    mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
    "$py" -m pytest -q -m gpu -n "${WORKERS:-8}" --dist loadfile -p no:cacheprovider --junitxml "$out/junit.xml" \
        "$@" "${files[@]}" 2>&1 | tee "$out/tests.log" || status=1
fi
exit $status
