#!/usr/bin/env bash
# The device check of issues 32, 33 and 42 for a lent GPU, as three device calls ordered by value,
# each within 300 s of command time and all three within 11 minutes (a session has 15 minutes of
# device time, the machine's start included). Make them back to back: the machine stays warm for
# 30 s after a call, with its Triton cache (a fresh one recompiles every kernel).
#
# After the third call, give the machine back (the device tool's give_back) unless one is rerun at
# once. Here, once, before the calls (needs the package registries):
#   bash scripts/gpu_check.sh --wheels    # .whl/: the wheels of scripts/device_wheels.txt
#
# The device calls (run from the repository root; each prints its parts' limits first):
#   call 1  command "bash scripts/gpu_check.sh --call 1", carry [".whl"], timeout_s 300
#           imports   every module of kvrelay, the benchmarks and the checked tests imported, and
#                     every carried wheel's requirements met by what is installed (device_env.py)
#           kernels   the Triton kernel tests compiled for the GPU (and no register spill)
#           smoke     one engine: float32 tokens equal transformers', CUDA-graph tokens equal eager
#           bench     bench_gpu.py's throughput section, SmolLM2 shape: single-stream and batch-64
#                     decode, prefill, against transformers
#   call 2  command "bash scripts/gpu_check.sh --call 2", carry [".whl"], timeout_s 220
#           gpu-tests the rest of tests/gpu: KV sizing (also two instances on one GPU), P/D, serve
#           serve     `kvrelay serve --device cuda` answers the OpenAI client; 4096-token TTFT
#           up        `kvrelay up --device cuda` (1P1D) answers as the single instance; TTFT ratio
#   call 3  command "bash scripts/gpu_check.sh --call 3", carry [".whl"], timeout_s 140
#           ucx-diag  whether UCX loads its CUDA transports (scripts/ucx_diag.sh)
#           transfer  the GPU tests of CUDA IPC, host staging and the GPU offload tier
#           bench-kv  bench_transfer.py --gpu on issue 33's 512 MiB Llama-8B block set
#           bench-gpu bench_gpu.py's busy and correctness sections, SmolLM2 shape
# Not in these 11 minutes (a later session, `--call 4`, timeout_s 300): the batch-invariant mode's
# GPU tests (tests/gpu/test_batch_invariance_gpu.py), the Llama-3.2-1B shape, bench_transfer's
# SmolLM2 layout and benchmarks/offload_gpu.py. (bench_gpu.py's host section measures the host's
# CPU, not the GPU: run it anywhere with `--only host`.)
#
# Each part runs under its own limit, cut to what is left of its call; a part that hits it is
# killed with its process group, and a `kvrelay up` cluster (a session of its own) is stopped by
# the exit trap. A PASS/FAIL line follows each part and a summary ends the call; with $OUT set
# (the device tool sets it) the call's log, the summary and the tables are written there (at most
# 8 files come back).
#
# Without a GPU, the same calls on the CPU, every limit x3 (GPU tests skip with their reason,
# bench_gpu's host section in its quick form, serve and up with --device cpu and 256-token TTFT
# prompts, device_env.py's resolver offline, the offload benchmark skipped):
#   GPU_CHECK_DRY=1 PYTHON=/work/main/.venv/bin/python bash scripts/gpu_check.sh --call N
#   bash scripts/gpu_check.sh --plan      # the calls' parts and limits, adding up
set -u
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY:-0}
GRACE_S=5  # timeout's kill grace per part
END_S=5  # the script ends this long before the device tool's limit
CALL_TIMEOUT=(0 300 220 140 300)  # the device call's timeout_s, by call
SETUP_S=(0 10 5 5 5)  # what a call spends before and between its parts (wheels, nvidia-smi, pip list)
CALL_PARTS=("" "imports kernels smoke bench" "gpu-tests serve up" "ucx-diag transfer bench-kv bench-gpu"
            "invariance bench-llama bench-kv-smollm offload")
declare -A LIMIT=([imports]=30 [kernels]=85 [smoke]=55 [bench]=90 [gpu-tests]=75 [serve]=55 [up]=65
                  [ucx-diag]=10 [transfer]=40 [bench-kv]=30 [bench-gpu]=30
                  [invariance]=60 [bench-llama]=120 [bench-kv-smollm]=40 [offload]=45)

plan_line() {  # plan_line CALL: its parts' limits, adding up within the call
  local call=$1 total=$((SETUP_S[$1] + END_S)) terms="setup ${SETUP_S[$1]}" part
  for part in ${CALL_PARTS[$call]}; do
    total=$((total + LIMIT[$part] + GRACE_S))
    terms="$terms + $part ${LIMIT[$part]}+$GRACE_S"
  done
  terms="$terms + end $END_S"
  local verdict="within"
  [ "$total" -le "${CALL_TIMEOUT[$call]}" ] || verdict="OVER"
  echo "call $call: $terms = $total s, $verdict its timeout_s ${CALL_TIMEOUT[$call]}"
}

