"""The seam under the CUDA IPC transport: how a KV tensor is shared with another process on the
same host, opened there, copied on a side stream and waited for.

    CudaIpc    torch's CUDA IPC (cudaIpcGetMemHandle / cudaIpcOpenMemHandle under
               `UntypedStorage._share_cuda_` / `_new_shared_cuda`), copies on a side stream,
               completion by CUDA events. Needs a GPU.
    HostIpc    the same contract on host memory: a tensor moved into POSIX shared memory (torch's
               file_system sharing), opened by name in any process of the host, copied at once.
               It lets the transport's bookkeeping (handshake, runs, leases, failures, closing)
               run for real on a machine without a GPU; the engine never picks it.

A handle is a list of msgpack-able values (bytes, ints, strings): it travels inside the
transport's agent blob, in the authenticated handshake.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kvrelay.kv_transfer.transport.block_copy import contiguous_strides
from kvrelay.kv_transfer.transport.streams import CopyEvent, SideStream

if TYPE_CHECKING:
    import torch


class IpcSeam(ABC):
    """Share, open and copy KV tensors between processes of one host."""

    name: str

    def __init__(self) -> None:
        self.opened = 0  # tensors opened from peers' handles
        self.closed = 0  # of those, dropped again

    @abstractmethod
    def check_device(self, device: str) -> None:
        """ValueError (naming the device and the fix) unless KV on `device` can be shared."""

    @abstractmethod
    def export(self, tensor: torch.Tensor) -> list[Any]:
        """A handle another process on this host can open `tensor` from (whole storage)."""

    @abstractmethod
    def open(self, handle: list[Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The peer's tensor behind `handle`: a contiguous `shape` of `dtype` over its memory."""

    def close(self, tensor: torch.Tensor) -> None:
        """Drop an opened tensor; its mapping goes when the last reference does."""
        self.closed += 1
        del tensor

    @abstractmethod
    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        """Copies issued inside run off the compute stream."""

    @abstractmethod
    def record(self) -> CopyEvent:
        """An event after the copies issued so far on the side stream."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every copy issued on the side stream ran (before peers' memory is unmapped
        under copies that are still queued)."""


class CudaIpc(IpcSeam):
    """CUDA IPC between processes (a process cannot open its own handles: CUDA refuses)."""

    name = "cuda"

    def __init__(self, device: str) -> None:
        super().__init__()
        import torch

        check_cuda_ipc_possible()
        self.device = torch.device(device if device.startswith("cuda") else "cuda")
        self._stream = SideStream(str(self.device))

    def check_device(self, device: str) -> None:
        require_gpu_kv(device)

    def export(self, tensor: torch.Tensor) -> list[Any]:
        shared = tensor.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
        return [list(shared), tensor.storage_offset()]

    def open(self, handle: list[Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        import torch

        shared, offset = handle
        # NOTE: the storage lands on the exporter's device (the handle's first field), which under
        # one visible GPU set may be another index than ours: the tensor must be built there.
        device = exported_device(shared)
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(*shared)  # type: ignore[attr-defined]
        self.opened += 1
        empty = torch.empty(0, dtype=dtype, device=device)
        return empty.set_(storage, offset, shape, contiguous_strides(shape))

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._stream.copying()

    def record(self) -> CopyEvent:
        return self._stream.record()

    def synchronize(self) -> None:
        self._stream.synchronize()


def exported_device(shared: list[Any]) -> torch.device:
    """The device a CUDA IPC handle's memory lives on: `_share_cuda_`'s first field is the
    exporter's device index."""
    import torch

    return torch.device("cuda", int(shared[0]))


class HostIpc(IpcSeam):
    """CUDA IPC's contract on host memory, for machines without a GPU (tests, bookkeeping)."""

    name = "host"

    def __init__(self, copy_delay_s: float = 0.0) -> None:
        super().__init__()
        self._stream = SideStream("cpu", copy_delay_s)
        self.fail_open = False  # opening a peer's handle raises, as a foreign handle would
        self.synchronized = 0  # synchronize() calls, for the tests

    def check_device(self, device: str) -> None:
        if device != "cpu":
            raise ValueError(f"the host IPC seam shares host memory, KV is on {device}")

    def export(self, tensor: torch.Tensor) -> list[Any]:
        # NOTE: moves the storage into shared memory in place (same tensor, new address).
        manager, filename, size = tensor.untyped_storage()._share_filename_cpu_()  # type: ignore[attr-defined]
        return [manager, filename, size, tensor.storage_offset()]

    def open(self, handle: list[Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        import torch

        if self.fail_open:
            raise RuntimeError("injected: the peer's handle cannot be opened here")
        manager, filename, size, offset = handle
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager, filename, size)  # type: ignore[attr-defined]
        self.opened += 1
        return torch.empty(0, dtype=dtype).set_(storage, offset, shape, contiguous_strides(shape))

    @property
    def copy_delay_s(self) -> float:
        """How long each copy's event takes to report done (a test's slow copy)."""
        return self._stream.delay_s

    @copy_delay_s.setter
    def copy_delay_s(self, value: float) -> None:
        self._stream.delay_s = value

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._stream.copying()

    def record(self) -> CopyEvent:
        return self._stream.record()

    def synchronize(self) -> None:
        self.synchronized += 1
        self._stream.synchronize()


def check_cuda_ipc_possible() -> None:
    """ValueError naming the problem unless this process sees a CUDA GPU to share KV from."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"backend 'cuda_ipc' needs a CUDA GPU, and this process sees none (torch "
                         f"{torch.__version__}, {build}; check CUDA_VISIBLE_DEVICES and nvidia-smi); "
                         "on a CPU instance use backend 'tcp' or 'nixl'")


def require_gpu_kv(device: str) -> None:
    """ValueError unless KV on `device` is GPU memory that CUDA IPC can share."""
    if not device.startswith("cuda"):
        raise ValueError(f"backend 'cuda_ipc' shares KV in GPU memory, and this instance keeps its "
                         f"KV on {device}: run it with --device cuda, or use backend 'tcp'/'nixl'")
