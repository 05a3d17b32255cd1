"""Logs and locks: a regrade never writes into an evaluation of a model and a continued evaluation counts only its
own records; a log rewritten on resume (metrics.jsonl, completions.jsonl, eval's samples.jsonl) loses no row to a
signal, and the line after it names the checkpoint; one job per folder, even with its lock file deleted; a vLLM
evaluation that ends without a traceback; saved records of the wrong types, junk in a log and a full disk while
logging, each in one line.

    pytest -q tests/test_logs_and_locks.py
"""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import eval as eval_cli  # noqa: E402
from machinery import console, report, runfolder  # noqa: E402
from tests.common import ROOT, one_error_line, read_metrics, run_remix, tiny_cli  # noqa: E402

EVAL_FLAGS = ["--benchmarks", "aime24", "amc83", "--limit", "2", "--max-tokens", "6", "--sampler", "hf"]


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def solutions(path: Path, benchmark: str = "aime24", n: int = 2) -> Path:
    """Records that answer every problem right, as benchmarks/solution_grading.py writes them."""
    rows = [{"benchmark": benchmark, "id": i, "answers": [str(i)], "response": f"so \\boxed{{{i}}}",
             "response_tokens": 3} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_eval(model: str, out: Path, **overrides) -> eval_cli.EvalArgs:
    """EVAL_FLAGS as arguments."""
    return eval_cli.EvalArgs(model=model, out=str(out), benchmarks=("aime24", "amc83"), limit=2, max_tokens=6,
                             sampler="hf", **overrides)


def refused(capsys, args: eval_cli.EvalArgs) -> str:
    """eval.py stopped with exit code 2 and one stderr line, which is returned."""
    with pytest.raises(SystemExit) as exit_info, pytest.MonkeyPatch.context() as patch:
        patch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
        eval_cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("eval: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def evaluated(tiny_model, tmp_path_factory):
    """A finished evaluation of the tiny model (two benchmarks, two problems each, greedy)."""
    out = tmp_path_factory.mktemp("evaluated") / "eval"
    eval_cli.main(tiny_eval(tiny_model, out))
    return out


# ----------------------------------------------------------------------------------------------
# A regrade never writes into an evaluation; a continue counts only its own records
# ----------------------------------------------------------------------------------------------
def test_a_regrade_into_an_evaluation_of_a_model_is_refused_and_writes_nothing(evaluated, tiny_model, tmp_path,
                                                                              capsys):
    out = tmp_path / "eval"
    shutil.copytree(evaluated, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = refused(capsys, eval_cli.EvalArgs(regrade=str(solutions(tmp_path / "S.jsonl")), out=str(out)))
    assert line.startswith(f"eval: error: --out {out} holds an evaluation of {tiny_model}")
    assert "give --out a new folder" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written, no lock file taken either
    # the model's own samples regraded elsewhere: allowed, and again into that regrade's folder
    for _ in range(2):
        eval_cli.main(eval_cli.EvalArgs(regrade=str(out / "samples.jsonl"), out=str(tmp_path / "regraded"),
                                        grader="deepscaler"))
    assert len(lines_of(tmp_path / "regraded" / "samples.jsonl")) == 4
    # and an evaluation of a model is not continued in a regrade's folder
    assert "holds a regrade of" in refused(capsys, tiny_eval(tiny_model, tmp_path / "regraded"))


def test_a_continue_refuses_records_its_settings_did_not_make(evaluated, tiny_model, tmp_path, capsys):
    """What the old regrade left behind: the solutions' records in an evaluation's samples.jsonl (settings.json
    still the model's). The continue used to count them as the model's samples (100 % on aime24)."""
    out = tmp_path / "eval"
    shutil.copytree(evaluated, out)
    own = [json.loads(line) for line in lines_of(out / "samples.jsonl")]
    graded = [{**json.loads(line), "run": "greedy", "repeat": 0, "sample": 0, "correct": True,
               "correct_deepscaler": True, "status": "ok", "extracted": "0", "finish_reason": "stop"}
              for line in lines_of(solutions(tmp_path / "S.jsonl"))]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in graded + own[2:]))
    before = (out / "samples.jsonl").read_bytes()
    line = refused(capsys, tiny_eval(tiny_model, out))
    assert line.startswith(f"eval: error: {out / 'samples.jsonl'} holds 2 records these settings did not make")
    assert (out / "samples.jsonl").read_bytes() == before
    # the model's own records are counted: a rerun of the finished evaluation generates nothing
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    summary = eval_cli.main(tiny_eval(tiny_model, out))
    printed = capsys.readouterr().out
    assert "continuing" in printed and "2 of 2 runs" in printed and "run 1/1" not in printed
    assert summary == json.loads((evaluated / "summary.json").read_text())


# ----------------------------------------------------------------------------------------------
# A signal in the middle of a log's rewrite: no row lost, and the line names what can be resumed
# ----------------------------------------------------------------------------------------------
# The program, with SIGTERM sent to itself just after it opens `name` (or a file written aside for it) for
# writing: the instant a rewrite in place has emptied the file and written nothing back.
SIGTERM_ON_OPEN = """
import builtins, os, runpy, signal, sys
name, program = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.dirname(program))
from machinery import runfolder
fired = []
def then_sigterm(real, default):  # SIGTERM as the file (or the aside file that replaces it) is opened for writing
    def opened(file, *args, **kwargs):
        handle = real(file, *args, **kwargs)
        mode, base = args[0] if args else kwargs.get("mode", default), os.path.basename(str(file))
        if not fired and ("w" in mode or "x" in mode) and (base == name or base.startswith("." + name + ".tmp")):
            fired.append(base)
            os.kill(os.getpid(), signal.SIGTERM)
        return handle
    return opened
builtins.open = then_sigterm(builtins.open, "r")
runfolder.open_file = then_sigterm(runfolder.open_file, "w")  # the run folder's writes (runfolder.replace_file too)
sys.argv = [program, *sys.argv[3:]]
runpy.run_path(program, run_name="__main__")
"""


def sigterm_on_open(name: str, program: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGTERM_ON_OPEN, name, str(ROOT / program), *argv],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))


