#!/usr/bin/env bash
# Why UCX (under NIXL) does or does not move GPU memory with a CUDA transport, on this machine.
# Prints: the UCX module directory and its libuct_* modules, what libuct_cuda needs and whether
# the loader finds it (libcuda.so.1 comes only with the NVIDIA driver), UCX_TLS, `ucx_info -d`
# where the tool exists, and kvrelay's own reading (kvrelay/kv_transfer/transport/ucx_diag.py).
# Read-only; run from the repository root: bash scripts/ucx_diag.sh
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}

echo "== environment"
echo "UCX_MODULE_DIR=${UCX_MODULE_DIR:-<unset>}"
echo "UCX_TLS=${UCX_TLS:-<unset>}"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-<unset>}"
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<unset>}"

echo
echo "== the driver's libcuda"
ldconfig -p 2>/dev/null | grep -E 'libcuda\.so' || echo "libcuda.so.* is not in the loader cache (ldconfig -p)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

echo
echo "== UCX modules kvrelay would use"
MODULE_DIR=$("$PY" -c 'from kvrelay.kv_transfer.transport.ucx_diag import ucx_module_dir; print(ucx_module_dir() or "")')
if [ -z "$MODULE_DIR" ]; then
  echo "no UCX module directory found (NIXL not installed, and UCX_MODULE_DIR unset)"
else
  echo "$MODULE_DIR"
  ls -1 "$MODULE_DIR"
  for m in "$MODULE_DIR"/libuct_cuda*.so*; do
    [ -e "$m" ] || { echo "no libuct_cuda module: this UCX was built without CUDA"; break; }
    echo
    echo "-- ldd $(basename "$m")"
    ldd "$m" | grep -E 'not found|libcuda|libcudart|libucs' || true
  done
fi

echo
echo "== ucx_info -d (transports and devices)"
if command -v ucx_info >/dev/null; then
  ucx_info -d | grep -E 'Transport|Device' | sort | uniq -c
else
  echo "ucx_info: not on PATH (NIXL's wheel does not ship it; a system UCX package does)"
fi

echo
echo "== kvrelay's reading"
"$PY" - <<'PY'
from kvrelay.kv_transfer.transport.ucx_diag import ucx_facts
facts = ucx_facts()
print(f"module dir: {facts.module_dir}")
print(f"CUDA transports usable: {facts.cuda_transports}")
print(f"cause: {facts.cause()}")
PY
