#!/usr/bin/env bash
# Everything jlms checks on a real NVIDIA GPU, in one run (a lent GPU is
# counted in minutes): from the repository root, with `python3` the
# interpreter that has JAX with CUDA, flax, optax, pytest, pytest-xdist and
# hypothesis, and OUT a folder for what it writes.
#
#   1. the exported frontier programs timed (benchmarks/gpu_steps.py `run`;
#      export them first, on any machine: `python -m benchmarks.gpu_steps
#      export`), since that is what only a GPU can give;
#   2. the `gpu` tests (jlms_tests/test_gpu.py) in one process;
#   3. the rest of the quick tier with the GPU as JAX's default backend,
#      on several processes that share the GPU (memory on demand);
#   4. with SLOW_S set (seconds), the slow tier likewise.
#
# Each part has its own time limit (seconds: STEPS_S, GPU_TESTS_S, QUICK_S,
# SLOW_S) and its log in $OUT, so that a part that runs long leaves the
# others' work; a test tier past its limit is interrupted (SIGINT), so that
# pytest still reports what ran. CASES (names of benchmarks.gpu_steps cases,
# space-separated) limits part 1 to those cases.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$python" -c 'import sys, jax, flax, optax; print(sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/versions.log"

if [ -f .gpu_steps/manifest.json ]; then
  echo "=== 1. frontier programs on the GPU"
  timeout "${STEPS_S:-240}" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.99 \
    "$python" -m benchmarks.gpu_steps run --out "$OUT" ${CASES:+--case $CASES} 2>&1 | tee "$OUT/gpu_steps.log"
fi

echo "=== 2. the gpu tests"
timeout -s INT -k 20 "${GPU_TESTS_S:-150}" env JAX_PLATFORMS=cuda,cpu \
  "$python" -m pytest -m gpu -n 0 -p no:cacheprovider -rA --tb=short \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40

# A tier of the suite with the GPU as JAX's default backend, on several
# processes sharing it (memory on demand): its name, marker expression and
# time limit.
on_gpu() {
  local name=$1 marks=$2 limit=$3
  timeout -s INT -k 20 "$limit" env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$python" -m pytest -m "$marks" -n "${WORKERS:-8}" -p no:cacheprovider \
    -rfE --tb=short --junitxml="$OUT/${name}_tests.xml" > "$OUT/${name}_tests.log" 2>&1
  echo "$name tier exit $?"
  tail -60 "$OUT/${name}_tests.log"
}

echo "=== 3. the quick tier, GPU as the default backend"
on_gpu quick "not slow and not gpu" "${QUICK_S:-180}"
tiers=(gpu="$OUT/gpu_tests.xml" quick_not_gpu="$OUT/quick_tests.xml")
if [ "${SLOW_S:-0}" -gt 0 ]; then
  echo "=== 4. the slow tier, GPU as the default backend"
  on_gpu slow "slow and not gpu" "$SLOW_S"
  tiers+=(slow_not_gpu="$OUT/slow_tests.xml")
fi

"$python" -m benchmarks.junit_json "${tiers[@]}" --json "$OUT/gpu_tests.json" \
  --note "$(head -c 300 "$OUT/versions.log" | tr '\n' ' ')"
