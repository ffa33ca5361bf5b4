"""Why UCX would (or would not) move GPU memory with a CUDA transport, from facts a process can
read without a GPU call: which UCX module directory it loads from, which transport modules sit
there, whether the CUDA ones load (libuct_cuda needs libcuda.so.1, which only the NVIDIA driver
provides), and whether UCX_TLS leaves the CUDA transports out.

NIXL's wheel carries its own UCX build (its modules beside libucp, or UCX_MODULE_DIR). When the
cuda module does not load, UCX stages VRAM through host memory over whatever is left (TCP over
loopback on a machine without RDMA): the 0.4 GB/s of issue 33. scripts/ucx_diag.sh prints the
same facts plus `ucx_info -d` on a machine.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class UcxFacts:
    module_dir: str | None  # where UCX looks for its transport modules
    modules: tuple[str, ...]  # libuct_*.so found there
    cuda_module_error: str | None  # why libuct_cuda does not load; None when it does
    ucx_tls: str | None  # the UCX_TLS setting, if any

    @property
    def cuda_transports(self) -> bool:
        """Whether UCX can use its CUDA transports (cuda_copy, cuda_ipc) here."""
        return self.cuda_module_error is None and not self.tls_excludes_cuda

    @property
    def tls_excludes_cuda(self) -> bool:
        if not self.ucx_tls:
            return False
        tls = [t.strip() for t in self.ucx_tls.split(",")]
        if tls and tls[0].startswith("^"):  # "^tcp": everything but the list
            return any(t.lstrip("^").startswith("cuda") for t in tls)
        return "all" not in tls and not any(t.startswith("cuda") for t in tls)

    def cause(self) -> str:
        """Why the CUDA transports are not used, with the fix (for the start-up warning)."""
        if self.module_dir is None:
            return ("no UCX module directory found (is NIXL installed? set UCX_MODULE_DIR to the directory "
                    "holding libuct_*.so)")
        if self.cuda_module_error is not None:
            return (f"UCX's CUDA module in {self.module_dir} does not load ({self.cuda_module_error}): "
                    "install the NVIDIA driver's libcuda.so.1 where the loader finds it (ldconfig, or "
                    "LD_LIBRARY_PATH), or point UCX_MODULE_DIR at a UCX built with CUDA")
        if self.tls_excludes_cuda:
            return f"UCX_TLS={self.ucx_tls} leaves out the CUDA transports: add cuda_copy,cuda_ipc"
        return "UCX's CUDA module loads; the measured path says whether UCX picked it"


def ucx_module_dir() -> str | None:
    """UCX_MODULE_DIR, else the ucx/ directory beside the libucp of an installed NIXL wheel."""
    configured = os.environ.get("UCX_MODULE_DIR")
    if configured:
        return configured
    for package in ("nixl_cu12", "nixl", "nixl_cu13"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in list(spec.submodule_search_locations) + [os.path.dirname(p) for p in
                                                             spec.submodule_search_locations]:
            found = sorted(glob.glob(os.path.join(root, "**", "ucx", "libuct_*.so*"), recursive=True))
            if found:
                return os.path.dirname(found[0])
    return None


def ucx_facts() -> UcxFacts:
    module_dir = ucx_module_dir()
    modules: tuple[str, ...] = ()
    cuda_error: str | None = "no UCX module directory"
    if module_dir is not None:
        found = glob.glob(os.path.join(module_dir, "libuct_*.so*"))
        modules = tuple(sorted(os.path.basename(p) for p in found))
        cuda = [m for m in modules if m.startswith("libuct_cuda")]
        cuda_error = "no libuct_cuda module (a UCX built without CUDA)" if not cuda else None
        for name in cuda:
            try:
                ctypes.CDLL(os.path.join(module_dir, name))
            except OSError as e:
                cuda_error = str(e)
                break
    return UcxFacts(module_dir, modules, cuda_error, os.environ.get("UCX_TLS"))
