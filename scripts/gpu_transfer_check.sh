#!/usr/bin/env bash
# The device check of issue 33 (KV out of VRAM), for a lent GPU, from the repository root:
#   (a) ucx-diag   scripts/ucx_diag.sh: whether UCX can use its CUDA transports here, and why not
#   (b) gpu-tests  the GPU-marked tests under tests/kv_transfer (cuda_ipc between two processes,
#                  host staging of GPU KV) and the files they sit in
#   (c) bench      benchmarks/bench_transfer.py --gpu: cuda_ipc, NIXL on VRAM and host staging
#                  against the device's own block copy and a pinned round trip, on the issue's
#                  512 MiB Llama-8B block set (bench-issue) and on SmolLM2's layout (bench)
#   (d) offload    benchmarks/offload_gpu.py: a repeated 4096-token prompt computes one token, and
#                  decode ITL with the tier's stores and loads running against without
# Each part's log goes to $OUT (the device tool sets it), else /tmp/kvrelay-gpu-transfer; a
# PASS/FAIL line per part ends the output. Called by scripts/gpu_check.sh; on its own:
#   bash scripts/gpu_transfer_check.sh
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/kvrelay-gpu-transfer}
mkdir -p "$LOGS"
STATUS=0

part() {
  local name=$1 limit=$2
  shift 2
  echo
  echo "== $name (limit ${limit} s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGS/transfer-$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then echo "transfer $name: PASS"; else echo "transfer $name: FAIL ($rc)"; STATUS=1; fi
}

part ucx-diag 30 bash scripts/ucx_diag.sh
mapfile -t FILES < <(grep -rl --include='test_*.py' "mark.gpu" tests/kv_transfer | sort)
part gpu-tests 110 "$PY" -m pytest -q -p no:cacheprovider --timeout 100 "${FILES[@]}"
# issue 33's case: 4096 tokens of a Llama-8B layout, block size 16 (512 MiB), pull through each path
part bench-issue 110 "$PY" benchmarks/bench_transfer.py --gpu --layout llama-8b --tokens 4096 --block-sizes 16 \
  --reps 3 --markdown "$LOGS/bench_transfer_gpu_llama8b.md"
part bench 70 "$PY" benchmarks/bench_transfer.py --gpu --tokens 1024 8192 --block-sizes 16 64 --reps 3 \
  --markdown "$LOGS/bench_transfer_gpu.md"
part offload 90 "$PY" benchmarks/offload_gpu.py --device cuda
exit $STATUS
