"""`kvrelay up --offload-remote-url mooncakestore://...`: the decode instances join a Mooncake
Store (a mooncake_master the test starts) as their offload tier, serve, and leak nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrelay.disagg.launcher import ClusterSpec, LocalCluster
from kvrelay.disagg.launcher_cli import offload_config
from tests.disagg.test_pd_e2e import SERVE_ARGS, completion, metrics, wait_for_blocks_freed
from tests.kv_transfer.offload.mooncake_master import MooncakeMaster
from tests.tiny import write_tiny_model_dir


def test_up_with_a_mooncake_store_tier_serves_and_leaks_nothing(tmp_path: Path) -> None:
    master = MooncakeMaster()
    try:
        url = master.url + "?segment=32MiB&buffer=16MiB"
        args = argparse.Namespace(offload=False, offload_cpu_bytes=None, offload_disk_dir=None,
                                  offload_disk_bytes=None, offload_remote_url=url)
        offload = offload_config(args)
        assert offload == {"remote_url": url}
        model = str(write_tiny_model_dir(tmp_path / "model"))
        spec = ClusterSpec(model=model, port=0, threads_per_instance=1, serve_args=SERVE_ARGS,
                           startup_timeout=180, grace_period=10, offload=offload)
        prompt = " ".join(f"t{(7 * i) % 250 + 2}" for i in range(300))
        with LocalCluster(spec) as cluster:
            first = completion(cluster.url, prompt)
            assert first
            (p,), (d,) = cluster.prefill, cluster.decode
            assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}
            assert completion(cluster.url, prompt) == first
            assert metrics(d.url)["kvrelay_kv_load_failures_total"] == 0
            assert wait_for_blocks_freed([p.url, d.url]) == {p.url: 0, d.url: 0}
    finally:
        master.stop()
