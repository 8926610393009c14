#!/usr/bin/env bash
# Everything jlms checks on a real NVIDIA GPU, in one run (a lent GPU is
# counted in minutes): from the repository root, with `python3` the
# interpreter that has JAX with CUDA, flax, optax, pytest, pytest-xdist and
# hypothesis, and OUT a folder for what it writes.
#
#   1. the exported frontier programs timed (benchmarks/gpu_steps.py `run`;
#      export them first, on any machine: `python -m benchmarks.gpu_steps
#      export`), since that is what only a GPU can give;
#   2. with HIDDEN_S set (seconds), issue 37's steps with their host copies
#      (benchmarks/hidden_copies_gpu.py), each in a process of its own that
#      first measures the host link: the scanned MLP planned for the local
#      GPU's target (LOCAL_TARGET, default h200) and for the H100, the GPTs
#      for the H100 (so that their state goes to host); with PGLE_S also
#      those named in PGLE_STEPS, planned for LOCAL_TARGET, again under
#      JAX's profile-guided latency estimation; with FLAGS_S also the MLP
#      under each XLA_FLAGS setting of FLAG_VARIANTS (";"-separated; by
#      default the three that docs/benchmarks.md's "On a real GPU" names);
#   3. the `gpu` tests (jlms_tests/test_gpu.py) in one process;
#   4. unless QUICK_S is 0, the rest of the quick tier with the GPU as JAX's
#      default backend, on several processes that share the GPU (memory on
#      demand);
#   5. with SLOW_S set (seconds), the slow tier likewise.
#
# Each part has its own time limit (seconds: STEPS_S, HIDDEN_S, PGLE_S, FLAGS_S,
# GPU_TESTS_S, QUICK_S, SLOW_S) and its log in $OUT, so that a part that
# runs long leaves the others' work; with TOTAL_S set, no part runs past
# TOTAL_S - 30 seconds from the start, so that the archive is still made
# inside a command limit of TOTAL_S; a test tier past its limit is
# interrupted (SIGINT), so that pytest still reports what ran. CASES (names
# of benchmarks.gpu_steps cases, space-separated) limits part 1 to those
# cases. Logs, JUnit files and kept programs end in $OUT/logs.tgz, so that
# what comes back is a handful of files.
set -uo pipefail
OUT=${OUT:-out}

# The lesser of a part's limit and what TOTAL_S leaves (30 s kept back,
# and the second argument's seconds more: a test tier's 20 s between its
# SIGINT and SIGKILL); 1 where nothing is left.
limit() {
  local left=$(( ${TOTAL_S:-100000} - SECONDS - 30 - ${2:-0} ))
  echo $(( $1 < left ? $1 : (left > 1 ? left : 1) ))
}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$python" -c 'import sys, jax, flax, optax; print(sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
} 2>&1 | tee "$OUT/versions.log"

if [ -f .gpu_steps/manifest.json ]; then
  echo "=== 1. frontier programs on the GPU"
  timeout "$(limit "${STEPS_S:-240}")" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.99 \
    "$python" -m benchmarks.gpu_steps run --out "$OUT" ${CASES:+--case $CASES} 2>&1 | tee "$OUT/gpu_steps.log"
fi

# One of issue 37's steps timed in a process of its own (its allocator's
# high-water mark is its own), with what env sets, into $OUT/$2.json.
# Further arguments are `env` assignments (JLMS_HLO_DIR=DIR keeps each
# compiled program there).
hidden_step() {
  local name=$1 target=$2 json=$3 limit=$4; shift 4
  timeout "$(limit "$limit")" env XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${HOST_GB:-96}" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 "$@" \
    "$python" -m benchmarks.hidden_copies_gpu --only "$name" \
    --target "$target" --link --json "$OUT/$json.json" 2>&1 \
    | grep --line-buffered -v profile_guided_latency_estimator | tee -a "$OUT/hidden_copies.log"
}

