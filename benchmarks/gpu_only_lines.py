"""The lines of remix.py and remix_utils.py that no test executes on this CPU (README: GPU-only code).

    python benchmarks/gpu_only_lines.py [pytest arguments]

Runs the test suite under coverage, following every subprocess (torchrun ranks, CLI runs, grader workers) and
saving each one's data before os._exit (coverage's `patch = subprocess, _exit`: torchrun ranks end with
os._exit, which would otherwise skip the save and count lines they ran as missed), then prints each missed
line with its source. The README's table explains each one.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("remix.py", "remix_utils.py")


def main():
    work = Path(tempfile.mkdtemp(prefix="remix-coverage-"))
    rc = work / "coveragerc"
    rc.write_text(f"[run]\nparallel = true\nbranch = false\ndata_file = {work / '.coverage'}\n"
                  f"source = {ROOT}\npatch =\n    subprocess\n    _exit\n")
    subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-p",
                    "no:cacheprovider", *sys.argv[1:]], cwd=ROOT)
    subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=ROOT, check=True)
    report = subprocess.run([sys.executable, "-m", "coverage", "json", f"--rcfile={rc}", "-q", "-o",
                             str(work / "coverage.json"), "--include", ",".join(str(ROOT / f) for f in FILES)],
                            cwd=ROOT, check=True)
    assert report.returncode == 0
    import json

    data = json.loads((work / "coverage.json").read_text())["files"]
    total = 0
    for name in FILES:
        entry = next(v for k, v in data.items() if Path(k).name == name)
        lines = (ROOT / name).read_text().splitlines()
        missed = entry["missing_lines"]
        total += len(missed)
        print(f"\n{name}: {len(missed)} lines never executed")
        for number in missed:
            print(f"  {number:4d}  {lines[number - 1].strip()}")
    print(f"\n{total} lines in all")


if __name__ == "__main__":
    main()
