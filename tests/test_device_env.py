"""The wheels carried to the lent GPU machine, with the packages of its image, satisfy every import
of kvrelay, the benchmarks and the test files the device check runs (benchmarks/device_env.py).

Found by what really loads: every module imported here in a child process (and every third-party
module their source imports inside a function), mapped to its distribution; then pip's resolver,
offline, may use only the carried wheels' metadata (scripts/device_wheels.txt) and the image's
list (scripts/device_image.txt), a version that list does not give counting as 0. A device check
whose `kvrelay serve` died at import (fastapi needs opentelemetry-api, carried by nobody) is what
this catches before a device is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_env  # noqa: E402

TRANSFER_ONLY = {"nixl", "nixl-cu13"}  # not installed here (.venv has nixl-cu12); call 3 loads them


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_env.py"), "imports"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def carried() -> dict[str, str]:
    """The carried wheels' metadata: from .whl/ where `gpu_check.sh --wheels` made it, else as
    installed here (test_each_carried_wheel_is_the_version_the_tests_run_on_here)."""
    wheels = ROOT / ".whl"
    metadata, missing = device_env.carried_metadata(device_env.read_pins(device_env.WHEELS_FILE),
                                                    wheels if wheels.is_dir() else None)
    assert set(missing) <= TRANSFER_ONLY, f"no metadata for the carried {missing}"
    return metadata


def test_every_import_of_the_checked_paths_resolves_from_the_carried_wheels_and_the_image(
        imported: dict[str, list[str]], carried: dict[str, str]) -> None:
    for must in ("fastapi", "uvicorn", "torch", "triton", "transformers", "openai"):  # serve, bench, checks
        assert must in imported["distributions"]
    assert imported["unowned"] == []
    image = device_env.read_pins(device_env.IMAGE_FILE)
    for failure in imported["failures"]:  # only what this machine lacks and the image has
        assert failure.split(":")[0] in image, failure
    ok, detail = device_env.resolve(imported["distributions"], image, carried)
    assert ok, detail
    assert "opentelemetry-api==1.45.3 (carried)" in detail and "torch==2.11.0 (image)" in detail


@pytest.mark.parametrize(("dropped", "named"), [
    ("opentelemetry-api", "opentelemetry-api"),  # fastapi imports it; the image lacks it
    ("anyio", "anyio>="),  # the image has anyio, at a version its list does not give
])
def test_without_a_needed_wheel_the_resolver_names_what_is_missing(
        imported: dict[str, list[str]], carried: dict[str, str], dropped: str, named: str) -> None:
    fewer = {name: meta for name, meta in carried.items() if name != dropped}
    image = device_env.read_pins(device_env.IMAGE_FILE)
    ok, detail = device_env.resolve(imported["distributions"], image, fewer)
    assert not ok and named in detail, detail


def test_each_carried_wheel_is_the_version_the_tests_run_on_here() -> None:
    import importlib.metadata as md

    for name, version in device_env.read_pins(device_env.WHEELS_FILE).items():
        assert version is not None, f"{name} is carried unpinned"
        if name not in TRANSFER_ONLY:
            assert md.version(name) == version, f"{name}: {md.version(name)} here, {version} carried"


def test_the_image_list_says_where_it_came_from_and_gives_the_versions_it_knows() -> None:
    text = device_env.IMAGE_FILE.read_text()
    assert "/work/.library/device/KINDS.md" in text and "2026-11-17" in text
    image = device_env.read_pins(device_env.IMAGE_FILE)
    assert len(image) > 150
    assert image["torch"] == "2.11.0" and image["triton"] == "3.6.0" and image["transformers"] == "5.17.0"
    assert image["typing-extensions"] is None  # listed, version not given


def test_requirements_are_read_for_the_device_s_python_and_platform() -> None:
    metadata = "\n".join(["Name: demo", "Requires-Dist: a>=1", "Requires-Dist: b; python_version < '3.12'",
                          "Requires-Dist: c; sys_platform == 'win32'", "Requires-Dist: d; extra == 'x'",
                          "Requires-Dist: E_f<2; python_version >= '3.12'"])
    assert device_env.device_requirements(metadata) == ["a>=1", "e-f<2"]


def test_every_test_file_the_device_check_names_exists() -> None:
    for group, specs in device_env.TEST_GROUPS.items():
        for spec in specs:
            path, _, node = spec.partition("::")
            assert (ROOT / path).exists(), f"{group}: {path}"
            assert not node or f"def {node}(" in (ROOT / path).read_text(), f"{group}: {spec}"