if [ "${HIDDEN_S:-0}" -gt 0 ]; then
  echo "=== 2. issue 37's steps with their host copies"
  local_target=${LOCAL_TARGET:-h200}
  i=0
  for spec in "scan MLP@$local_target" "scan MLP@h100" "GPT 4 x 4096@h100" \
              "GPT 6.58B@h100"; do
    i=$((i + 1))
    hidden_step "${spec%@*}" "${spec#*@}" "hidden_$i" "$HIDDEN_S" \
      JLMS_HLO_DIR="$OUT/hlo_${spec#*@}"
  done
  if [ "${PGLE_S:-0}" -gt 0 ]; then
    # Names with "_" for " "; XLA's dump keeps the recompiled program.
    for name in ${PGLE_STEPS:-scan_MLP}; do
      i=$((i + 1))
      hidden_step "${name//_/ }" "$local_target" "hidden_pgle_$i" "$PGLE_S" \
        JAX_ENABLE_PGLE=true JAX_PGLE_PROFILING_RUNS=2 \
        XLA_FLAGS="--xla_dump_to=$OUT/pgle_dump_$i --xla_dump_hlo_as_text"
      find "$OUT/pgle_dump_$i" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
    done
  fi
  if [ "${FLAGS_S:-0}" -gt 0 ]; then
    # The scanned MLP under XLA options that let its copies overlap in the
    # deviceless program (docs/benchmarks.md, "On a real GPU"), or that
    # take its weight slices off the streams its host copies use; each
    # `XLA_FLAGS` setting of FLAG_VARIANTS is separated by ";".
    IFS=';' read -ra variants <<< "${FLAG_VARIANTS:---xla_gpu_async_dot=true;--xla_disable_hlo_passes=loop-schedule-linearizer;--xla_disable_hlo_passes=dynamic-slice-copy-fusion-async-wrapper}"
    for flags in "${variants[@]}"; do
      i=$((i + 1))
      hidden_step "scan MLP" "$local_target" "hidden_flags_$i" "$FLAGS_S" \
        XLA_FLAGS="$flags" JLMS_HLO_DIR="$OUT/hlo_flags_$i"
    done
  fi
  "$python" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for path in sorted(out.glob("hidden_*.json")):
  rows += json.loads(path.read_text())
  path.unlink()
(out / "hidden_copies_gpu.json").write_text(json.dumps(rows, indent=1))
PY
fi

echo "=== 3. the gpu tests"
timeout -s INT -k 20 "$(limit "${GPU_TESTS_S:-150}" 20)" env JAX_PLATFORMS=cuda,cpu \
  "$python" -m pytest -m gpu -n 0 -p no:cacheprovider -rA --tb=short \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40

# A tier of the suite with the GPU as JAX's default backend, on several
# processes sharing it (memory on demand): its name, marker expression and
# time limit.
on_gpu() {
  local name=$1 marks=$2 limit=$3
  timeout -s INT -k 20 "$(limit "$limit" 20)" env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$python" -m pytest -m "$marks" -n "${WORKERS:-8}" -p no:cacheprovider \
    -rfE --tb=short --junitxml="$OUT/${name}_tests.xml" > "$OUT/${name}_tests.log" 2>&1
  echo "$name tier exit $?"
  tail -60 "$OUT/${name}_tests.log"
}

tiers=(gpu="$OUT/gpu_tests.xml")
if [ "${QUICK_S:-180}" -gt 0 ]; then
  echo "=== 4. the quick tier, GPU as the default backend"
  on_gpu quick "not slow and not gpu" "${QUICK_S:-180}"
  tiers+=(quick_not_gpu="$OUT/quick_tests.xml")
fi
if [ "${SLOW_S:-0}" -gt 0 ]; then
  echo "=== 5. the slow tier, GPU as the default backend"
  on_gpu slow "slow and not gpu" "$SLOW_S"
  tiers+=(slow_not_gpu="$OUT/slow_tests.xml")
fi

"$python" -m benchmarks.junit_json "${tiers[@]}" --json "$OUT/gpu_tests.json" \
  --note "$(head -c 300 "$OUT/versions.log" | tr '\n' ' ')"

# What comes back from a lent machine is a few files: the JSONs stay, the
# rest goes into one archive.
(cd "$OUT" && tar czf logs.tgz --remove-files $(ls | grep -v -e '\.json$' -e '^logs.tgz$'))
ls -la "$OUT"
