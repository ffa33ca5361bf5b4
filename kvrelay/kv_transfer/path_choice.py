"""Which transfer path a P/D pair of GPU instances should use, fastest working first:

    1. cuda_ipc        P and D see the same GPUs on one host: device-to-device copies
    2. nixl on VRAM    UCX's CUDA transports load (transport/ucx_diag.py)
    3. host staging    kv_buffer_device "cpu": pinned host mirrors, read by NIXL on DRAM where
                       NIXL is installed, else by the built-in TCP transport

A backend the user names is kept; on a GPU a host-only one (tcp, mooncake) gets host staging,
the only way it can move GPU KV. On the CPU nothing changes. Imports no torch: `kvrelay up`
decides before any instance starts, and prints the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PathChoice:
    backend: str
    kv_buffer_device: str  # "cuda": the transport reads KV where it lives; "cpu": host staging
    reason: str

    def describe(self) -> str:
        staging = ", host staging (kv_buffer_device cpu)" if self.kv_buffer_device == "cpu" else ""
        return f"{self.backend}{staging}: {self.reason}"


def choose_transfer_path(gpu_sets: Sequence[Sequence[str]], requested_backend: str | None,
                         nixl_installed: bool, ucx_cuda: tuple[bool, str], push: bool = False) -> PathChoice:
    """The path for instances placed on `gpu_sets` (each instance's CUDA_VISIBLE_DEVICES entries;
    empty: on the CPU). `ucx_cuda`: whether UCX's CUDA transports load, and why not."""
    host_backend = "nixl" if nixl_installed else "tcp"
    if not gpu_sets or not all(gpu_sets):
        return PathChoice(requested_backend or host_backend, "cuda", "KV in host memory")
    if requested_backend is not None:
        return _requested(requested_backend, gpu_sets, ucx_cuda, push)
    shared = len({tuple(sorted(gpus)) for gpus in gpu_sets}) == 1
    if shared:
        return PathChoice("cuda_ipc", "cuda", f"every instance sees GPU(s) {','.join(gpu_sets[0])}: "
                                               "device-to-device copies through CUDA IPC")
    ucx_ok, why_not = ucx_cuda
    if nixl_installed and ucx_ok:
        return PathChoice("nixl", "cuda", "instances on different GPUs; UCX's CUDA transports load")
    reason = (f"instances on different GPUs (cuda_ipc needs D to see P's GPU) and "
              f"{'NIXL is not installed' if not nixl_installed else 'UCX has no CUDA transport: ' + why_not}")
    if push:  # push does not stage yet: NIXL (or TCP) as on the CPU, and the start-up check warns
        return PathChoice(host_backend, "cuda", reason + "; push mode cannot stage, so expect host speed")
    return PathChoice(host_backend, "cpu", reason)


def _requested(backend: str, gpu_sets: Sequence[Sequence[str]], ucx_cuda: tuple[bool, str],
               push: bool) -> PathChoice:
    if backend == "cuda_ipc":
        if len({tuple(sorted(gpus)) for gpus in gpu_sets}) != 1:
            raise ValueError("--kv-backend cuda_ipc needs every instance to see the same GPU(s), and "
                             f"these are placed on {[','.join(g) for g in gpu_sets]}: use one GPU "
                             "(--device cuda:0) or another backend")
        return PathChoice(backend, "cuda", "asked for; every instance sees the same GPU(s)")
    if backend == "nixl" and ucx_cuda[0]:
        return PathChoice(backend, "cuda", "asked for; UCX's CUDA transports load")
    if push:
        return PathChoice(backend, "cuda", "asked for; push mode cannot stage, so expect host speed")
    why = f"UCX has no CUDA transport: {ucx_cuda[1]}" if backend == "nixl" else f"{backend} moves host memory"
    return PathChoice(backend, "cpu", f"asked for; {why}")