@pytest.fixture(scope="module")
def two_steps(tiny_model, train_file, tmp_path_factory):
    """A two-step GRPO run with a checkpoint after each step, both full (checkpoint-1 as a kill during its reduction
    leaves it: stopped after step 1, its checkpoint copied aside, resumed, the copy put back), so that a resume can go
    back to step 1."""
    root = tmp_path_factory.mktemp("two_steps")
    out = root / "run"
    done = run_remix(*tiny_cli(tiny_model, train_file, out, "--steps", "1", "--save-every", "1", "--keep-last", "0"))
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.copytree(out / "checkpoint-1", root / "step-1-aside")
    done = run_remix("--resume", str(out), "--steps", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.rmtree(out / "checkpoint-1")
    os.replace(root / "step-1-aside", out / "checkpoint-1")
    return out


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("log", ["metrics.jsonl", "completions.jsonl"])
def test_a_sigterm_while_a_resume_trims_its_logs_loses_no_row_and_names_the_checkpoint(log, two_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    shutil.rmtree(out / "checkpoint-2")  # the resume goes back to step 1 and trims step 2 from the logs
    before = {name: lines_of(out / name) for name in ("metrics.jsonl", "completions.jsonl")}
    assert [json.loads(line)["step"] for line in before["metrics.jsonl"]] == [1, 2]
    done = sigterm_on_open(log, "remix.py", "--resume", str(out), "--steps", "2")
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.startswith("remix: ")]
    assert done.returncode == 143 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0] == (f"remix: terminated (SIGTERM) while starting; the last checkpoint is {out / 'checkpoint-1'}; "
                        f"continue with --resume {out}")
    if log == "completions.jsonl":  # metrics.jsonl was trimmed, whole, before completions.jsonl was begun
        before["metrics.jsonl"] = before["metrics.jsonl"][:1]
    assert {name: lines_of(out / name) for name in before} == before  # every row still there
    assert not list(out.glob(".*.tmp*"))  # nothing written aside is left
    resumed = run_remix("--resume", str(out), "--steps", "2")  # checkpoint-1's own --steps is 1
    assert resumed.returncode == 0 and "has finished" not in resumed.stdout + resumed.stderr, resumed.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.long
@pytest.mark.slow
def test_a_sigterm_while_a_continued_eval_rewrites_its_samples_loses_none(evaluated, tiny_model, tmp_path):
    out = tmp_path / "eval"
    shutil.copytree(evaluated, out)
    rows = lines_of(out / "samples.jsonl")
    (out / "samples.jsonl").write_text("\n".join(rows[:3]) + "\n")  # aime24 finished, amc83 half written
    before = lines_of(out / "samples.jsonl")
    done = sigterm_on_open("samples.jsonl", "eval.py", "--model", tiny_model, "--out", str(out), *EVAL_FLAGS)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and "rerun the same command to continue" in lines[0], lines
    assert lines_of(out / "samples.jsonl") == before and not list(out.glob(".*.tmp*"))
    again = run_remix("--model", tiny_model, "--out", str(out), *EVAL_FLAGS, program="eval.py")
    assert again.returncode == 0 and "continuing" in again.stdout, again.stderr[-2000:]
    assert sorted(lines_of(out / "samples.jsonl")) == sorted(rows)


