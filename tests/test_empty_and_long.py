"""Inputs at the edges, each one line and exit 2 before --out is written, or skipped as the Decisions say: an empty
benchmark set (a file without rows, --benchmarks with no names), --curves over logs that are not metrics, an
over-long problem skipped by its length before it is tokenized, a dataset that is a folder or a .csv, eval.py
pointed at a model's folder, and a second Ctrl-C while a run unwinds the first.

    pytest -q tests/test_empty_and_long.py
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import eval as eval_cli  # noqa: E402
import remix  # noqa: E402
from machinery import data, runner  # noqa: E402
from tests.common import BENCH, ROOT, one_error_line, run_remix, tiny_args, tiny_cli  # noqa: E402


def refused(capsys, call) -> str:
    """call() stopped with exit code 2 and one stderr line, which is returned."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and ": error: " in err[0], err
    return err[0]


def empty_benchmark_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "bench"
    shutil.copytree(BENCH, folder)
    (folder / "math500.jsonl").write_text("")
    return folder


# ----------------------------------------------------------------------------------------------
# An empty benchmark set
# ----------------------------------------------------------------------------------------------
def test_an_empty_benchmark_file_is_refused_by_eval_and_by_training_before_out_is_written(tiny_model, train_file,
                                                                                          tmp_path, capsys):
    folder = empty_benchmark_folder(tmp_path)
    line = refused(capsys, lambda: eval_cli.main(eval_cli.EvalArgs(
        model=tiny_model, benchmarks=("math500",), data_dir=str(folder), sampler="hf", out=str(tmp_path / "e"))))
    assert "benchmark math500" in line and "holds no problems" in line and not (tmp_path / "e").exists(), line
    line = refused(capsys, lambda: remix.train(tiny_args(tiny_model, train_file, tmp_path / "r", eval_every=1,
                                                         eval_benchmarks=("math500",), eval_data_dir=str(folder))))
    assert "benchmark math500" in line and "holds no problems" in line and not (tmp_path / "r").exists(), line


@pytest.mark.slow
def test_benchmarks_given_no_names_is_refused_in_one_line(tiny_model, tmp_path):
    done = run_remix("--model", tiny_model, "--benchmarks", "--sampler", "hf", "--out", str(tmp_path / "e"),
                     program="eval.py")
    one_error_line(done, "no benchmark named", "eval")
    assert not (tmp_path / "e").exists()


# ----------------------------------------------------------------------------------------------
# --curves checks what it reads and where it writes
# ----------------------------------------------------------------------------------------------
GOOD = {"step": 1, "rollouts/total": 8, "rollouts/generated_tokens": 64, "eval/aime24/pass@1": 10.0,
        "eval/average/pass@1": 10.0}


@pytest.mark.parametrize("case, line, said", [
    ("a number", b"1\n", "a JSON int, not an object"),
    ("no step", json.dumps({"loss": 1.0}).encode() + b"\n", "no whole-number 'step'"),
    ("not utf-8", b'{"step": 2, "note": "\xff\xfe"}\n', "utf-8"),
])
def test_curves_name_a_line_that_is_no_metrics_record(case, line, said, tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + line)
    message = refused(capsys, lambda: eval_cli.main(eval_cli.EvalArgs(curves=(str(folder),),
                                                                       out=str(tmp_path / "c"))))
    assert "line 2 is not a metrics record" in message and said in message, message
    assert not (tmp_path / "c").exists()


def test_curves_refuse_an_out_that_is_a_file_and_drop_a_last_line_cut_short(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps(GOOD) + "\n" + '{"step": 2, "rollo')  # a write cut short
    (tmp_path / "c").write_text("mine")
    message = refused(capsys, lambda: eval_cli.main(eval_cli.EvalArgs(curves=(str(folder),),
                                                                       out=str(tmp_path / "c"))))
    assert "is a file, not a folder" in message and (tmp_path / "c").read_text() == "mine", message
    drawn = eval_cli.main(eval_cli.EvalArgs(curves=(str(folder),), out=str(tmp_path / "d")))
    assert drawn["pass1_vs_rollouts.png"] == {"run": 2}  # average and aime24: one point each, from line 1 alone


# ----------------------------------------------------------------------------------------------
# An over-long problem is skipped by its length (Decision 9), never tokenized
# ----------------------------------------------------------------------------------------------
def test_no_text_over_the_character_bound_tokenizes_into_that_many_tokens(tiny_model):
    """The bound's premise, against the real tokenizer: the text that packs the most characters into each token
    (its longest vocabulary entry, repeated) still needs more than `tokens` tokens once it is past the bound."""
    tokenizer = data.load_tokenizer(tiny_model)
    longest = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([longest]) * 40
    bound = runner.char_bound(tokenizer, 16)
    assert len(text) > bound and len(tokenizer(text, add_special_tokens=False)["input_ids"]) > 16
    for sample in ("plain words", "ĠÄ unicode ∑ and 数学", "<|im_start|>" * 3):
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        assert len(sample) <= runner.char_bound(tokenizer, len(ids)), sample


