"""Nothing is written outside --out: every write of remix.py, eval.py and machinery goes through runfolder's
primitives (a static walk of their syntax trees finds any other), and a symbolic link planted at any path a run, a
resume, an evaluation, a regrade or --curves writes (found from a listing of what a real one wrote, so a new file is
covered) is refused in one line or replaced, its target untouched.

    pytest -q tests/test_links.py                # the static walk; a resume's top level, eval, regrade, curves
    pytest -q tests/test_links.py -m long        # every path a resume writes, and a new run
"""

import ast
import os
import shutil
import types
from pathlib import Path

import pytest

from tests.common import ROOT, run_remix, tiny_cli

# ----------------------------------------------------------------------------------------------
# The static walk: no raw write outside machinery/runfolder.py
# ----------------------------------------------------------------------------------------------
# What creates, changes or deletes a file: module functions by module, and methods whose names say so on anything
WRITERS = {"os": {"makedirs", "mkdir", "replace", "rename", "renames", "remove", "unlink", "rmdir", "symlink", "link",
                  "truncate", "mkfifo"},
           "shutil": {"rmtree", "copy", "copy2", "copyfile", "copytree", "move"},
           "tempfile": {"mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory"},
           "torch": {"save"}, "wandb": {"init"}}
ANY_WRITERS = {"mkdir", "makedirs", "unlink", "rmtree", "write_text", "write_bytes", "touch", "rename", "symlink_to",
               "save_pretrained", "SummaryWriter", "savefig", "mkdtemp", "hardlink_to"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}
# Calls the walk finds that write nothing under --out, each with why (file, enclosing function, call name):
ALLOWED = {
    ("machinery/dist.py", "clear_cpu_shm", "os.remove"),  # vLLM's shared-memory files in /dev/shm, never in --out
    ("machinery/checkpoints.py", "write_model", "model.save_pretrained"),  # into .tmp-checkpoint-STEP, just made
    ("machinery/checkpoints.py", "write_model", "tokenizer.save_pretrained"),  # the same folder
    ("machinery/checkpoints.py", "write_rank_files", "torch.save"),  # into a file runfolder.open_file opened (twice)
    ("machinery/logs.py", "__init__", "SummaryWriter"),  # OUT/tb, made and checked for links by check_tree first
    ("machinery/logs.py", "__init__", "wandb.init"),  # wandb.init(dir=OUT): OUT/wandb checked by check_tree first
    ("machinery/curves.py", "save", "fig.savefig"),  # into a file object runfolder.open_file opened
}
PROGRAMS = ["remix.py", "eval.py", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "machinery").glob("*.py"))]


