#!/usr/bin/env bash
# What a session lent a GPU runs there, in one call (the device tool): the CUDA tests, then `kvgate bench gpu`.
# The machine has torch, triton and transformers but not kvgate's other needs: .gpu/ (ignored, carried) holds the
# wheels missing there (llguidance) and the default model's tokenizer (the tests' tiny models use its vocabulary).
# Usage there: bash benchmarks/gpu_check.sh [bench args]; logs and BENCHMARKS.md land in $OUT.
set -u
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
# The graph test first: a minute or less, and what the bench's decode rows rest on.
timeout 120 python3 -m pytest --noconftest -q -p no:cacheprovider tests/test_cuda.py -k graphs 2>&1 | tail -15
timeout "${BENCH_TIMEOUT:-430}" python3 -m kvgate.bench.gpu "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^\['
cp benchmarks/BENCHMARKS.md "$OUT/"
timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest --noconftest -q -p no:cacheprovider -rfEs tests/test_cuda.py 2>&1 \
    | tee "$OUT/tests.log" | tail -30
