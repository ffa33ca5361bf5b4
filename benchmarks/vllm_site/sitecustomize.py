"""Keeps a vLLM CPU instance on the cores it was given (tests and benchmarks put this folder on the
PYTHONPATH of the vLLM servers they start; Python imports `sitecustomize` in every process).

vLLM 0.32's NixlConnector worker, on a CPU, moves its own thread (the one that runs the model) to
the last core of each NUMA node (`os.sched_setaffinity` in nixl/base_worker.py), whatever
VLLM_CPU_OMP_THREADS_BIND says; it is the only caller of `os.sched_setaffinity` in vLLM. On a
many-core host that reserves one core for transfers; on this project's 2-core machine it puts every
NIXL instance's compute on core 1, so two instances that were given a core each share one, and a
comparison against them would measure that, not the connector. With this, the call is ignored and
the thread stays where VLLM_CPU_OMP_THREADS_BIND bound it.
"""

import os

if hasattr(os, "sched_setaffinity"):
    def _keep_given_cores(pid: int, cpus: object) -> None:
        return None

    os.sched_setaffinity = _keep_given_cores