def raw_writes(path: str) -> list[tuple[str, str, str, int]]:
    """(file, enclosing function, call, line) of every call in a file that can create, change or delete a file."""
    tree, found = ast.parse((ROOT / path).read_text()), []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                name = child.func.attr if isinstance(child.func, ast.Attribute) else getattr(child.func, "id", "")
                receiver = ast.unparse(child.func.value) if isinstance(child.func, ast.Attribute) else ""
                if name == "open" and receiver in ("", "io", "builtins"):  # open(path, mode)
                    mode = child.args[1] if len(child.args) > 1 else next(
                        (k.value for k in child.keywords if k.arg == "mode"), None)
                    text = mode.value if isinstance(mode, ast.Constant) else ("?" if mode is not None else "r")
                    if set(str(text)) & set("wax+?"):
                        found.append((path, function, "open", child.lineno))
                elif name == "open" and receiver == "os":
                    flags = {n.attr for n in ast.walk(child) if isinstance(n, ast.Attribute)}
                    if flags & WRITE_FLAGS:
                        found.append((path, function, "os.open", child.lineno))
                elif receiver != "runfolder" and (name in WRITERS.get(receiver, ()) or name in ANY_WRITERS):
                    found.append((path, function, f"{receiver}.{name}" if receiver else name, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_the_walk_finds_each_kind_of_raw_write(tmp_path):
    """The walk itself, on a file with one raw write of each kind (a planted bug it must catch)."""
    planted = ROOT / "machinery" / "_planted_writes_for_test.py"
    planted.write_text("import os, shutil, torch\nfrom pathlib import Path\n"
                       "def f(p, m):\n    open(p, 'w')\n    open(p, mode='ab')\n    open(p, m)\n"
                       "    os.open(p, os.O_WRONLY | os.O_CREAT)\n    os.makedirs(p)\n    os.replace(p, p)\n"
                       "    shutil.rmtree(p)\n    Path(p).write_text('x')\n    torch.save({}, p)\n"
                       "    open(p)\n    os.open(p, os.O_RDONLY)\n")
    try:
        calls = [c for _, _, c, _ in raw_writes(str(planted.relative_to(ROOT)))]
    finally:
        planted.unlink()
    assert calls == ["open", "open", "open", "os.open", "os.makedirs", "os.replace", "shutil.rmtree", "Path(p).write_text",
                     "torch.save"]


def test_every_write_of_the_programs_goes_through_runfolder():
    found = [w for path in PROGRAMS if path != "machinery/runfolder.py" for w in raw_writes(path)
             if w[:3] not in ALLOWED]
    assert not found, "raw writes outside machinery/runfolder.py (use its primitives): " + ", ".join(
        f"{p}:{line} {call} in {fn}" for p, fn, call, line in found)


# ----------------------------------------------------------------------------------------------
# The dynamic check: a link planted at each written path
# ----------------------------------------------------------------------------------------------
def listing(folder: Path) -> list[str]:
    """Every file and folder under folder, relative, parents first."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def outside_state(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def out_state(out: Path) -> dict:
    """Every entry under out but the lock (which names the job that last held it), links as links: a link's target,
    a file's bytes, a folder's None."""
    def state(p: Path):
        return ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else None

    return {str(p.relative_to(out)): state(p) for p in out.rglob("*") if p.name != ".remix.lock"}


def plant(out: Path, path: str, outside: Path, kind_of: Path, kind: str = "link") -> Path:
    """kind "link": a link at out/path to a new file (or folder, where the baseline had one) outside out, in place of
    what is there; "swapped": a plain file where the baseline had a folder, a folder where it had a file (nothing
    outside). The folders above it are made real ones."""
    target = outside / path.replace(os.sep, "__")
    if kind == "swapped":
        pass
    elif (kind_of / path).is_dir():
        target.mkdir(parents=True)
        (target / "mine.txt").write_text("not the run's")
    else:
        target.write_text("not the run's\n")
    place = out / path
    if place.is_dir() and not place.is_symlink():
        shutil.rmtree(place)
    elif place.exists() or place.is_symlink():
        place.unlink()
    place.parent.mkdir(parents=True, exist_ok=True)
    if kind == "swapped" and (kind_of / path).is_dir():
        place.write_text("a file where the run had a folder\n")
    elif kind == "swapped":
        (place / "inside").mkdir(parents=True)
    else:
        place.symlink_to(target, target_is_directory=target.is_dir())
    return target


def antichains(paths: list[str]) -> list[list[str]]:
    """The paths grouped by depth: no path of a group lies inside another of it, so all can be links at once."""
    groups = {}
    for path in paths:
        groups.setdefault(path.count(os.sep), []).append(path)
    return [groups[d] for d in sorted(groups)]


def check_planted(paths: list[str], start, fresh, baseline: Path, tmp: Path, prog: str, kind: str = "link") -> dict:
    """Links (or, kind "swapped", a file where a folder was and a folder where a file was: plant) at all of paths at
    once, in a fresh copy (fresh(folder) makes it); start(folder) runs the job. A run refused in one line must name a
    planted path, and leave the folder as it found it but its lock (refused before anything is written: a resume
    before its step 1); that path is recorded as refused and the job runs again without it. When the job ends with
    exit 0, every remaining link was replaced by a real file or left alone. In every run, no target outside changes.
    Returns {path: 'refused' | 'replaced' | 'left'}."""
    outcome, todo, attempt = {}, list(paths), 0
    while todo:
        attempt += 1
        out, outside = tmp / f"try{attempt}" / "out", tmp / f"try{attempt}" / "outside"
        outside.mkdir(parents=True)
        fresh(out)
        targets = {path: plant(out, path, outside, baseline, kind) for path in todo}
        before, found = outside_state(outside), out_state(out)
        done = start(out)
        assert outside_state(outside) == before, f"a target outside --out changed: {done.stderr[-2000:]}"
        lines = [line for line in done.stderr.strip().splitlines() if line.strip() and "%|" not in line]  # no bars
        if done.returncode == 2:
            what = "symbolic link" if kind == "link" else ""
            assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and what in lines[0], \
                f"{todo}: exit 2 but not one line about a {kind} path:\n{done.stderr[-3000:]}"
            named = [p for p in todo if f"{out / p} is " in lines[0]]
            assert named, f"the refusal names no planted path: {lines[0]}"
            changed = sorted(p for p in found.keys() | out_state(out).keys() if found.get(p) != out_state(out).get(p))
            assert not changed, f"refused for {named[0]} after writing {changed}"
            outcome[named[0]] = "refused"
            todo.remove(named[0])
            continue
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"{todo}:\n{done.stderr[-3000:]}"
        for path in todo:
            place = out / path
            outcome[path] = "left" if place.is_symlink() and place.resolve() == targets[path].resolve() else "replaced"
        todo = []
    return outcome


@pytest.fixture(scope="module")
def first_step(tiny_model, train_file, tmp_path_factory):
    """A one-step GRPO run with its checkpoint, its evaluations (before step 1 and after) and completions."""
    out = tmp_path_factory.mktemp("links") / "run"
    done = run_remix(*tiny_cli(tiny_model, train_file, out, "--steps", "1", "--save-every", "1", "--eval-every", "1",
                               "--eval-limit", "1", "--eval-benchmarks", "aime24", "--log-completions", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def resumed(first_step, tmp_path_factory):
    """What a resume to step 2 leaves: the listing of every path it and the first step wrote."""
    out = tmp_path_factory.mktemp("links-resumed") / "run"
    shutil.copytree(first_step, out, symlinks=True)
    done = run_remix("--resume", str(out), "--steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def resume_paths(resumed: Path) -> list[str]:
    """What a resume writes or rewrites: everything but the checkpoint it reads (the loader's checks of what it
    reads are safeload's)."""
    return [p for p in listing(resumed) if not p.startswith("checkpoint-1")]


def resume_job(first_step):
    def fresh(out):
        shutil.copytree(first_step, out, symlinks=True)
    return fresh, lambda out: run_remix("--resume", str(out), "--steps", "2")


@pytest.mark.slow
def test_links_at_the_paths_a_resume_writes_one_level_down(first_step, resumed, tmp_path):
    """The folder's own entries (the lock, the logs, tb, eval, checkpoint-2): each refused or replaced. The
    issue's four: OUT/.remix.lock, a linked tb, a linked eval, and (eval.py below) summary.json and results.md."""
    fresh, start = resume_job(first_step)
    top = [p for p in resume_paths(resumed) if os.sep not in p]
    assert {".remix.lock", "tb", "eval", "metrics.jsonl", "checkpoint-2"} <= set(top), top
    outcome = check_planted(top, start, fresh, resumed, tmp_path, "remix")
    assert outcome["tb"] == outcome["eval"] == outcome[".remix.lock"] == "refused", outcome
    assert outcome["checkpoint-2"] == "replaced", outcome


def resume_in_process(capsys):
    """start(out) for check_planted: the resume to step 2 in this process (seconds where a new process takes tens)."""
    def start(out):
        import remix
        from machinery import runfolder

        code = 0
        try:
            remix.train(remix.Args(resume=str(out), steps=2))
        except SystemExit as exit_info:
            code = exit_info.code
        finally:
            runfolder.unlock()  # the folder is locked by this process until it ends
        captured = capsys.readouterr()
        return types.SimpleNamespace(returncode=code, stderr=captured.err, stdout=captured.out)
    return start


@pytest.mark.slow
def test_a_file_or_folder_where_a_resume_writes_the_other_is_refused_before_step_1(first_step, resumed, tmp_path,
                                                                                    capsys):
    """A plain file where a resume writes a folder (tb, eval, checkpoint-2) and a folder where it writes a file (its
    logs, plan.json, eval/step-2.jsonl): each refused in one line naming it, with nothing written (a plain file at
    eval ended in a traceback after a step had run)."""
    fresh, _ = resume_job(first_step)
    paths = ["tb", "eval", "checkpoint-2", "metrics.jsonl", "completions.jsonl", "plan.json",
             os.path.join("eval", "step-2.jsonl")]
    assert set(paths) <= set(resume_paths(resumed)), resume_paths(resumed)
    outcome = {}
    for group in antichains(paths):
        outcome.update(check_planted(group, resume_in_process(capsys), fresh, resumed, tmp_path / str(len(outcome)),
                                     "remix", kind="swapped"))
    assert set(outcome.values()) == {"refused"}, outcome


@pytest.mark.slow
@pytest.mark.long
def test_links_at_every_path_a_resume_writes(first_step, resumed, tmp_path):
    fresh, start = resume_job(first_step)
    outcome = {}
    for group in antichains([p for p in resume_paths(resumed) if os.sep in p]):
        outcome.update(check_planted(group, start, fresh, resumed, tmp_path / str(len(outcome)), "remix"))
    assert any(p.startswith("tb" + os.sep) for p in outcome) and outcome.get(
        os.path.join("eval", "step-2.jsonl")) == "replaced", outcome


@pytest.mark.slow
@pytest.mark.long
def test_links_at_the_paths_a_new_run_writes(tiny_model, train_file, first_step, tmp_path):
    """A new run with --overwrite into a folder of links (its lock, logs, tb, eval, checkpoints): the lock is
    refused, the rest removed as links (their targets untouched)."""
    top = [p for p in listing(first_step) if os.sep not in p]
    start = lambda out: run_remix(*tiny_cli(tiny_model, train_file, out, "--steps", "1", "--overwrite"))  # noqa: E731
    outcome = check_planted(top, start, lambda out: out.mkdir(parents=True), first_step, tmp_path, "remix")
    assert outcome[".remix.lock"] == "refused" and outcome["metrics.jsonl"] == "replaced", outcome


EVAL = ["--benchmarks", "aime24", "--limit", "1", "--max-tokens", "4", "--sampler", "hf"]


@pytest.fixture(scope="module")
def evaluated(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("links-eval") / "eval"
    done = run_remix("--model", tiny_model, *EVAL, "--out", str(out), program="eval.py")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_links_at_every_path_an_evaluation_writes(tiny_model, evaluated, tmp_path):
    """An evaluation continued over links at each path a real one wrote (its lock, settings.json, samples.jsonl,
    summary.json, results.md): those it reads back are refused, those it only writes replaced."""
    start = lambda out: run_remix("--model", tiny_model, *EVAL, "--out", str(out), program="eval.py")  # noqa: E731
    fresh = lambda out: shutil.copytree(evaluated, out)  # noqa: E731
    outcome = check_planted(listing(evaluated), start, fresh, evaluated, tmp_path, "eval")
    assert {"summary.json", "results.md", "samples.jsonl", "settings.json"} <= set(outcome), outcome
    assert outcome["summary.json"] == outcome["results.md"] == "replaced", outcome
    assert outcome["settings.json"] == outcome["samples.jsonl"] == "refused", outcome  # read back: not followed


@pytest.mark.slow
def test_links_at_every_path_a_regrade_writes(evaluated, tmp_path):
    samples, regraded = tmp_path / "samples.jsonl", tmp_path / "regraded"
    shutil.copy(evaluated / "samples.jsonl", samples)
    regrade = lambda out: run_remix("--regrade", str(samples), "--out", str(out), program="eval.py")  # noqa: E731
    assert regrade(regraded).returncode == 0
    outcome = check_planted(listing(regraded), regrade, lambda out: shutil.copytree(regraded, out), regraded,
                            tmp_path, "eval")
    assert outcome["samples.jsonl"] == outcome["summary.json"] == "replaced", outcome


@pytest.mark.slow
def test_links_at_every_file_curves_draws(resumed, tmp_path):
    """--curves: each PNG a link, replaced by the drawing; the target keeps its bytes."""
    curves = tmp_path / "curves"
    draw = lambda out: run_remix("--curves", str(resumed), "--out", str(out), program="eval.py")  # noqa: E731
    assert draw(curves).returncode == 0
    outcome = check_planted(listing(curves), draw, lambda out: out.mkdir(parents=True), curves, tmp_path, "eval")
    assert set(outcome.values()) == {"replaced"} and len(outcome) == 3, outcome
