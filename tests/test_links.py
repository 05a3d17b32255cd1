"""Nothing is written outside --out: every write of remix.py, eval.py and machinery goes through runfolder's
primitives (a static walk of their syntax trees finds any other), and a symbolic link planted at any path a run, a
resume, an evaluation, a regrade or --curves writes (found from a listing of what a real one wrote, so a new file is
covered) is refused in one line or replaced, its target untouched.

    pytest -q tests/test_links.py                # the static walk; a resume's top level, eval, regrade, curves
    pytest -q tests/test_links.py -m long        # every path a resume writes, and a new run
"""

import ast
import errno
import os
import shutil
import stat
import types
from pathlib import Path

import pytest

from tests.common import ROOT, run_remix, tiny_cli, unlock

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
               "save_pretrained", "SummaryWriter", "savefig", "mkdtemp", "hardlink_to", "save_file"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}
# Calls the walk finds that write nothing under --out, each with why (file, enclosing function, call name):
ALLOWED = {
    ("machinery/dist.py", "clear_cpu_shm", "os.remove"),  # vLLM's shared-memory files in /dev/shm, never in --out
    ("machinery/checkpoints.py", "write_model", "model.save_pretrained"),  # into .tmp-checkpoint-STEP, just made
    ("machinery/checkpoints.py", "write_model", "tokenizer.save_pretrained"),  # the same folder
    ("machinery/checkpoints.py", "write_rank_files", "torch.save"),  # into a file runfolder.open_file opened (twice)
    ("machinery/report.py", "__init__", "SummaryWriter"),  # OUT/tb, made and checked for links by check_tree first
    ("machinery/report.py", "__init__", "wandb.init"),  # wandb.init(dir=OUT): OUT/wandb checked by check_tree first
    ("eval.py", "figure", "fig.savefig"),  # into a file object runfolder.new_file opened
    ("machinery/checkpoints.py", "cast_folder", "save_file"),  # into a .trash-* folder runfolder.fresh_folder just made
    ("machinery/console.py", "drop", "os.open"),  # /dev/null, onto stdout or stderr once it cannot be written
    ("machinery/console.py", "drop_unwritable_output", "os.open"),  # /dev/null, onto a standard descriptor closed
    ("machinery/console.py", "drop_unwritable_output", "open"),  # descriptor 1 or 2 as a stream, when Python made none
    ("machinery/engines.py", "packed", "torch.save"),  # into a BytesIO: the bytes cross --overlap's pipe, no file
}
PROGRAMS = ["remix.py", "eval.py", "deepscaler.py",
            *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "machinery").glob("*.py"))]


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
# Hard links and special files: nothing is written into a file that is not the run's alone
# ----------------------------------------------------------------------------------------------
OUTSIDE = "not the run's\n"


def hard_link_or_fifo(kind: str, place: Path, outside: Path):
    """A hard link at place to outside (a file beyond --out, its bytes OUTSIDE), or a FIFO at place."""
    outside.write_text(OUTSIDE)
    if kind == "hard link":
        os.link(outside, place)
    else:
        os.mkfifo(place)


def untouched(outside: Path) -> bool:
    return outside.read_text() == OUTSIDE and outside.stat().st_nlink == 1


def plain_file(place: Path) -> bool:
    """A regular file of one name, the run's alone."""
    return stat.S_ISREG(place.lstat().st_mode) and place.lstat().st_nlink == 1


@pytest.fixture
def written_folder(tmp_path):
    from machinery import runfolder

    out = tmp_path / "out"
    out.mkdir()
    runfolder.writes_into(str(out))
    yield out, tmp_path / "outside.txt"
    unlock()


def no_folder_locks(monkeypatch):
    """flock on a folder fails as it does on NFS, where the lock file alone is the lock."""
    from machinery import runfolder

    real = runfolder.fcntl.flock

    def flock(fd, operation):
        if stat.S_ISDIR(os.fstat(fd if isinstance(fd, int) else fd.fileno()).st_mode):
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, operation)
    monkeypatch.setattr(runfolder.fcntl, "flock", flock)


