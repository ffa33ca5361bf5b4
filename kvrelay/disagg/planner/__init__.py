"""The planner: measured latency profiles and a goodput simulator of colocated and xPyD clusters.

`kvrelay profile` writes a Profile (profile.py, measured by profiler.py); `kvrelay plan` runs the
cluster simulator (sim.py, instance.py, pool.py) inside a goodput search (search.py), or
DistServe's own model and search (distserve.py), over a workload (workload.py).
"""

from kvrelay.disagg.planner.profile import Profile, StepFit, TransferFit, load_profile
from kvrelay.disagg.planner.search import Goodput, GoodputSearch, SearchOptions, cluster_shapes
from kvrelay.disagg.planner.sim import SLO, ClusterSpec, SimOptions, SimResult, attainment, simulate
from kvrelay.disagg.planner.workload import RequestSpec, Workload, load_mooncake_trace, synthetic_workload

__all__ = [
    "SLO", "ClusterSpec", "Goodput", "GoodputSearch", "Profile", "RequestSpec", "SearchOptions", "SimOptions",
    "SimResult", "StepFit", "TransferFit", "Workload", "attainment", "cluster_shapes", "load_mooncake_trace",
    "load_profile", "simulate", "synthetic_workload",
]
