#!/usr/bin/env bash
# The device check of issue 32 in one command, for a lent GPU (run from the repository root):
#   (a) gpu-tests  every test file with GPU tests (tests/gpu/, the Triton kernels compiled for the
#                  device, bf16 and fp8 rounding), all of each file, GPU-marked or not
#   (b) bench      benchmarks/bench_gpu.py, every section: host time per step (working tree and
#                  baseline), throughput against transformers, GPU busy share, greedy tokens
#   (c) serve      `kvrelay serve --device cuda` answers the OpenAI client (a random-weights
#                  model directory written to /tmp)
#   (d) up         `kvrelay up --device cuda`: 1P1D on the one GPU answers like the single instance;
#                  serve and up also time the first token of 4096-token prompts (issue 33: P/D
#                  TTFT <= 1.2x the single instance's) and up's log names the KV transfer path
# Each part has its own time limit (480 s in all); a PASS/FAIL line per part ends the output. With
# $OUT set (the device tool sets it) each part's log, the benchmark's tables (bench_gpu.md,
# bench_gpu.json) and the summary are written there, and so come back.
#
# Here, once, before the device call (needs the package registries):
#   bash scripts/gpu_check.sh --wheels      # .whl/: ../shared/tools/device_wheels.sh + the OpenAI client
# The device call: command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 540.
# The KV-out-of-VRAM check of issue 33 is its own device call (it would not fit in this one's
# limit): command "bash scripts/gpu_check.sh --transfer", carry [".whl"], timeout_s 420; it runs
# scripts/gpu_transfer_check.sh (UCX facts, the GPU transfer tests, bench_transfer.py --gpu, the
# offload targets in benchmarks/offload_gpu.py).
# The script itself, without a GPU:
#   GPU_CHECK_DRY=1 PYTHON=.venv/bin/python bash scripts/gpu_check.sh
#   (the same parts on the CPU: the GPU tests skip with their reason, the benchmark's host section
#   in its quick form, serve and up with --device cpu; no wheels are unpacked)
set -u
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}