@pytest.mark.parametrize("folder_locks", [True, False])
@pytest.mark.parametrize("kind", ["hard link", "FIFO"])
def test_the_lock_file_is_written_anew_over_a_hard_link_or_a_fifo(kind, folder_locks, written_folder, monkeypatch):
    """Issue 43: OUT/.remix.lock, hard-linked to a file outside --out, was overwritten with the holder's line, and a
    FIFO there ended in '...: None'. The lock is written anew and renamed into place: the outside file keeps its bytes
    and its one name, and the new lock names this process and is held (another open of it cannot take it). Without
    folder locks (NFS) the file is the lock: the same, and one another job holds is never replaced."""
    import fcntl
    import socket

    from machinery import runfolder

    out, outside = written_folder
    place = out / runfolder.LOCK
    hard_link_or_fifo(kind, place, outside)
    if not folder_locks:
        no_folder_locks(monkeypatch)
    runfolder.lock(str(out))
    assert untouched(outside) and plain_file(place)
    assert place.read_text() == f"{socket.gethostname()} {os.getpid()}\n"
    with open(place) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_without_folder_locks_a_lock_file_another_job_holds_is_never_replaced(written_folder, monkeypatch, capsys):
    import fcntl

    from machinery import runfolder

    out, _ = written_folder
    no_folder_locks(monkeypatch)
    (out / runfolder.LOCK).write_text("elsewhere 4242\n")
    with open(out / runfolder.LOCK) as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as exit_info:
            runfolder.lock(str(out))
        assert exit_info.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
            f"remix: error: --out {out} is in use by a running job (elsewhere 4242); wait for it to end, or choose "
            f"another --out"]
        assert (out / runfolder.LOCK).read_text() == "elsewhere 4242\n" and sorted(os.listdir(out)) == [runfolder.LOCK]


def write_whole(how: str, path: str):
    from machinery import runfolder

    if how == "replace_file":
        runfolder.replace_file(path, ["new\n"])
    elif how == "new_file":
        with runfolder.new_file(path, "wb") as f:
            f.write(b"new\n")
    else:
        with runfolder.open_file(path, "w") as f:
            f.write("new\n")


@pytest.mark.parametrize("how", ["replace_file", "new_file", "open_file"])
@pytest.mark.parametrize("kind", ["hard link", "FIFO"])
def test_a_file_written_whole_replaces_a_hard_link_or_a_fifo(kind, how, written_folder):
    """replace_file (the logs' rewrite, plan.json, eval.py's reports), new_file (--curves' plots) and open_file's 'w'
    (a checkpoint's files): each writes a new file where the hard link or the FIFO was (no open of a FIFO, which would
    block), the outside file untouched."""
    out, outside = written_folder
    place = out / "report.json"
    hard_link_or_fifo(kind, place, outside)
    write_whole(how, str(place))
    assert untouched(outside) and plain_file(place) and place.read_text() == "new\n"


@pytest.mark.parametrize("kind, said", [("hard link", "has 2 hard links (another name shares its contents), and "
                                                      "nothing is written through one: remove it"),
                                        ("FIFO", "is not a regular file (a FIFO, socket or device), and nothing is "
                                                 "written into one: remove it"),
                                        ("FIFO with a reader", "is not a regular file")])
def test_a_file_appended_to_is_refused_in_one_line_unless_it_is_the_runs_alone(kind, said, written_folder):
    """A log opened to be appended to ('a', as eval.py appends each benchmark's samples): a hard link or a FIFO (read
    or not) is refused, naming the file and what is wrong; nothing written, nothing blocked."""
    from machinery import runfolder

    out, outside = written_folder
    place = out / "samples.jsonl"
    hard_link_or_fifo(kind.split(" with")[0], place, outside)
    reader = os.open(place, os.O_RDONLY | os.O_NONBLOCK) if kind.endswith("reader") else None
    try:
        for mode in ("a", "a+", "ab"):
            with pytest.raises(runfolder.Unwritable) as refused:
                runfolder.open_file(str(place), mode)
            assert str(refused.value).startswith(f"{place} {said}"), str(refused.value)
            assert outside.read_text() == OUTSIDE
    finally:
        if reader is not None:
            assert os.read(reader, 100) == b""  # nothing reached the FIFO's reader
            os.close(reader)


