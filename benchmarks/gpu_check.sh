#!/usr/bin/env bash
# What a session lent a GPU runs there, in one call (the device tool): the CUDA tests, then `kvgate bench gpu`.
# The machine has torch, triton and transformers but not kvgate's other needs: .gpu/ (ignored, carried) holds the
# wheels missing there (llguidance) and the default model's tokenizer (the tests' tiny models use its vocabulary).
# Here, first: bash benchmarks/gpu_check.sh --prepare (makes .gpu/; ignore it in .git/info/exclude). There, through
# the device tool with carry [".gpu"]: bash benchmarks/gpu_check.sh [bench args]; logs and BENCHMARKS.md land in $OUT.
set -u
if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .gpu/models
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 \
        --platform manylinux_2_31_x86_64 -d .gpu "llguidance==$(.venv/bin/pip show llguidance | sed -n 's/^Version: //p')"
    src=$(ls -d ~/.cache/kvgate/models/SmolLM2-135M-Instruct.Q4_1-* | head -1)  # made by `kvgate convert`
    mkdir -p ".gpu/models/$(basename "$src")"
    cp "$src"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,config.json,generation_config.json} \
        ".gpu/models/$(basename "$src")/"
    exit
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl || exit 1
mkdir -p /tmp/pkg/kvgate ~/.cache/kvgate/models
cp -r .gpu/models/* ~/.cache/kvgate/models/
cp -r kvgate/* /tmp/pkg/kvgate/
for d in gateway runtime chunk_cache semantic_cache agents; do ln -sfn "$PWD/$d" /tmp/pkg/kvgate/$d; done
ln -sfn "$PWD/benchmarks" /tmp/pkg/kvgate/bench
export PYTHONPATH=/tmp/pkg:$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
# The graph and paged tests first (the paged kernel against its torch twin, the paged batch against the copy one):
# a minute or less, and what the bench's decode rows rest on.
timeout 150 python3 -m pytest --noconftest -q -p no:cacheprovider -rfEs tests/unit/test_paged_kernel.py \
    tests/gpu/test_cuda.py -k "cuda and paged or graphs" 2>&1 | tee "$OUT/graphs.log" | tail -15
timeout "${BENCH_TIMEOUT:-430}" python3 -m kvgate.bench.gpu "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\['
cp benchmarks/BENCHMARKS.md "$OUT/"
timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest --noconftest -q -p no:cacheprovider -rfEs tests/gpu/test_cuda.py 2>&1 \
    | tee "$OUT/tests.log" | tail -30
