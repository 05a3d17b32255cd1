"""Grading throughput of machinery.report.grade_many on the 1,600 gold answers of the six benchmark files.

    python benchmarks/grading.py [--data-dir DIR: default the repository's data/benchmarks, or REMIX_DATA's]

One response per problem that reasons a little and ends in \\boxed{GOLD}, graded with 1 and with 2
worker processes, alternating over rounds in one run so that machine noise hits both alike. The pool is
started before timing (its start-up, about 2 s, is paid once per run).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import remix  # noqa: E402
from machinery import grader, report  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None,
                        help="folder of the benchmark files (default: the repository's data/benchmarks; REMIX_DATA "
                             "overrides)")
    parser.add_argument("--rounds", type=int, default=3)
    cli = parser.parse_args()
    problems = [p for name in report.BENCHMARKS
                for p in report.read_benchmark(name, cli.data_dir, None)[0]]
    items = [(f"Let me check. The answer is \\boxed{{{p['answers'][0]}}}.", p["answers"]) for p in problems]
    rates = {1: [], 2: []}
    for _ in range(cli.rounds):
        for workers in (1, 2):
            report.grade_many(remix.METHOD, items[:4], workers=workers)  # start the pool outside the timing
            start = time.perf_counter()
            grades = report.grade_many(remix.METHOD, items, workers=workers)
            rates[workers].append(len(items) / (time.perf_counter() - start))
            grader.close_pool()  # the next round starts its own pool
    right = sum(g[0] == 1.0 for g in grades)
    print(f"{len(items)} gold-answer responses, {right} graded right, {cli.rounds} rounds\n")
    print("| workers | median answers/s |\n|---|---|")
    for workers, values in rates.items():
        print(f"| {workers} | {statistics.median(values):.0f} |")
    print(f"\n2 workers / 1 worker: {statistics.median(rates[2]) / statistics.median(rates[1]):.2f}")


if __name__ == "__main__":
    main()
