"""What a program takes from places it does not control: the folder it is run from (its Python files are never
imported, by the program or by the grader's workers), the signals its parent set to be ignored (nohup's SIGHUP stays
ignored), and datasets and chat templates built to break it (an integer too long to read, JSON nested past Python's
recursion limit, broken Unicode, a template that raises or never ends): each of those ends in one line and exit 2
before anything is written.

    pytest -q tests/test_untrusted_input.py
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.common import ROOT, load_problems, read_metrics, run_remix, tiny_cli  # noqa: E402


# ----------------------------------------------------------------------------------------------
# The working directory is not on sys.path
# ----------------------------------------------------------------------------------------------
PLANTED = ("tyro", "sympy", "select")  # imported by remix.py, by math-verify, by the grader itself


def plant(folder):
    """Modules in a folder that, if ever imported, leave a file named after themselves there."""
    folder.mkdir()
    for name in PLANTED:
        (folder / f"{name}.py").write_text(
            f"import os\nopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'IMPORTED-{name}'), 'w')\n")
    return folder


@pytest.mark.slow
def test_python_files_in_the_folder_a_user_runs_from_are_never_imported(tiny_model, train_file, tmp_path):
    cwd = plant(tmp_path / "downloaded-model")
    out = tmp_path / "run"
    trained = run_remix(*tiny_cli(tiny_model, train_file, out, "--steps", "2"), cwd=cwd)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    samples = tmp_path / "samples.jsonl"  # a regrade grades in the same workers: the answers are known
    samples.write_text("".join(json.dumps({"benchmark": "aime24", "id": i, "answers": [gold], "response": response})
                               + "\n" for i, (gold, response) in enumerate([("0.5", "so \\boxed{\\frac{1}{2}}"),
                                                                           ("204", "\\boxed{205}")])))
    graded = run_remix("--regrade", str(samples), "--out", str(tmp_path / "eval"), cwd=cwd, program="eval.py")
    assert graded.returncode == 0, graded.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["greedy"]["aime24"]["pass@1"] == 50.0 and summary["greedy"]["aime24"]["grader_failures"] == 0
    assert sorted(p.name for p in cwd.iterdir()) == sorted(f"{name}.py" for name in PLANTED)


# ----------------------------------------------------------------------------------------------
# A fork's folder never shadows an installed package or the machinery
# ----------------------------------------------------------------------------------------------
BESIDE = ("json", "torch", "sympy", "select", "pickle")  # the fork's imports, math-verify's, the grader's


def fork_folder(folder, method: str = "fork_task.py", source: str | None = None, beside=BESIDE, machinery=True):
    """A fork's folder: the fork (method), a helper module of its own it imports by name, and beside them modules
    named after installed ones (and a machinery package) that, if ever imported, leave a file named after
    themselves there and break what imported them."""
    folder.mkdir()
    for name in beside:
        (folder / f"{name}.py").write_text(
            f"import os\nopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'IMPORTED-{name}'), 'w')\n"
            f"raise ImportError('{name}.py beside the fork was imported')\n")
    if machinery:
        (folder / "machinery").mkdir()
        (folder / "machinery" / "__init__.py").write_text(
            "import os\nopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'IMPORTED-machinery'), "
            "'w')\n")
    (folder / "forkhelper.py").write_text("BONUS = 7\n")
    (folder / method).write_text(source or "import json\n\nimport forkhelper\n\n\ndef task(x):\n"
                                           "    return json.dumps({'x': x, 'bonus': forkhelper.BONUS})\n")
    return folder


def imported_beside(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("IMPORTED-"))


def test_a_grader_worker_puts_a_forks_folder_after_the_installed_packages(tmp_path, monkeypatch):
    """Issue 43: a worker put the task's folder first on sys.path (its start and resolve()), so a json.py beside a
    fork ran in the worker, and a machinery/ there broke it. The folder is first here, as `python FOLDER/fork.py` puts
    it; each worker, a fresh interpreter, puts it last on its own sys.path before it imports the fork. The fork's
    helper, imported by name, still works, and nothing planted beside it is imported."""
    import importlib.util

    from machinery import grader

    folder = fork_folder(tmp_path / "fork")
    monkeypatch.setattr(sys, "path", [str(folder), *sys.path])  # as Python puts a script's folder: first
    spec = importlib.util.spec_from_file_location("fork_task", folder / "fork_task.py")
    fork = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork)
    try:
        answers = grader.map_with_deadline(fork.task, [(1,), (2,)], 2, 60.0, "timeout", warm=fork.task, warm_args=(0,))
    finally:
        grader.close_pool()
    assert [json.loads(a) for a in answers] == [{"x": 1, "bonus": 7}, {"x": 2, "bonus": 7}]
    assert imported_beside(folder) == []


def fork_with_helper(where: str, line: str) -> str:
    """remix.py with `import forkhelper` and one line at the start of the function where (a fork that uses a module
    of its own in its grader workers)."""
    source = (ROOT / "remix.py").read_text().replace("import torch\n", "import torch\n\nimport forkhelper\n", 1)
    head = next(l for l in source.splitlines(keepends=True) if l.startswith(f"def {where}("))
    body = source[source.index(head) + len(head):]
    docstring_end = body.index('"""', body.index('"""') + 3) + 4
    return source.replace(head + body[:docstring_end], head + body[:docstring_end] + f"    {line}\n", 1)


@pytest.mark.long
@pytest.mark.slow
def test_eval_method_grades_with_the_forks_helper_and_never_a_module_beside_it(tmp_path):
    """eval.py --method FOLDER/remix_mine.py: the fork's answer check (every answer right, by its helper's number)
    runs in the workers, and no torch.py, json.py, sympy.py, math_verify.py, ... in FOLDER is imported by eval.py or
    by them."""
    source = fork_with_helper("grade_response", "return (1.0 if forkhelper.BONUS == 7 else 0.0), 'ok'  # fork")
    folder = fork_folder(tmp_path / "fork", "remix_mine.py", source, (*BESIDE, "math_verify"))
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"benchmark": "aime24", "id": i, "answers": [gold], "response": response})
                               + "\n" for i, (gold, response) in enumerate([("0.5", "so \\boxed{\\frac{1}{2}}"),
                                                                           ("204", "\\boxed{205}")])))
    graded = run_remix("--method", str(folder / "remix_mine.py"), "--regrade", str(samples), "--out",
                       str(tmp_path / "eval"), cwd=tmp_path, program="eval.py")
    assert graded.returncode == 0, graded.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["greedy"]["aime24"]["pass@1"] == 100.0 and imported_beside(folder) == []


@pytest.mark.long
@pytest.mark.slow
def test_a_fork_run_from_its_folder_rewards_by_its_helper_and_never_a_module_beside_it(tiny_model, train_file,
                                                                                       tmp_path):
    """`cd FOLDER; python remix_mine.py ...`: Python puts FOLDER first in the main process (its own doing, and the
    fork docs' remedy is python -P); the grader's workers, which alone import math-verify, put it last: the fork's
    reward part from its helper is logged, a math_verify.py beside it never runs."""
    source = fork_with_helper("training_reward", "return {'helper': float(forkhelper.BONUS)}, 'ok'  # fork")
    folder = fork_folder(tmp_path / "fork", "remix_mine.py", source, ("math_verify", "latex2sympy2_extended"),
                         machinery=False)
    # the fork's working copy: the machinery beside it, as toy.py makes one
    shutil.copytree(ROOT / "machinery", folder / "machinery", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "run"
    done = run_remix(*tiny_cli(tiny_model, train_file, out, "--steps", "1"), cwd=folder,
                     program=folder / "remix_mine.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_metrics(out)[0]["reward/helper"] == 7.0 and imported_beside(folder) == []


@pytest.mark.long
@pytest.mark.slow
def test_python_dash_p_keeps_a_forks_folder_last_in_the_main_process_too(tiny_model, train_file, tmp_path):
    """The fork docs' remedy for the main process, which remix cannot help (Python put the script's folder first
    before its first line): a json.py beside FOLDER/remix_mine.py breaks `python FOLDER/remix_mine.py`; `python -P`,
    the machinery found by PYTHONPATH, runs the fork with its helper (FOLDER last on sys.path) and never the json.py."""
    source = fork_with_helper("training_reward", "return {'helper': float(forkhelper.BONUS)}, 'ok'  # fork")
    folder = fork_folder(tmp_path / "fork", "remix_mine.py", source, ("json", "math_verify"), machinery=False)
    argv = tiny_cli(tiny_model, train_file, tmp_path / "run", "--steps", "1")
    plain = run_remix(*argv, program=folder / "remix_mine.py", env={"PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert plain.returncode == 1 and "json.py beside the fork was imported" in plain.stderr, plain.stderr[-2000:]
    (folder / "IMPORTED-json").unlink()
    remedy = subprocess.run([sys.executable, "-P", str(folder / "remix_mine.py"), *argv], capture_output=True,
                            text=True, cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)))
    assert remedy.returncode == 0, remedy.stderr[-3000:]
    assert read_metrics(tmp_path / "run")[0]["reward/helper"] == 7.0 and imported_beside(folder) == []


# ----------------------------------------------------------------------------------------------
# An inherited ignore is kept
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_started_under_nohup_outlives_sighup(tiny_model, train_file, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "remix.py"), *tiny_cli(tiny_model, train_file, out,
                                                                               "--steps", "3")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # what nohup does
    deadline, sent = time.time() + 300, 0
    while proc.poll() is None:  # hang-ups all through: while torch imports, while loading, while training
        assert time.time() < deadline
        proc.send_signal(signal.SIGHUP)
        sent += 1
        time.sleep(0.2)
    _, err = proc.communicate()
    assert proc.returncode == 0 and sent > 10, err[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


# ----------------------------------------------------------------------------------------------
# Datasets built to break the reader
# ----------------------------------------------------------------------------------------------
GOOD_ROW = '{"problem": "What is 1+1?", "answer": "2"}\n'
HUGE = "9" * 5000  # Python reads at most 4300 digits into an int


@pytest.mark.parametrize("case, text, message", [
    ("huge-integer", GOOD_ROW + '{"problem": "p", "answer": ' + HUGE + '}\n', "line 2 holds an integer of over 4300"),
    ("huge-integer-document", '[\n' + GOOD_ROW + ',\n{"problem": "p",\n "answer": ' + HUGE + '}\n]\n',
     "holds an integer of over 4300 digits"),
    ("huge-integer-first-line", '{"problem": "p", "answer": ' + HUGE + '}\n' + GOOD_ROW, "line 1 holds an integer"),
    ("deep", GOOD_ROW + '{"problem": "p", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + '}\n',
     "line 2 nests lists or objects deeper than Python reads"),
    ("deep-document", "[" * 100_000 + "]" * 100_000, "nests lists or objects deeper than Python reads"),
    ("lone-surrogate", GOOD_ROW + '{"problem": "What is \\ud800 + 1?", "answer": "2"}\n',
     "row 2 holds a lone surrogate"),
    ("lone-low-surrogate-in-a-list", GOOD_ROW + '{"problem": "p", "answer": "2", "also": ["\\udfff"]}\n',
     "row 2 holds a lone surrogate"),
])
def test_a_dataset_python_cannot_read_or_encode_stops_in_one_line_before_anything_is_written(
        case, text, message, tiny_model, tmp_path, capsys):
    import remix
    from tests.common import tiny_args

    path = tmp_path / "d.jsonl"
    path.write_text(text)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(tiny_model, str(path), out))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("remix: error: dataset ") \
        and message in err[0] and str(path) in err[0], err
    assert not out.exists()


def test_a_benchmark_file_with_a_lone_surrogate_is_refused_before_eval_writes(tiny_model, tmp_path, capsys):
    import eval as eval_cli

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "aime24.jsonl").write_text(GOOD_ROW + '{"problem": "\\udc00", "answer": "2"}\n')
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(eval_cli.EvalArgs(model=tiny_model, benchmarks=("aime24",), data_dir=str(bench), sampler="hf",
                                        out=str(out)))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "row 2 holds a lone surrogate" in err[0], err
    assert not out.exists()


def test_paired_surrogate_escapes_are_text_and_load(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "smile \\ud83d\\ude00: 1+1?", "answer": "2"}\n')
    assert load_problems(str(path), "problem", "answer") == [("smile \U0001F600: 1+1?", "2")]


def test_line_separators_inside_a_rows_strings_are_text(tmp_path):
    """JSON lines end at a newline alone: U+2028, U+2029 and U+0085 written raw inside a string (json.dumps with
    ensure_ascii=False) are the string's characters, not ends of lines."""
    path = tmp_path / "d.jsonl"
    rows = [{"problem": f"1+1?{sep}", "answer": "2"} for sep in ("\u2028", "\u2029", "\x85")]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\r\n" for row in rows), encoding="utf-8")
    assert load_problems(str(path), "problem", "answer") == [(row["problem"], "2") for row in rows]