# ----------------------------------------------------------------------------------------------
# One job per folder: eval.py locks, and a deleted lock file does not unlock
# ----------------------------------------------------------------------------------------------
@pytest.mark.long
@pytest.mark.slow
def test_a_second_eval_on_a_folder_in_use_is_refused_even_with_the_lock_file_deleted(tiny_model, tmp_path):
    out = tmp_path / "eval"
    flags = ["--model", tiny_model, "--out", str(out), "--benchmarks", "math500", "--max-tokens", "32", "--sampler", "hf"]
    first = subprocess.Popen([sys.executable, str(ROOT / "eval.py"), *flags, "--limit", "100"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.time() + 120
        while not (out / "settings.json").exists():  # written once the folder is the first job's
            assert first.poll() is None and time.time() < deadline, "the first evaluation ended early"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)  # alive, holding what it holds, using no CPU
        written = {p.name: p.read_bytes() for p in out.iterdir() if p.name != runfolder.LOCK}
        line = one_error_line(run_remix(*flags, "--limit", "100", program="eval.py"),
                              f"--out {out} is in use by a running job", "eval")
        assert str(first.pid) in line
        (out / runfolder.LOCK).unlink()
        one_error_line(run_remix(*flags, "--limit", "100", program="eval.py"), "is in use by a running job", "eval")
        one_error_line(run_remix("--resume", str(out)), "is in use by a running job")  # remix.py's lock is the same
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != runfolder.LOCK} == written
    finally:
        first.kill()
        first.wait()
    done = run_remix(*flags, "--limit", "2", "--overwrite", program="eval.py")  # the lock died with its process
    assert done.returncode == 0, done.stderr[-2000:]
    keys = [(s["run"], s["benchmark"], s["repeat"], s["id"], s["sample"])
            for s in map(json.loads, lines_of(out / "samples.jsonl"))]
    assert len(keys) == len(set(keys)) == 2


# ----------------------------------------------------------------------------------------------
# A vLLM evaluation ends cleanly
# ----------------------------------------------------------------------------------------------
@pytest.mark.long
@pytest.mark.slow
def test_a_vllm_eval_ends_with_exit_0_and_no_traceback(tiny_model, tmp_path):
    done = run_remix("--model", tiny_model, "--out", str(tmp_path / "eval"), "--benchmarks", "aime24", "--limit", "2",
                     "--max-tokens", "6", program="eval.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Invalid process group" not in done.stderr, done.stderr[-3000:]
    assert len(lines_of(tmp_path / "eval" / "samples.jsonl")) == 2


# ----------------------------------------------------------------------------------------------
# One line where one line is promised: records of the wrong types, junk in a log, a full disk while logging
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("run", ["greedy"]), ("benchmark", ["aime24"]), ("response_tokens", "7"),
                                          ("response_tokens", 7.5), ("repeat", [0]), ("sample", {"a": 1})])
def test_a_regrade_of_records_of_the_wrong_types_gets_one_line(field, value, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    path = solutions(tmp_path / "S.jsonl", n=3)
    rows = [json.loads(line) for line in lines_of(path)]
    rows[1][field] = value
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(eval_cli.EvalArgs(regrade=str(path), out=str(tmp_path / "re")))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"eval: error: {path}: line 2 is not a sample record ('{field}' is ")
    assert not (tmp_path / "re").exists()


def test_junk_lines_in_a_log_are_dropped_with_a_note_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": step, "reward/mean": 0.5}) + "\n" for step in (1, 2, 3)]
    junk = [b"\xff\xfe binary\n", b"[1, 2]\n", b'{"step": "2"}\n', b'{"no step": 1}\n', b"[" * 100_000 + b"\n",
            b"\n"]
    path.write_bytes(good[0].encode() + b"".join(junk) + good[1].encode() + good[2].encode() + b'{"step": 2, "rew')
    kept = report.read_jsonl_upto(str(path), 2)
    assert kept == good[:2]
    notes = capsys.readouterr().out.splitlines()
    assert notes == [f"remix: {path}, line {n}: dropped an unreadable line" for n in (2, 3, 4, 5, 6)] + \
        [f"remix: {path}, line 10: dropped an unreadable line (a write cut short)"]


def small_files(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("full", ["metrics.jsonl", "tb"])
def test_a_full_disk_while_logging_ends_in_one_line_and_keeps_the_checkpoints(full, two_steps, tmp_path):
    """The resumed step 3 cannot log: metrics.jsonl is padded to just under the file-size limit, or the limit is
    so small that the new TensorBoard events file passes it first."""
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    if full == "metrics.jsonl":
        limit = 300_000
        rows = lines_of(out / "metrics.jsonl")
        padding = json.dumps({"step": 1, "padding": "x" * (limit - 500 - len("\n".join(rows)) - 40)})
        (out / "metrics.jsonl").write_text("\n".join(rows[:1] + [padding] + rows[1:]) + "\n")
    else:
        limit = 3_000
        (out / "metrics.jsonl").write_text("")
        (out / "completions.jsonl").write_text("")
        shutil.rmtree(out / "tb")
    checkpoints = {p.name: sorted((f.relative_to(p), f.stat().st_size) for f in p.rglob("*"))
                   for p in out.glob("checkpoint-*")}
    done = subprocess.run([sys.executable, str(ROOT / "remix.py"), "--resume", str(out), "--steps", "3"],
                          capture_output=True, text=True, timeout=300, preexec_fn=small_files(limit),
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    errors = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip() and "%" not in line
              and "Warning" not in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    assert errors[0] == (f"remix: error: cannot write {out / full}: File too large; the last checkpoint is "
                         f"{out / 'checkpoint-2'}; continue with --resume {out}")
    assert {p.name: sorted((f.relative_to(p), f.stat().st_size) for f in p.rglob("*"))
            for p in out.glob("checkpoint-*")} == checkpoints
