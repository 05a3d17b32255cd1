"""The wheels to carry to the lent GPU machine: what requirements.txt needs beyond that machine's own packages
(benchmarks/device_packages.txt), with every dependency of theirs, for its Python (3.12, x86-64 Linux).

    python benchmarks/device_wheels.py .whl            # download into .whl (ignored by git), then check the folder
    python benchmarks/device_wheels.py .whl --check    # check a folder only

On that machine: `pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl` and
`export PYTHONPATH=/tmp/site` (the grader's workers inherit it). The check: one version of each package, every
requirement of requirements.txt and every dependency of a carried wheel (its markers read for that machine, extras
left out) met by the folder or the machine, and the folder within LIMIT_MIB (a call carries 64 MiB in all, the
working tree included). vLLM is no part of it (the GPU check uses transformers' generate where vLLM is missing).
"""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any"]
ENVIRONMENT = {"python_version": PYTHON, "python_full_version": PYTHON + ".3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
LIMIT_MIB = 48


def device_packages() -> set[str]:
    lines = (ROOT / "benchmarks" / "device_packages.txt").read_text().splitlines()
    return {canonicalize_name(line) for line in lines if line.strip() and not line.startswith("#")}


def requirements() -> list[Requirement]:
    rows = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    return [Requirement(row) for row in rows if row and not row.startswith("-")]


def wheel_name(path: Path) -> tuple[str, Version]:
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), Version(version)


def dependencies(path: Path) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the device (no extras)."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = archive.read(metadata).decode()
    found = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in found if r.marker is None or Marker(str(r.marker)).evaluate(ENVIRONMENT)]


def download(requirement: Requirement, folder: Path):
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(folder),
                           f"{requirement.name}{requirement.specifier}"], capture_output=True, text=True)
    if done.returncode != 0:  # a source release only (pylatexenc): built here, where it is pure Python
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder),
                               f"{requirement.name}{requirement.specifier}"], capture_output=True, text=True)
        built = [p for p in folder.glob("*.whl") if wheel_name(p)[0] == canonicalize_name(requirement.name)]
        if done.returncode != 0 or not all(p.name.endswith("-py3-none-any.whl") for p in built):
            sys.exit(f"device_wheels: no wheel of {requirement} for Python {PYTHON}: {done.stderr.strip()[-500:]}")


def fill(folder: Path):
    """Download what is missing, then what those wheels need, until nothing is."""
    folder.mkdir(parents=True, exist_ok=True)
    device = device_packages()
    while True:
        have = {wheel_name(p)[0] for p in folder.glob("*.whl")}
        wanted = requirements() + [d for p in folder.glob("*.whl") for d in dependencies(p)]
        missing = {canonicalize_name(r.name): r for r in wanted if canonicalize_name(r.name) not in device | have}
        missing.pop("vllm", None)
        if not missing:
            return
        for requirement in missing.values():
            print(f"device_wheels: downloading {requirement}", flush=True)
            download(requirement, folder)


def check(folder: Path) -> list[str]:
    """What is wrong with the folder: nothing, or one line per problem."""
    device, problems = device_packages(), []
    wheels = sorted(folder.glob("*.whl"))
    names = [wheel_name(p) for p in wheels]
    carried = dict(names)
    for name in {n for n, _ in names if [m for m, _ in names].count(n) > 1}:
        problems.append(f"two versions of {name}: keep one (pip stops the whole install on two)")
    needs = [(r, "requirements.txt") for r in requirements()] + \
        [(d, p.name) for p in wheels for d in dependencies(p)]
    for requirement, by in needs:
        name = canonicalize_name(requirement.name)
        if name in device or name == "vllm":
            continue
        if name not in carried:
            problems.append(f"{requirement} (needed by {by}) is neither carried nor on the device")
        elif not requirement.specifier.contains(carried[name], prereleases=True):
            problems.append(f"{name} {carried[name]} does not meet {requirement} (needed by {by})")
    size = sum(p.stat().st_size for p in wheels) / 2**20
    if size > LIMIT_MIB:
        problems.append(f"the wheels take {size:.1f} MiB, over {LIMIT_MIB} MiB")
    for path in wheels:
        print(f"device_wheels: {path.name}  {path.stat().st_size / 2**20:.2f} MiB")
    print(f"device_wheels: {len(wheels)} wheels, {size:.2f} MiB")
    return problems


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit("usage: python benchmarks/device_wheels.py DIR [--check]")
    folder = Path(args[0])
    if "--check" not in sys.argv:
        fill(folder)
    problems = check(folder)
    for line in problems:
        print(f"device_wheels: {line}", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
