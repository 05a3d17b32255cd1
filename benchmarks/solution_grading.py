"""The answer check on human-written solutions: each benchmark solution graded against its own gold answer(s)
(share graded right), and against another problem's gold answer (false passes).

    python benchmarks/solution_grading.py [--out FILE] [--failures] [--near-misses] [--workers 2]
    python benchmarks/solution_grading.py --samples runs/solutions.jsonl && python eval.py --regrade runs/solutions.jsonl --out runs/solutions

MATH500, Minerva and AIME 2024 rows carry a `solution` whose last \\boxed{} is the answer; the grader (grade_many)
grades it as a model's response (Minerva: against every form in `answers`). For the wrong pairs, each solution
meets the gold answer(s) of the next row of its benchmark whose answers differ from its own: neither equal as
strings nor equivalent under the grader's own check of gold against gold (offsets 1, 2, ... up to MAX_OFFSET; a
row without such a partner is left out). The benchmark files are read from REMIX_DATA's benchmarks/ if set, else
the repository's data/benchmarks/. --failures lists every solution that grades wrong, with a hint where the
gold answer is boxed in the problem text itself (a multi-part problem whose gold answers an earlier part).
--near-misses adds a harder probe for false passes: every gold answer of the six benchmark files graded against
the NEAR other gold answers most like it as text; the pairs graded right are listed with --failures.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import remix  # noqa: E402

BENCHMARKS = {"math500": "math500.jsonl", "minerva": "minerva.jsonl", "aime24": "aime24.jsonl"}
MAX_OFFSET = 10  # how far down its benchmark a solution looks for a partner with a different answer
INTEGER = re.compile(r"-?\d+")
NEAR = 4  # --near-misses: how many of the most alike other gold answers each gold answer meets


def grade_many(items: list[tuple[str, list[str]]], workers: int) -> list[tuple]:
    """The answer check over (response, answers) items in worker processes."""
    from machinery import report

    return report.grade_many(remix.METHOD, items, workers)


def grade_any(response: str, answers: list[str]) -> float:
    """The best grade of one response over the accepted answers, in this process."""
    return max(remix.grade_response(response, answer)[0] for answer in answers)


def data_root() -> Path:
    from machinery import report

    return report.data_root()


def load(name: str, root: Path | None = None) -> list[dict]:
    """A benchmark's rows as {id, problem, solution, answers}; answers: Minerva's `answers`, else [`answer`]."""
    path = (root or data_root()) / "benchmarks" / BENCHMARKS[name]
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            answers = row.get("answers") or [row["answer"]]
            rows.append({"id": row["id"], "problem": row["problem"], "solution": row["solution"],
                         "answers": [str(a).strip() for a in answers]})
    return rows


def boxed(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def equivalent(rows: list[dict], pairs: list[tuple[int, int]], workers: int) -> list[bool]:
    """Whether rows i and j have the same answer: a form equal as a string, or the grader taking a gold form of
    one for a response to the other, in either direction (the order matters to math-verify; the second
    direction is asked only where the first says no)."""
    same = [bool(set(rows[i]["answers"]) & set(rows[j]["answers"])) for i, j in pairs]
    settled = [all(INTEGER.fullmatch(a) for a in rows[i]["answers"] + rows[j]["answers"]) for i, j in pairs]
    for k, (i, j) in enumerate(pairs):  # integers alone: equal values or different ones, no grader needed
        if settled[k]:
            same[k] = bool({int(a) for a in rows[i]["answers"]} & {int(a) for a in rows[j]["answers"]})
    for direction in (0, 1):
        items, owner = [], []
        for k, pair in enumerate(pairs):
            if not same[k] and not settled[k]:
                a, b = pair if direction == 0 else pair[::-1]
                items += [(boxed(form), rows[a]["answers"]) for form in rows[b]["answers"]]
                owner += [k] * len(rows[b]["answers"])
        for k, (grade, _status) in zip(owner, grade_many(items, workers)):
            same[k] = same[k] or grade == 1.0
    return same


def wrong_partners(rows: list[dict], workers: int) -> dict[int, int]:
    """row index -> index of the first following row (cyclically) whose answer differs from its own."""
    partner, todo = {}, list(range(len(rows)))
    for offset in range(1, min(MAX_OFFSET, len(rows) - 1) + 1):
        if not todo:
            break
        pairs = [(i, (i + offset) % len(rows)) for i in todo]
        same = equivalent(rows, pairs, workers)
        for (i, j), s in zip(pairs, same):
            if not s:
                partner[i] = j
        todo = [i for (i, _), s in zip(pairs, same) if s]
    return partner


def all_boxed(text: str) -> list[str]:
    """The content of every balanced \\boxed{...} of a text, in order."""
    found, start = [], 0
    while (start := text.find("\\boxed{", start)) >= 0:
        start += len("\\boxed{")
        depth = 1
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                found.append(text[start:end])
                break
    return found


def answered_earlier(row: dict) -> bool:
    """The gold answer is one of the problem text's own boxed answers: the problem restates an earlier
    subproblem with its solution, and the gold answers that part rather than the question asked last."""
    return any(grade_any(boxed(b), row["answers"]) == 1.0 for b in all_boxed(row["problem"]))


def measure(workers: int = 2, root: Path | None = None) -> dict:
    """Per benchmark: n, right, failures [(id, status, predicted box, gold answers)], pairs (how many wrong
    pairs), false [(id, partner id, predicted box, partner's answers)] (wrong pairs graded right)."""
    results = {}
    for name in BENCHMARKS:
        rows = load(name, root)
        grades = grade_many([(r["solution"], r["answers"]) for r in rows], workers)
        failures = [(r["id"], status, remix.final_answer(r["solution"]), r["answers"])
                    for r, (grade, status) in zip(rows, grades) if grade != 1.0]
        partner = wrong_partners(rows, workers)
        order = sorted(partner)
        wrong = grade_many([(rows[i]["solution"], rows[partner[i]]["answers"]) for i in order], workers)
        false = [(rows[i]["id"], rows[partner[i]]["id"], remix.final_answer(rows[i]["solution"]),
                  rows[partner[i]]["answers"]) for i, (grade, _) in zip(order, wrong) if grade == 1.0]
        results[name] = {"n": len(rows), "right": len(rows) - len(failures), "failures": failures,
                         "pairs": len(order), "false": false, "rows": {r["id"]: r for r in rows}}
    return results


def all_gold_answers(root: Path | None = None) -> list[tuple[str, object, list[str]]]:
    """(file, id, answers) of every row of every benchmark file (all six, not only the three with solutions)."""
    found = []
    for path in sorted(((root or data_root()) / "benchmarks").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                raw = row.get("answers") or row.get("answer", row.get("final_answer"))
                answers = [str(a).replace("$", "").strip() for a in (raw if isinstance(raw, list) else [raw])]
                found.append((path.stem, row.get("id"), answers))
    return found


def near_misses(workers: int = 2, root: Path | None = None, k: int = NEAR) -> tuple[int, list]:
    """Each gold answer of the six benchmarks graded against the k other gold answers most like it as text
    (character trigrams; string-equal ones left out), the first form as the response: how many pairs, and those
    graded right. Most of those are the same value written twice; a rewrite rule must add none that is not."""
    rows = all_gold_answers(root)
    grams = [{f" {r[2][0]} "[i:i + 3] for i in range(len(r[2][0]))} for r in rows]
    pairs = set()
    for i, mine in enumerate(grams):
        alike = sorted(((len(mine & other) / len(mine | other), j) for j, other in enumerate(grams)
                        if j != i and mine & other and not set(rows[i][2]) & set(rows[j][2])), reverse=True)
        pairs.update((i, j) for _, j in alike[:k])
    pairs = sorted(pairs)
    grades = grade_many([(boxed(rows[j][2][0]), rows[i][2]) for i, j in pairs], workers)
    right = [(rows[i][:2], rows[i][2], rows[j][:2], rows[j][2][0]) for (i, j), (g, _) in zip(pairs, grades) if g == 1.0]
    return len(pairs), right


def table(results: dict) -> str:
    lines = ["| benchmark | solutions graded right | % | wrong pairs graded right (false passes) |",
             "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['right']} of {r['n']} | {100 * r['right'] / r['n']:.1f} | "
                     f"{len(r['false'])} of {r['pairs']} |")
    n, right = sum(r["n"] for r in results.values()), sum(r["right"] for r in results.values())
    pairs, false = sum(r["pairs"] for r in results.values()), sum(len(r["false"]) for r in results.values())
    lines.append(f"| all | {right} of {n} | {100 * right / n:.1f} | {false} of {pairs} |")
    return "\n".join(lines) + "\n"


def failure_list(results: dict) -> str:
    lines = ["| benchmark | id | status | last box | gold | hint |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        for row_id, status, box, answers in r["failures"]:
            hint = "gold is boxed in the problem text" if answered_earlier(r["rows"][row_id]) else ""
            shown = box if box is None or len(box) < 60 else box[:57] + "..."
            lines.append(f"| {name} | {row_id} | {status} | `{shown}` | `{' / '.join(answers)}` | {hint} |")
    for name, r in results.items():
        for row_id, other, box, answers in r["false"]:
            lines.append(f"| {name} | {row_id} | FALSE PASS against {other} | `{box}` | `{' / '.join(answers)}` | |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table (and the failure list, with --failures) here")
    parser.add_argument("--failures", action="store_true", help="list every solution graded wrong")
    parser.add_argument("--near-misses", action="store_true",
                        help="also grade each gold answer of all six benchmarks against the most alike others")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", help="only write the solutions as eval.py sample records here, for "
                                          "eval.py --regrade (both graders, and where they disagree)")
    cli = parser.parse_args()
    if cli.samples:
        records = [{"benchmark": name, "id": row["id"], "answers": row["answers"], "response": row["solution"],
                    "response_tokens": 0} for name in BENCHMARKS for row in load(name)]
        Path(cli.samples).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.samples).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        print(f"{len(records)} solutions written to {cli.samples}")
        return
    results = measure(cli.workers)
    text = table(results) + ("\n" + failure_list(results) if cli.failures else "")
    if cli.near_misses:
        n, right = near_misses(cli.workers)
        text += f"\nnear misses: {len(right)} of {n} pairs of alike gold answers graded right\n"
        if cli.failures:
            text += "".join(f"- {a[0]} {a[1]} `{' / '.join(ga)}` <- {b[0]} {b[1]} `{gb}`\n" for a, ga, b, gb in right)
    print(text, end="")
    if cli.out:
        Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