if [ "${1:-}" = "--wheels" ]; then
  ../shared/tools/device_wheels.sh .whl || exit 1
  # The OpenAI client for part (c), and what it needs that the device's image lacks; versions
  # follow .venv where it exists.
  pins=""
  for n in openai jiter httpx2 httpcore2 truststore sniffio; do
    v=""
    [ -x .venv/bin/pip ] && v=$(.venv/bin/pip show "$n" 2>/dev/null | awk '/^Version:/{print $2}')
    pins="$pins $n${v:+==$v}"
  done
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $pins || exit 1
  # The host section's baseline tree, for a device copy that has no git repository.
  rev=$(sed -n 's/^BASELINE_REV = "\(.*\)"/\1/p' benchmarks/bench_gpu.py)
  commit=$(git rev-parse --short "$rev^{commit}") || exit 1
  rm -f .whl/baseline-*.tar.gz
  git archive -o ".whl/baseline-$commit.tar.gz" "$commit" || exit 1
  du -ch .whl/* | tail -1
  exit 0
fi

if [ "${1:-}" = "--transfer" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    mkdir -p /tmp/site
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site; done
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  PYTHON=$PY exec bash scripts/gpu_transfer_check.sh
fi

DRY=${GPU_CHECK_DRY:-0}
DEVICE=cuda
[ "$DRY" = 1 ] && DEVICE=cpu
LOGS=${OUT:-/tmp/kvrelay-gpu-check/logs}
WORK=/tmp/kvrelay-gpu-check/work  # the serve and up checks' model directory and logs, fresh each run
rm -rf "$WORK"
mkdir -p "$LOGS" "$WORK"
export PYTHONUNBUFFERED=1
START=$SECONDS

# The wheels the device's image lacks (device_wheels.sh's header says how they unpack).
if [ "$DRY" = 1 ]; then
  echo "dry run: no wheels unpacked (on the device: unzip .whl/*.whl into /tmp/site, PYTHONPATH=/tmp/site:\$PWD)"
  export PYTHONPATH=$PWD
elif ls .whl/*.whl >/dev/null 2>&1; then
  mkdir -p /tmp/site
  for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site; done
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "WARNING: no .whl/ here (run 'bash scripts/gpu_check.sh --wheels' first and carry .whl):" \
       "serving and NIXL parts will fail on missing packages"
  export PYTHONPATH=$PWD
fi

echo "== machine"
if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
"$PY" - <<'PY'
import importlib.metadata as md, platform, torch
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {v('triton')}, transformers {v('transformers')}, openai {v('openai')}, nixl {v('nixl')}; "
      f"gpu: {gpu}")
PY

declare -A RESULT=()
ORDER=()

# run_part NAME LIMIT_S COMMAND...: the command under `timeout`, its output shown and kept in
# $LOGS/NAME.log; records PASS, FAIL with the exit status, or FAIL by timeout.
run_part() {
  local name=$1 limit=$2
  shift 2
  local log="$LOGS/$name.log" start=$SECONDS rc
  echo
  echo "== $name (limit ${limit} s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    RESULT[$name]="PASS (${took} s)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    RESULT[$name]="FAIL (stopped at its ${limit} s limit)"
  else
    RESULT[$name]="FAIL (exit status $rc after ${took} s; log $log)"
  fi
  ORDER+=("$name")
}

# (a) Every file holding GPU tests, whole: on a GPU its kernel tests run compiled, not interpreted.
mapfile -t GPU_TEST_FILES < <(grep -rl --include='test_*.py' "mark.gpu" tests | sort)
if [ "$DRY" = 1 ]; then
  run_part gpu-tests 110 "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 90 "${GPU_TEST_FILES[@]}"
else
  run_part gpu-tests 110 "$PY" -m pytest -q -p no:cacheprovider --timeout 90 "${GPU_TEST_FILES[@]}"
fi

# (b) The benchmark; one round over the trees in its host section keeps it inside its limit. Its
# baseline comes from git where the copy has the repository, else from the archive --wheels made.
if [ "$DRY" = 1 ]; then
  BENCH_ARGS=(--host-only --quick)
else
  BENCH_ARGS=(--rounds 1)
fi
REV=$(sed -n 's/^BASELINE_REV = "\(.*\)"/\1/p' benchmarks/bench_gpu.py)
ARCHIVE=$(find .whl -maxdepth 1 -name "baseline-*.tar.gz" 2>/dev/null | head -1)
if ! git rev-parse -q --verify "$REV^{commit}" >/dev/null 2>&1; then
  if [ -n "$ARCHIVE" ]; then
    BENCH_ARGS+=(--baseline-archive "$ARCHIVE")
  else
    echo "no git repository and no .whl/baseline-*.tar.gz: the host section measures the working tree alone"
    BENCH_ARGS+=(--no-baseline)
  fi
fi
run_part bench 230 "$PY" benchmarks/bench_gpu.py "${BENCH_ARGS[@]}" \
  --json "$LOGS/bench_gpu.json" --markdown "$LOGS/bench_gpu.md"
BENCH_VERDICT=$(grep -a '^bench_gpu: ' "$LOGS/bench.log" | tail -1)

# (c) and (d): one random-weights model directory for both; up compares with serve's answer.
run_part serve 60 "$PY" benchmarks/gpu_serve_check.py serve --device "$DEVICE" --workdir "$WORK" --timeout 45
run_part up 80 "$PY" benchmarks/gpu_serve_check.py up --device "$DEVICE" --workdir "$WORK" --timeout 65

{
  echo "== gpu_check summary (device $DEVICE, $((SECONDS - START)) s in all)"
  for name in "${ORDER[@]}"; do
    printf '%-10s %s\n' "$name" "${RESULT[$name]}"
  done
  [ -n "$BENCH_VERDICT" ] && echo "$BENCH_VERDICT"
  echo "tables: $LOGS/bench_gpu.md"
} | tee "$LOGS/summary.txt"
for name in "${ORDER[@]}"; do
  case ${RESULT[$name]} in PASS*) ;; *) exit 1 ;; esac
done
exit 0