# ----------------------------------------------------------------------------------------------
# The dynamic check: a link planted at each written path
# ----------------------------------------------------------------------------------------------
def listing(folder: Path) -> list[str]:
    """Every file and folder under folder, relative, parents first."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def outside_state(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


# what a refusal says right after the path, for each kind of thing planted there ("swapped": a file where a folder
# goes, or a folder where a file goes: "is a file", "is a folder", or "is not a regular file" where the run appends)
REFUSALS = {"symbolic link": "is a symbolic link", "hard link": "has 2 hard links", "FIFO": "is not a",
            "swapped": "is"}


def out_state(out: Path) -> dict:
    """Every entry under out but the lock (which names the job that last held it), links as links: a link's target,
    a file's bytes, a folder's None."""
    def state(p: Path):
        return ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else None

    return {str(p.relative_to(out)): state(p) for p in out.rglob("*") if p.name != ".remix.lock"}


def plant(out: Path, path: str, outside: Path, kind_of: Path, kind: str = "symbolic link") -> Path | None:
    """A link at out/path to a new file (or folder, where the baseline had one) outside out, in place of what is
    there; the folders above it are made real ones. kind 'hard link': a hard link to a file outside that holds what
    the file there held (a copy `cp -al` made, which a program may read; files only); 'FIFO': a FIFO (no target);
    'swapped': a plain file where the baseline had a folder, a folder where it had a file (no target)."""
    target, place = outside / path.replace(os.sep, "__"), out / path
    if kind in ("FIFO", "swapped"):
        target = None
    elif (kind_of / path).is_dir():
        target.mkdir(parents=True)
        (target / "mine.txt").write_text("not the run's")
    elif kind == "hard link" and place.is_file() and not place.is_symlink():
        target.write_bytes(place.read_bytes())
    else:
        target.write_text("not the run's\n")
    if place.is_dir() and not place.is_symlink():
        shutil.rmtree(place)
    elif place.exists() or place.is_symlink():
        place.unlink()
    place.parent.mkdir(parents=True, exist_ok=True)
    if kind == "swapped" and (kind_of / path).is_dir():
        place.write_text("a file where the run had a folder\n")
    elif kind == "swapped":
        (place / "inside").mkdir(parents=True)
    elif kind == "FIFO":
        os.mkfifo(place)
    elif kind == "hard link":
        os.link(target, place)
    else:
        place.symlink_to(target, target_is_directory=target.is_dir())
    return target


def still_planted(place: Path, target: Path | None, kind: str) -> bool:
    if kind == "swapped":
        return False  # what the job left there is its own
    if kind == "FIFO":
        return stat.S_ISFIFO(place.lstat().st_mode) if os.path.lexists(place) else False
    if kind == "hard link":
        return place.exists() and not place.is_symlink() and os.path.samefile(place, target)
    return place.is_symlink() and place.resolve() == target.resolve()


def antichains(paths: list[str]) -> list[list[str]]:
    """The paths grouped by depth: no path of a group lies inside another of it, so all can be links at once."""
    groups = {}
    for path in paths:
        groups.setdefault(path.count(os.sep), []).append(path)
    return [groups[d] for d in sorted(groups)]


def check_planted(paths: list[str], start, fresh, baseline: Path, tmp: Path, prog: str,
                  kind: str = "symbolic link") -> dict:
    """Links (or hard links, or FIFOs, or a file where a folder was and a folder where a file was: kind, see plant)
    at all of paths at once, in a fresh copy (fresh(folder) makes it); start(folder) runs the job. A run refused in
    one line must name a planted path and say what is wrong with it, and leave the folder as it found it but its lock
    (refused before anything is written: a resume before its step 1); that path is recorded as refused and the job
    runs again without it. When the job ends with exit 0, every remaining one was replaced by a real file or left
    alone. In every run, no target outside changes (its bytes).
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
            assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and REFUSALS[kind] in lines[0], \
                f"{todo}: exit 2 but not one line about a {kind}:\n{done.stderr[-3000:]}"
            named = [p for p in todo if f"{out / p} {REFUSALS[kind]}" in lines[0]]
            assert named, f"the refusal names no planted {kind}: {lines[0]}"
            changed = sorted(p for p in found.keys() | out_state(out).keys() if found.get(p) != out_state(out).get(p))
            assert not changed, f"refused for {named[0]} after writing {changed}"
            outcome[named[0]] = "refused"
            todo.remove(named[0])
            continue
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"{todo}:\n{done.stderr[-3000:]}"
        for path in todo:
            outcome[path] = "left" if still_planted(out / path, targets[path], kind) else "replaced"
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
    reads are checkpoints.read_pt's and the manifest's)."""
    return [p for p in listing(resumed) if not p.startswith("checkpoint-1")]


def resume_job(first_step):
    def fresh(out):
        shutil.copytree(first_step, out, symlinks=True)
    return fresh, lambda out: run_remix("--resume", str(out), "--steps", "2")


@pytest.mark.long
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
        from machinery import console, runfolder

        code = 0
        try:
            remix.train(console.settings(remix.Args, resume=str(out), steps=2))
        except SystemExit as exit_info:
            code = exit_info.code
        finally:
            unlock()  # the folder is locked by this process until it ends
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


@pytest.mark.long
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


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("kind", ["hard link", "FIFO"])
def test_hard_links_and_fifos_at_every_path_a_resume_writes(kind, first_step, resumed, tmp_path):
    """Issue 43's variant of the links above: a hard link (to a file outside --out) or a FIFO at every file a resume
    writes, and a FIFO where it writes a folder (tb, eval): each replaced (the other name keeps its bytes) or refused
    in one line naming it and what is wrong; never written into, never a hang. (A file where a checkpoint's folder
    goes is a resume's check before step 1, issue 43's item 12; a checkpoint, read before it is written, is written
    into a new folder, and what it holds is the safe loader's.)"""
    fresh, start = resume_job(first_step)
    paths = [p for p in resume_paths(resumed) if not p.startswith("checkpoint-") and (
        (resumed / p).is_file() or (kind == "FIFO" and p in ("tb", "eval")))]
    outcome = {}
    for group in antichains(paths):
        outcome.update(check_planted(group, start, fresh, resumed, tmp_path / str(len(outcome)), "remix", kind))
    assert outcome[".remix.lock"] == outcome["plan.json"] == outcome[os.path.join("eval", "step-2.jsonl")] \
        == "replaced", outcome
    assert outcome["metrics.jsonl"] == ("replaced" if kind == "hard link" else "refused"), outcome


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("kind", ["hard link", "FIFO"])
def test_hard_links_and_fifos_at_every_path_an_evaluation_a_regrade_and_curves_write(kind, tiny_model, evaluated,
                                                                                       resumed, tmp_path):
    """The same for eval.py: an evaluation continued, a regrade and --curves, over a hard link (holding the bytes the
    file held, as `cp -al` leaves it) or a FIFO at each file a real one wrote."""
    evaluate = lambda out: run_remix("--model", tiny_model, *EVAL, "--out", str(out), program="eval.py")  # noqa: E731
    outcome = check_planted(listing(evaluated), evaluate, lambda out: shutil.copytree(evaluated, out), evaluated,
                            tmp_path / "eval", "eval", kind)
    written = "replaced" if kind == "hard link" else "refused"  # eval.py refuses any FIFO in its --out up front
    assert outcome[".remix.lock"] == "replaced" and outcome["summary.json"] == outcome["results.md"] == written, outcome
    samples, regraded, curves = tmp_path / "samples.jsonl", tmp_path / "regraded", tmp_path / "curves"
    shutil.copy(evaluated / "samples.jsonl", samples)
    regrade = lambda out: run_remix("--regrade", str(samples), "--out", str(out), program="eval.py")  # noqa: E731
    assert regrade(regraded).returncode == 0
    outcome = check_planted(listing(regraded), regrade, lambda out: shutil.copytree(regraded, out), regraded,
                            tmp_path / "re", "eval", kind)
    assert outcome["samples.jsonl"] == outcome["summary.json"] == "replaced", outcome
    draw = lambda out: run_remix("--curves", str(resumed), "--out", str(out), program="eval.py")  # noqa: E731
    assert draw(curves).returncode == 0
    outcome = check_planted(listing(curves), draw, lambda out: out.mkdir(parents=True), curves, tmp_path / "curves",
                            "eval", kind)
    assert set(outcome.values()) == {"replaced"} and len(outcome) == 3, outcome