def test_a_problem_of_megabytes_is_skipped_without_being_rendered(tiny_model, monkeypatch):
    tokenizer = data.load_tokenizer(tiny_model)
    rendered = []

    def encode(problem):
        rendered.append(len(problem))
        return remix.build_prompt(tokenizer, problem, "", None)

    huge = "1 + " * 1_000_000  # 4 MB
    problems = [(huge, "1"), ("What is 1 + 1?", "2"), (huge, "3"), ("What is 2 + 2?", "4")]
    bound = runner.char_bound(tokenizer, 1024)
    assert runner.first_fitting_prompt(problems, encode, 1024, bound) == 1
    stream = runner.prompt_stream(problems, encode, 1024, seed=0, max_chars=bound)
    drawn = [next(stream) for _ in range(4)]
    assert sorted({p.answer for p in drawn}) == ["2", "4"] and max(rendered) < 100, rendered


@pytest.mark.slow
def test_an_over_long_problem_is_skipped_by_training_and_eval_in_seconds(tiny_model, train_file, tmp_path):
    """Issue 37's 50 MB problem, at 4 MB: a run over a dataset that holds it trains on the others, and eval.py
    skips it with a note (today: minutes of tokenizing, then a blamed chat template)."""
    rows = [{"problem": "1 + " * 1_000_000, "answer": "1"}] + [json.loads(line) for line in open(train_file)]
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    start = time.perf_counter()
    done = run_remix(*tiny_cli(tiny_model, dataset, tmp_path / "run", "--steps", "2"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "aime24.jsonl").write_text("".join(json.dumps({"id": i, "problem": p, "answer": "1"}) + "\n" for i, p in
                                                enumerate(["1 + " * 1_000_000, "What is 0 + 1?"])))
    done = run_remix("--model", tiny_model, "--benchmarks", "aime24", "--data-dir", str(bench), "--max-tokens", "4",
                     "--sampler", "hf", "--out", str(tmp_path / "eval"), program="eval.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "aime24: skipped 1 problem(s) longer than the model's context can hold" in done.stdout, done.stdout
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["greedy"]["aime24"]["problems"] == 1
    assert time.perf_counter() - start < 120


# ----------------------------------------------------------------------------------------------
# Datasets that are no file remix reads; eval.py pointed at a model
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["folder", "csv", "missing csv"])
def test_a_dataset_folder_or_csv_gets_one_line_naming_the_accepted_forms(kind, tiny_model, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the datasets library caches a local folder under it
    path = tmp_path / ("problems" if kind == "folder" else "problems.csv")
    if kind == "folder":
        path.mkdir()
        (path / "train.jsonl").write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    elif kind == "csv":
        path.write_text("problem,answer\n1+1,2\n")
    line = refused(capsys, lambda: remix.train(tiny_args(tiny_model, str(path), tmp_path / "out")))
    assert "pass a local .jsonl, .json or .parquet file, or a hub id" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "home").exists()


def test_eval_into_a_model_folder_is_refused_without_leaving_a_lock(tiny_model, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    before = sorted(p.name for p in folder.iterdir())
    for overwrite in (False, True):
        line = refused(capsys, lambda: eval_cli.main(eval_cli.EvalArgs(model=tiny_model, sampler="hf",
                                                                       out=str(folder), overwrite=overwrite)))
        assert "holds a model" in line, line
        assert sorted(p.name for p in folder.iterdir()) == before
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"benchmark": "aime24", "id": 0, "answers": ["1"], "response": "\\boxed{1}"}) + "\n")
    for overwrite in (False, True):  # a regrade too
        line = refused(capsys, lambda: eval_cli.main(eval_cli.EvalArgs(regrade=str(samples), out=str(folder),
                                                                       overwrite=overwrite)))
        assert "holds a model" in line and sorted(p.name for p in folder.iterdir()) == before, line


# ----------------------------------------------------------------------------------------------
# A second Ctrl-C while a run unwinds the first
# ----------------------------------------------------------------------------------------------
SECOND_SIGINT = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from machinery import checkpoints, report
def save(*args, **kwargs):  # the first Ctrl-C lands in the first save
    os.kill(os.getpid(), signal.SIGINT)
close = report.RunLog.close
def closing(self):  # the second while the run closes its logs on the way out
    os.kill(os.getpid(), signal.SIGINT)
    close(self)
checkpoints.save, report.RunLog.close = save, closing
sys.argv = [{program!r}, *{argv!r}]
runpy.run_path({program!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_two_quick_ctrl_c_during_the_first_save_say_what_is_kept(tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    script = SECOND_SIGINT.format(root=str(ROOT), program=str(ROOT / "remix.py"),
                                  argv=tiny_cli(tiny_model, train_file, out, "--steps", "2", "--save-every", "1"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stderr.strip().splitlines() if line.strip() and "%|" not in line]
    assert done.returncode == 130 and lines == ["remix: interrupted at step 1; the last checkpoint is none yet; "
                                                "nothing to resume"], done.stderr[-3000:]