@pytest.mark.parametrize("text", ["{", "[" * 100_000 + "]" * 100_000, "[1, 2]"])
def test_an_evaluations_damaged_settings_are_one_line_and_nothing_is_written(text, tiny_model, tmp_path, capsys,
                                                                             monkeypatch):
    """eval.py continuing an --out whose settings.json is not JSON, nested past Python's recursion limit, or no
    object: one line that says what to do, exit 2, the folder as it was."""
    import eval as eval_cli
    from machinery import console

    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    out = tmp_path / "eval"
    out.mkdir()
    (out / "settings.json").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(eval_cli.EvalArgs(model=str(tiny_model), out=str(out), limit=1, sampler="hf"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [f"eval: error: {out / 'settings.json'} is damaged (not a JSON object "
                                                 f"of settings); choose another --out, or pass --overwrite"], err
    assert sorted(p.name for p in out.iterdir()) == ["settings.json"]


# ----------------------------------------------------------------------------------------------
# Chat templates built to break the prompt
# ----------------------------------------------------------------------------------------------
TEMPLATES = {
    "raise_exception": ("{{ raise_exception('no user turns here') }}", "TemplateError: no user turns here"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
    "undefined": ("{{ messages[0].nothing.deeper }}", "UndefinedError"),
    "syntax": ("{% for %}", "TemplateSyntaxError"),
    "python-error": ("{{ messages | length / 0 }}", "ZeroDivisionError"),
    "endless": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                "rendered one prompt for over 5 s"),
}


def model_with_template(tiny_model, folder, template: str) -> str:
    shutil.copytree(tiny_model, folder)
    (folder / "chat_template.jinja").write_text(template)
    return str(folder)


@pytest.mark.parametrize("program", ["remix", "eval"])
@pytest.mark.parametrize("case", list(TEMPLATES))
def test_a_chat_template_that_raises_or_never_ends_stops_in_one_line_before_anything_is_written(
        program, case, tiny_model, train_file, tmp_path, capsys, monkeypatch):
    import eval as eval_cli
    import remix
    from machinery import console
    from tests.common import tiny_args

    monkeypatch.setitem(console._state, "prog", program)  # what the program's one_line_interrupts sets
    template, message = TEMPLATES[case]
    model, out = model_with_template(tiny_model, tmp_path / "model", template), tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        if program == "remix":
            remix.train(tiny_args(model, train_file, out))
        else:
            eval_cli.main(eval_cli.EvalArgs(model=model, benchmarks=("aime24",), limit=2, sampler="hf", out=str(out)))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(f"{program}: error: the chat template of "
                                                                              f"{model!r}") and message in err[0], err
    assert time.monotonic() - start < 30 and not out.exists()


class OuterDeadline(Exception):
    """What an outer timer's handler raises (gpu_check's PartTimeout, for one)."""


def test_an_outer_timer_survives_the_template_guard(tiny_model, tmp_path):
    """The guard's own deadline once ended by setting the process's timer to 0, cancelling any outer one (gpu_check's
    limit on each part). An outer timer due after a render fires then, once, with its own handler; one due during a
    render (a template that never ends) fires there, and what its handler raises comes out as it is, not as the
    template's failure; the guard leaves no timer and no handler of its own behind."""
    from machinery import data
    from machinery.data import load_tokenizer
    import remix

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    try:
        tokenizer = load_tokenizer(tiny_model)
        encode = data.template_guard(lambda problem: remix.build_prompt(tokenizer, problem), tiny_model)
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        assert encode("What is 1 + 1?") and not fired
        assert 0.5 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1.0  # counting down, from where it was
        while not fired and time.monotonic() - start < 3:
            time.sleep(0.02)
        assert len(fired) == 1 and 0.9 < fired[0] - start < 2.0

        endless = load_tokenizer(model_with_template(tiny_model, tmp_path / "model", TEMPLATES["endless"][0]))
        encode = data.template_guard(lambda problem: remix.build_prompt(endless, problem), tiny_model)

        def outer_deadline(signum, frame):
            raise OuterDeadline
        signal.signal(signal.SIGALRM, outer_deadline)
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(OuterDeadline):
            encode("What is 1 + 1?")
        assert time.monotonic() - start < 2.0  # the outer's 0.3 s, not the guard's 5
        assert signal.getsignal(signal.SIGALRM) is outer_deadline and signal.getitimer(signal.ITIMER_REAL) == (0, 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