if [ "${1:-}" = "--plan" ]; then
  for call in 1 2 3 4; do plan_line "$call"; done
  echo "calls 1-3: $((CALL_TIMEOUT[1] + CALL_TIMEOUT[2] + CALL_TIMEOUT[3])) s of command time (at most 660 s," \
       "11 minutes); call 4 is for a later session"
  exit 0
fi

if [ "${1:-}" = "--wheels" ]; then
  rm -rf .whl && mkdir -p .whl || exit 1
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || [ ! -d .git ] || echo '/.whl/' >> .git/info/exclude
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    -d .whl -r scripts/device_wheels.txt || exit 1
  # nixl-cu13 without its expert-parallel library and UCX's perftest tools (29 MB of its 58), so
  # that everything fits the 64 MiB a call may carry.
  "$PY" - <<'PY' || exit 1
import glob, os, zipfile
for src in glob.glob(".whl/nixl_cu13-*.whl"):
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(src + ".tmp", "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if not (info.filename.startswith("nixl_ep_cu13/") or "perftest" in info.filename):
                zo.writestr(info, zi.read(info.filename))
    os.replace(src + ".tmp", src)
PY
  "$PY" benchmarks/device_env.py resolve .whl | tail -3 || exit 1
  du -ch .whl/* | tail -1
  exit 0
fi

CALL=""
[ "${1:-}" = "--call" ] && CALL=${2:-}
case $CALL in 1|2|3|4) ;; *)
  echo "usage: bash scripts/gpu_check.sh --call 1|2|3|4 | --plan | --wheels (the header says which calls to make)"
  exit 2 ;;
esac

DEVICE=cuda
[ "$DRY" = 1 ] && DEVICE=cpu
LOGS=${OUT:-/tmp/kvrelay-gpu-check/logs}
WORK=/tmp/kvrelay-gpu-check/work  # the serve and up checks' model directory and logs
mkdir -p "$LOGS" "$WORK"
exec > >(tee -a "$LOGS/call$CALL.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1
START=$SECONDS
BUDGET=$((CALL_TIMEOUT[CALL] - END_S))
SCALE=1
if [ "$DRY" = 1 ]; then  # the CPU here runs the same parts slower (and is shared): three times the time
  SCALE=3
  BUDGET=$((BUDGET * SCALE))
fi

# stop_up: a `kvrelay up` cluster runs in a session of its own, out of reach of timeout's kill.
stop_up() {
  local pgid
  pgid=$(cat "$WORK/up.pgid" 2>/dev/null) || return 0
  kill -TERM -- "-$pgid" 2>/dev/null && sleep 3
  kill -KILL -- "-$pgid" 2>/dev/null
  rm -f "$WORK/up.pgid"
}
finish() {  # on any exit: the cluster stopped, the log complete before the device tool reads it
  stop_up
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
}
trap finish EXIT

echo "== gpu_check call $CALL (device $DEVICE)"
plan_line "$CALL"
[ "$SCALE" = 1 ] || echo "dry run: every limit and the call's budget x$SCALE on this CPU"
if [ "$DRY" = 1 ]; then
  echo "dry run: no wheels unpacked (on the device: .whl/*.whl into /tmp/site, PYTHONPATH=/tmp/site:\$PWD)"
  export PYTHONPATH=$PWD
elif ls .whl/*.whl >/dev/null 2>&1; then
  stamp=$(ls -l .whl/*.whl | md5sum)  # a warm machine keeps /tmp/site from the call before
  if [ "$(cat /tmp/site/.kvrelay-wheels 2>/dev/null)" != "$stamp" ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && echo "$stamp" > /tmp/site/.kvrelay-wheels || echo "WARNING: the carried wheels did not install"
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "WARNING: no .whl/ here (run 'bash scripts/gpu_check.sh --wheels' first and carry .whl)"
  export PYTHONPATH=$PWD
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
if [ "$CALL" = 1 ]; then  # the image's packages and versions, for scripts/device_image.txt
  "$PY" -m pip list --format=freeze 2>/dev/null > "$LOGS/image_packages.txt"
fi

declare -A RESULT=()
ORDER=()

# run_part NAME COMMAND...: the command under `timeout`, its limit LIMIT[NAME] cut to what is
# left of the call; records PASS, FAIL with the exit status, FAIL at the limit, or SKIPPED.
run_part() {
  local name=$1 start=$SECONDS rc
  shift
  local left=$((BUDGET - (SECONDS - START) - GRACE_S))
  local limit=$((LIMIT[$name] * SCALE))
  [ "$left" -lt "$limit" ] && limit=$left
  ORDER+=("$name")
  echo
  if [ "$limit" -lt 5 ]; then
    RESULT[$name]="SKIPPED (no time left in the call)"
    echo "== $name: ${RESULT[$name]}"
    return
  fi
  echo "== $name (limit ${limit} s): $*"
  timeout -k "$GRACE_S" "$limit" "$@"
  rc=$?
  stop_up
  local took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    RESULT[$name]="PASS (${took} s)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    RESULT[$name]="FAIL (stopped at its ${limit} s limit)"
  else
    RESULT[$name]="FAIL (exit status $rc after ${took} s)"
  fi
  echo "== $name: ${RESULT[$name]}"
}

skip_part() {  # skip_part NAME REASON: recorded, not run (counts as passed)
  ORDER+=("$1")
  RESULT[$1]="SKIPPED ($2)"
  echo
  echo "== $1: ${RESULT[$1]}"
}

# pytest_part NAME GROUP [ARGS...]: the test files of device_env.py's GROUP; on the CPU only the
# GPU-marked ones (they skip with their reason); on the device in 8 processes where pytest-xdist is
# installed (a cold Triton cache compiles every kernel variant on the CPU).
pytest_part() {
  local name=$1 group=$2
  shift 2
  local files=() args=(-q -p no:cacheprovider --timeout 120 -rs "$@")
  mapfile -t files < <("$PY" benchmarks/device_env.py tests "$group")
  if [ "$DRY" = 1 ]; then
    args+=(-m gpu)
  elif "$PY" -c "import xdist" 2>/dev/null; then
    args+=(-n 8)
  fi
  run_part "$name" "$PY" -m pytest "${args[@]}" "${files[@]}"
}

bench_gpu() {  # bench_gpu NAME MARKDOWN JSON ARGS...: bench_gpu.py on the device, its host section here
  local name=$1 md=$2 json=$3
  shift 3
  if [ "$DRY" = 1 ]; then
    set -- --host-only --quick --no-baseline
  fi
  run_part "$name" "$PY" benchmarks/bench_gpu.py "$@" --markdown "$LOGS/$md" --json "$LOGS/$json"
}

bench_kv() {  # bench_kv NAME MARKDOWN ARGS...: bench_transfer.py --gpu (the CPU transports here)
  local name=$1 md=$2
  shift 2
  if [ "$DRY" = 1 ]; then
    set -- --tokens 64 --block-sizes 16 --reps 1 --columns tcp --plot "$WORK/bench_transfer_dry.png"
  fi
  run_part "$name" "$PY" benchmarks/bench_transfer.py "$@" --markdown "$LOGS/$md"
}

serve_part() {  # serve_part serve|up TIMEOUT: the server checks, their instances' start within TIMEOUT
  local tokens=4096  # issue 33's TTFT prompts; on the CPU a short one proves the path
  [ "$DRY" = 1 ] && tokens=256
  run_part "$1" "$PY" benchmarks/gpu_serve_check.py "$1" --device "$DEVICE" --workdir "$WORK" \
    --timeout $(($2 * SCALE)) --prompt-tokens "$tokens"
}

case $CALL in
  1)
    if [ "$DRY" = 1 ]; then run_part imports "$PY" benchmarks/device_env.py resolve
    else run_part imports "$PY" benchmarks/device_env.py check; fi
    pytest_part kernels kernels
    pytest_part smoke smoke
    bench_gpu bench bench_gpu.md bench_gpu.json --only throughput --shapes smollm2-135m --no-baseline
    ;;
  2)
    mapfile -t SMOKE < <("$PY" benchmarks/device_env.py tests smoke)  # ran in call 1
    pytest_part gpu-tests gpu "${SMOKE[@]/#/--deselect=}"
    rm -rf "$WORK/tiny-random" "$WORK/single_answer.json"
    serve_part serve 35
    serve_part up 45
    ;;
  3)
    run_part ucx-diag bash scripts/ucx_diag.sh
    pytest_part transfer transfer
    bench_kv bench-kv bench_transfer_gpu_llama8b.md --gpu --layout llama-8b --tokens 4096 --block-sizes 16 --reps 3
    bench_gpu bench-gpu bench_gpu_more.md bench_gpu_more.json --only busy correctness --shapes smollm2-135m \
      --no-baseline
    ;;
  4)
    pytest_part invariance invariance
    bench_gpu bench-llama bench_gpu_llama.md bench_gpu_llama.json --only throughput busy --shapes llama-3.2-1b \
      --no-baseline
    bench_kv bench-kv-smollm bench_transfer_gpu.md --gpu --tokens 1024 8192 --block-sizes 16 64 --reps 3
    if [ "$DRY" = 1 ]; then skip_part offload "its workload of the SmolLM2 shape takes a CPU here over 6 minutes"
    else run_part offload "$PY" benchmarks/offload_gpu.py --device cuda; fi
    ;;
esac

{
  echo
  echo "== gpu_check call $CALL summary (device $DEVICE, $((SECONDS - START)) s of $((BUDGET + END_S)))"
  for name in "${ORDER[@]}"; do
    printf '%-16s %s\n' "$name" "${RESULT[$name]}"
  done
} | tee "$LOGS/summary-call$CALL.txt"
for name in "${ORDER[@]}"; do
  case ${RESULT[$name]} in PASS*|"SKIPPED (its "*) ;; *) exit 1 ;; esac
done
exit 0
