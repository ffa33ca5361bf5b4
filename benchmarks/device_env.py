"""The lent GPU machine's Python, as the device check needs it: the image's packages
(scripts/device_image.txt) and the wheels carried to it (scripts/device_wheels.txt, unpacked into
/tmp/site ahead of the image's) must provide every distribution kvrelay, the benchmarks and the
test files the check runs import, and meet every requirement of the carried wheels.

    python benchmarks/device_env.py imports          # import all of it here; the distributions (JSON)
    python benchmarks/device_env.py resolve [DIR]    # pip's resolver, offline: the carried wheels (in
                                                     # DIR, else as installed here) on the image's list
    python benchmarks/device_env.py check            # on the device: the imports, then each carried
                                                     # wheel's requirements against what is installed
    python benchmarks/device_env.py tests GROUP      # the test files of one part of the device check

What is imported: every kvrelay module, the benchmark scripts and test files the device check runs,
and every third-party module any of them imports inside a function (found in their source), less
the optional backends named in OPTIONAL. A version the image's list does not give cannot be relied
on for a requirement's bound: such a package resolves as version 0 (so a bound on it fails here)
unless carried. The check on the device reads the real versions.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE_FILE = ROOT / "scripts" / "device_image.txt"
WHEELS_FILE = ROOT / "scripts" / "device_wheels.txt"
DEVICE_PYTHON = "3.12"  # the image's (python 3.12.3)

_ENGINE_GPU = "tests/gpu/test_engine_gpu.py"
# The test files each part of scripts/gpu_check.sh runs (pytest node ids allowed).
TEST_GROUPS: dict[str, list[str]] = {
    "kernels": ["tests/kernels/triton", "tests/attention/test_backends.py",
                "tests/attention/test_triton_variants.py", "tests/attention/test_invariant_backends.py"],
    "smoke": [f"{_ENGINE_GPU}::test_float32_greedy_tokens_equal_transformers_on_the_same_weights",
              f"{_ENGINE_GPU}::test_cuda_graph_tokens_are_identical_to_eager_tokens_in_bf16"],
    "gpu": [_ENGINE_GPU, "tests/gpu/test_pd_gpu.py", "tests/gpu/test_serve_gpu.py"],
    "invariance": ["tests/gpu/test_batch_invariance_gpu.py"],
    "transfer": ["tests/kv_transfer/transport/test_cuda_ipc.py",
                 "tests/kv_transfer/transport/test_staging.py",
                 "tests/kv_transfer/offload/test_offload_gpu.py"],
}
BENCH_SCRIPTS = ["bench_gpu", "gpu_serve_check", "bench_transfer", "offload_gpu"]
# Imported only where a user asks for them, never on the device check's paths.
OPTIONAL = {
    "redis": "the offload tier's redis:// client",
    "mooncake": "the Mooncake transport and store (not in the device's image; no RDMA there)",
    "nixl": "carried as nixl-cu13 for the transfer call, which loads it there (scripts/ucx_diag.sh)",
    "nixl_cu12": "NIXL's CUDA 12 build; the device has CUDA 13",
    "vllm": "bench_offline's vLLM column; kvrelay.integrations.vllm runs inside a vLLM server",
    "matplotlib": "the planner's --plot FILE.png (SVG needs nothing)",
}


# Requirements of a carried wheel the device does without, and why.
UNNEEDED = {("nixl", "nixl-cu12"): "NIXL's meta package loads the build for torch's CUDA at run time"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str | None]:
    """`name==version` or bare `name` lines (# comments) -> {normalized name: version or None}."""
    pins: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip() or None
    return pins


def test_files(group: str) -> list[str]:
    if group not in TEST_GROUPS:
        raise SystemExit(f"unknown test group {group!r}; known: {', '.join(TEST_GROUPS)}")
    return TEST_GROUPS[group]


# ----------------------------------------------------------------------------- imports
def checked_modules() -> list[str]:
    """Every kvrelay module, the benchmark scripts and the test modules of every group."""
    import kvrelay

    modules = [m.name for m in pkgutil.walk_packages(kvrelay.__path__, "kvrelay.")]
    tests = {spec.split("::")[0] for files in TEST_GROUPS.values() for spec in files}
    for spec in sorted(tests):
        path = ROOT / spec
        files = sorted(path.glob("test_*.py")) if path.is_dir() else [path]
        modules += [".".join(f.relative_to(ROOT).with_suffix("").parts) for f in files]
    return ["kvrelay"] + modules + BENCH_SCRIPTS


def source_imports(modules: list[str]) -> set[str]:
    """Top-level names of the third-party modules imported anywhere in these modules' source
    (inside functions too)."""
    names: set[str] = set()
    for name in modules:
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if origin is None or not origin.endswith(".py") or not os.path.isabs(origin):
            continue
        for node in ast.walk(ast.parse(Path(origin).read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and not is_local(n) and n not in OPTIONAL}


def is_local(top_name: str) -> bool:
    """A module of this repository (kvrelay, tests, a benchmark script)."""
    if top_name in ("kvrelay", "tests", "benchmarks"):
        return True
    module = sys.modules.get(top_name)
    if module is not None:
        origin = getattr(module, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(top_name)
        except (ImportError, ValueError):
            return False
        origin = None if spec is None else spec.origin
    if origin is None or not os.path.isabs(origin):
        return False
    path = Path(origin).resolve()
    # a virtual environment inside the checkout (CI's .venv) holds third-party code, not ours
    return path.is_relative_to(ROOT) and "site-packages" not in path.parts


def import_everything() -> tuple[list[str], list[str]]:
    """Import the checked modules, then every third-party module the repository's loaded modules
    import anywhere in their source. Returns (the failures, as "module: error", the third-party
    top-level names that failed)."""
    failures, missing = [], []
    for name in checked_modules():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:  # e.g. the vLLM plugin needs vllm
                failures.append(f"{name}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is reported, with its module
            failures.append(f"{name}: {type(e).__name__}: {e}")
    local = [name for name in list(sys.modules) if is_local(name.split(".")[0])]
    for name in sorted(source_imports(local)):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name}: {type(e).__name__}: {e}")
            missing.append(name)
    return failures, missing


def imported_distributions(missing: list[str]) -> tuple[list[str], list[str]]:
    """(the distributions of every loaded third-party module, loaded modules no distribution
    owns), after `import_everything`; a module that did not import here (`missing`) counts as
    the distribution of its name."""
    import importlib.metadata as md

    owners = md.packages_distributions()
    found, unowned = {normalize(name) for name in missing}, set()
    for name in {m.split(".")[0] for m in list(sys.modules)}:
        if name in sys.stdlib_module_names or name.startswith("_") or is_local(name):
            continue
        if name in owners:
            found.update(normalize(d) for d in owners[name])
        elif getattr(sys.modules.get(name), "__file__", None):
            unowned.add(name)
    return sorted(found), sorted(unowned)


# ----------------------------------------------------------------------------- resolve, offline
def device_requirements(metadata: str) -> list[str]:
    """A METADATA's Requires-Dist that apply on the device (its python, Linux x86-64, no extra;
    UNNEEDED left out), markers evaluated and dropped."""
    from packaging.requirements import Requirement

    env = {"python_version": DEVICE_PYTHON, "python_full_version": f"{DEVICE_PYTHON}.3", "os_name": "posix",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    names = [line.split(":", 1)[1] for line in metadata.splitlines() if line.startswith("Name:")]
    owner = normalize(names[0].strip()) if names else ""
    kept = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if (owner, normalize(req.name)) in UNNEEDED:
                continue
            if req.marker is None or req.marker.evaluate(env):
                kept.append(f"{normalize(req.name)}{req.specifier}")
    return kept


def carried_metadata(pins: dict[str, str | None],
                     wheels_dir: Path | None) -> tuple[dict[str, str], list[str]]:
    """{name: METADATA} of each carried wheel, from its file in `wheels_dir` or, at the pinned
    version, from this environment; and the pins neither has."""
    import importlib.metadata as md

    files = {}
    for path in sorted(wheels_dir.glob("*.whl")) if wheels_dir else []:
        files[normalize(path.name.split("-")[0])] = path
    found, missing = {}, []
    for name, version in pins.items():
        if name in files:
            with zipfile.ZipFile(files[name]) as whl:
                member = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
                found[name] = whl.read(member).decode()
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        if version is not None and dist.version != version:
            missing.append(f"{name} ({dist.version} here, {version} pinned)")
            continue
        found[name] = dist.read_text("METADATA") or ""
    return found, missing


def write_wheel(directory: Path, name: str, version: str, requires: list[str]) -> None:
    """A metadata-only wheel: all pip's resolver reads of a distribution."""
    stem = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    wheel = ["Wheel-Version: 1.0", "Generator: device_env", "Root-Is-Purelib: true", "Tag: py3-none-any"]
    with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{stem}.dist-info/METADATA", "\n".join(lines) + "\n")
        whl.writestr(f"{stem}.dist-info/WHEEL", "\n".join(wheel) + "\n")
        whl.writestr(f"{stem}.dist-info/RECORD", "")


def resolve(distributions: list[str], image: dict[str, str | None],
            carried: dict[str, str]) -> tuple[bool, str]:
    """pip's resolver, offline, asked for `distributions`: the carried wheels' metadata and the
    image's packages (version 0 where the list gives none; pinned where it does) are all it may
    use. Returns (resolved, pip's report of what it would take, or its error)."""
    with tempfile.TemporaryDirectory() as tmp:
        links = Path(tmp) / "links"
        links.mkdir()
        for name, metadata in carried.items():
            found = re.search(r"^Version: (\S+)", metadata, re.M)
            write_wheel(links, name, found.group(1) if found else "0", device_requirements(metadata))
        image_only = {n: v for n, v in image.items() if n not in carried}
        for name, version in image_only.items():
            write_wheel(links, name, version or "0", [])
        constraints = Path(tmp) / "image.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in image_only.items() if v))
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
               "--disable-pip-version-check", "--find-links", str(links), "-c", str(constraints),
               "--report", str(report), *distributions]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env | {"PIP_CONFIG_FILE": os.devnull})
        if done.returncode != 0:  # pip says why on stdout ("The conflict is caused by: ...")
            noise = ("Looking in", "Processing")
            said = [line for line in done.stdout.splitlines() if not line.startswith(noise)]
            return False, "\n".join(said + done.stderr.splitlines()).strip()
        taken = json.loads(report.read_text())["install"]
    lines = [origin(item["metadata"]["name"], item["metadata"]["version"], carried) for item in taken]
    return True, "\n".join(sorted(lines))


def origin(name: str, version: str, carried: dict[str, str]) -> str:
    if normalize(name) in carried:
        return f"{name}=={version} (carried)"
    return f"{name} (image, version not listed)" if version == "0" else f"{name}=={version} (image)"


# ----------------------------------------------------------------------------- on the device
def check_installed(pins: dict[str, str | None]) -> list[str]:
    """Each carried wheel installed at its pin, and its device requirements met by the versions
    installed here (the image's and the carried ones): the problems."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    problems = []
    for name, version in pins.items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        if version and dist.version != version:
            problems.append(f"{name}: {dist.version} installed, {version} carried")
        for text in device_requirements(dist.read_text("METADATA") or ""):
            req = Requirement(text)
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} needs {text}: not installed")
                continue
            if have not in req.specifier:
                problems.append(f"{name} needs {text}: {have} installed")
    return problems


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "imports"
    if command == "tests":
        print("\n".join(test_files(argv[1] if len(argv) > 1 else "")))
        return 0
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    failures, missing = import_everything()
    distributions, unowned = imported_distributions(missing)
    if command == "imports":  # here, some packages of the image may be missing: not a failure
        print(json.dumps({"distributions": distributions, "unowned": unowned, "failures": failures}))
        return 0 if len(failures) == len(missing) else 1
    pins = read_pins(WHEELS_FILE)
    if command == "resolve":
        carried, no_metadata = carried_metadata(pins, Path(argv[1]) if len(argv) > 1 else None)
        ok, detail = resolve(distributions, read_pins(IMAGE_FILE), carried)
        print(detail + (f"\nno metadata here for: {', '.join(no_metadata)}" if no_metadata else ""))
        return 0 if ok else 1
    if command != "check":
        raise SystemExit(f"unknown command {command!r}: imports, resolve, check or tests")
    problems = failures + check_installed(pins)
    print("\n".join(problems) or f"{len(distributions)} distributions imported; carried wheels' needs met")
    print(f"imports: {'FAIL' if problems else 'PASS'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
