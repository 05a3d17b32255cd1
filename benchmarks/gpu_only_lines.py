"""The lines of remix.py and machinery/*.py that no test executes on this CPU (docs/tests.md: Code no CPU test runs).

    python benchmarks/gpu_only_lines.py [pytest arguments]     # the whole suite: about 30 minutes
    python benchmarks/gpu_only_lines.py -k NAME                 # a narrowed run, to try the script itself

Runs the test suite under coverage, following every subprocess (torchrun ranks, CLI runs, grader workers) and
saving each one's data before os._exit (coverage's `patch = subprocess, _exit`: torchrun ranks end with
os._exit, which would otherwise skip the save and count lines they ran as missed), then prints each missed
line with its source. docs/tests.md's table explains each one.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measured_files() -> list[str]:
    """remix.py and every module of the machinery/ package, as paths relative to the repository."""
    return ["remix.py"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "machinery").glob("*.py"))


def main():
    files = measured_files()
    work = Path(tempfile.mkdtemp(prefix="remix-coverage-"))
    rc = work / "coveragerc"
    rc.write_text(f"[run]\nparallel = true\nbranch = false\ndata_file = {work / '.coverage'}\n"
                  f"source = {ROOT}\npatch =\n    subprocess\n    _exit\n")
    subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-p",
                    "no:cacheprovider", *sys.argv[1:]], cwd=ROOT)
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=ROOT, check=True)
    subprocess.run([sys.executable, "-m", "coverage", "json", f"--rcfile={rc}", "-q", "-o", str(work / "coverage.json"),
                    "--include", ",".join(str(ROOT / f) for f in files)], cwd=ROOT, check=True)
    data = {str(Path(k).resolve().relative_to(ROOT)) if Path(k).is_absolute() else k: v
            for k, v in json.loads((work / "coverage.json").read_text())["files"].items()}
    total = 0
    for name in files:
        entry = data.get(name)
        if entry is None:  # never imported by the tests that ran: coverage has no statements for it
            print(f"\n{name}: not measured (no test that ran imported it)")
            continue
        lines = (ROOT / name).read_text().splitlines()
        missed = entry["missing_lines"]
        total += len(missed)
        print(f"\n{name}: {len(missed)} lines never executed")
        for number in missed:
            print(f"  {number:4d}  {lines[number - 1].strip()}")
    print(f"\n{total} lines in all")


if __name__ == "__main__":
    main()
