"""The grader's worker processes keep the promises a pool forked from the trainer broke (issue 57): a worker that dies
idle is replaced; a worker inherits no descriptor, lock or thread of the trainer and ends with it, a kill -9 included;
a reward may compute with torch; the trainer's later writes cost the workers no memory; a replacement starts whatever
another thread of the trainer holds; a hangup or Ctrl-C prints one line; nothing is graded in the trainer's process,
so its interval timer survives; no warnings filter is left behind; a method file without a main guard is refused."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, HERE)

import remix  # noqa: E402
from machinery import grader, report, runfolder  # noqa: E402

pytestmark = pytest.mark.slow


def children() -> list[int]:
    """The pids of this process's children (the grader's workers among them)."""
    found = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            found += [int(pid) for pid in f.read().split()]
    return found


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    """A module of worker functions in its own file, importable in the workers."""
    (tmp_path / "tasks.py").write_text(textwrap.dedent("""
        import os, sys, time

        def pid(x):
            return os.getpid()

        def fds(x):
            return {int(fd): os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                    if os.path.exists(f"/proc/self/fd/{fd}")}

        def rss_mib(x):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

        def matmul(n):
            import torch
            a = torch.ones(n, n)
            return float((a @ a)[0, 0])

        def shout(x):
            print("a warning on stderr", file=sys.stderr, flush=True)
            return x

        def nap(x):
            time.sleep(x)
            return x
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import tasks
    grader.close_pool()
    yield tasks
    grader.close_pool()


def test_a_worker_killed_while_idle_is_replaced_and_the_next_call_is_answered(helpers):
    """1a: a SIGKILL between two gradings (the OOM killer): the next call gets every answer from a new worker."""
    first = grader.map_with_deadline(helpers.pid, [(0,)], 1, 30.0, "timeout")[0]
    assert first in children()
    os.kill(first, signal.SIGKILL)
    time.sleep(0.5)
    assert grader.map_with_deadline(helpers.matmul, [(3,), (4,)], 1, 30.0, "timeout") == [3.0, 4.0]
    assert grader.map_with_deadline(helpers.pid, [(0,)], 1, 30.0, "timeout")[0] not in (first, "timeout")


def test_a_worker_holds_no_descriptor_of_the_trainer_its_lock_included(helpers, tmp_path):
    """1b: --out locked and a file open here; a worker's descriptors are its two pipes and stderr, nothing else."""
    out = tmp_path / "run"
    runfolder.lock(str(out))
    with open(tmp_path / "open.txt", "w"):
        held = grader.map_with_deadline(helpers.fds, [(0,)], 1, 30.0, "timeout")[0]
    targets = set(held.values())
    assert not any(str(tmp_path) in target for target in targets), held  # neither the lock nor the open file
    assert set(held) - {0, 1, 2} <= {3}, held  # stdin, the protocol's copy of stdout, stderr (and listdir's own)


KILLED = """
import sys, time
sys.path[:0] = [{here!r}, {tasks!r}]
from machinery import grader, runfolder
import tasks
runfolder.lock({out!r})
print("locked", flush=True)
grader.map_with_deadline(tasks.nap, [(600,), (600,)], 2, 900.0, None)
"""


def test_a_kill_9_of_the_trainer_ends_its_workers_and_frees_its_run_folder(helpers, tmp_path):
    """1b: the trainer killed with SIGKILL mid-grading: its workers die with it, and --out can be locked at once."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", KILLED.format(here=HERE, tasks=str(tmp_path), out=str(out))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    deadline = time.time() + 120
    while len(workers := open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()) < 2:
        assert time.time() < deadline
        time.sleep(0.1)
    time.sleep(3)  # both inside their 600 s naps
    proc.kill()
    proc.wait()
    time.sleep(1)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists() and "Z" not in
             open(f"/proc/{pid}/stat").read().split(")")[1].split()[0]]
    assert alive == [], alive
    code = f"import sys; sys.path.insert(0, {HERE!r}); from machinery import runfolder; runfolder.lock({str(out)!r})"
    locked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert locked.returncode == 0, locked.stderr


def test_a_reward_may_compute_with_torch_after_the_trainer_did(helpers):
    """1c: the trainer's OpenMP threads running (a matmul here first); a 1500 x 1500 matmul in a worker is answered
    (0.2 s in a clean process) well within a 20 s deadline, never the timeout's answer."""
    import torch
    torch.ones(1500, 1500) @ torch.ones(1500, 1500)
    assert grader.map_with_deadline(helpers.matmul, [(1500,)], 1, 20.0, "timeout") == [1500.0]


def test_the_trainers_memory_is_not_the_workers(helpers):
    """1d: 512 MiB of tensors here, written after the workers started: a worker's resident memory holds none of it."""
    import torch
    grader.map_with_deadline(helpers.pid, [(0,)], 1, 30.0, "timeout")
    big = torch.zeros(128, 1024, 1024)  # 512 MiB
    big += 1  # touched: every page resident here
    assert grader.map_with_deadline(helpers.rss_mib, [(0,)], 1, 30.0, "timeout")[0] < 256
    del big


def test_a_replacement_starts_while_another_thread_holds_a_stream_lock(helpers, monkeypatch):
    """1e: a thread of the trainer blocked in a write to stderr (its lock held); a worker past its deadline is replaced
    and the replacement's first write to stderr comes back at once."""
    read, write = os.pipe()
    blocked = os.fdopen(write, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", blocked)

    def write():
        try:
            blocked.write("x" * (1 << 20))
        except OSError:  # the pipe closed at the test's end
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()  # blocks: nobody reads the pipe, and the stream's lock stays held
    time.sleep(0.5)
    try:
        assert grader.map_with_deadline(helpers.nap, [(30,)], 1, 1.0, "timeout") == ["timeout"]  # replaced
        assert grader.map_with_deadline(helpers.shout, [(7,)], 1, 20.0, "timeout") == [7]
    finally:
        os.close(read)  # the writer's write fails now, and it ends
        writer.join(10)


HANGUP = """
import sys, time
sys.path[:0] = [{here!r}, {tasks!r}]
from machinery import console, grader, runner
import tasks
def program():
    console.catch_interrupts()
    grader.map_with_deadline(tasks.nap, [(0.1,), (0.1,)], 2, 900.0, None)
    print("graded", flush=True)
    time.sleep(600)  # training or generating: the workers wait for the next grading
console._state["prog"] = "prog"  # what a program's first call, console.one_line_interrupts("prog"), sets
runner.main(program)
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_hangup_or_ctrl_c_of_the_terminals_group_is_one_line(helpers, tmp_path, signum, code):
    """1f: the signal sent to the whole process group, as a terminal sends it, while the workers wait between two
    gradings: one line, the signal's exit code, no traceback (from the workers either), no worker left."""
    proc = subprocess.Popen([sys.executable, "-c", HANGUP.format(here=HERE, tasks=str(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "graded"
    workers = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    assert len(workers) == 2
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("prog: "), err
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_grading_never_runs_in_the_trainer_so_its_interval_timer_survives(helpers):
    """1g: a timer armed around the run (ITIMER_REAL, as gpu_check arms one per part); math-verify's signal.alarm in a
    grading here would clear it. After a grading it is still armed, and the method's parse ran nowhere here."""
    remix.parse_boxed.cache_clear()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 600.0)
    try:
        assert report.grade_many(remix.METHOD, [("so \\boxed{\\frac{1}{2}}", ["0.5"])]) == [(1.0, "ok")]
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 500
        assert remix.parse_boxed.cache_info().currsize == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_no_warnings_filter_is_left_by_the_grader():
    """1h: importing the grader and grading leaves warnings.filters as it was: fork's DeprecationWarning is not hidden."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        before = list(warnings.filters)
        grader.map_with_deadline(len, [("ab",)], 1, 30.0, "timeout")
        assert warnings.filters == before
    assert not any(f[1] is not None and f[1].search("multi-threaded, use of fork() may lead to deadlocks")
                   for f in warnings.filters)
    grader.close_pool()


def test_a_method_file_without_a_main_guard_is_refused_in_one_line_before_anything_is_written(tiny_model, train_file,
                                                                                             tmp_path):
    """A fork whose run starts at import (no `if __name__ == "__main__":`) cannot work with workers that import the
    method's file: one line naming the fix, exit 2, and no --out made."""
    from tests.common import ROOT, one_error_line, run_remix, tiny_cli

    source = (ROOT / "remix.py").read_text()
    guarded = 'if __name__ == "__main__":\n    runner.main(lambda: train(runner.cli(Args)))\n'
    assert guarded in source
    fork = tmp_path / "remix_unguarded.py"
    fork.write_text(source.replace(guarded, "runner.main(lambda: train(runner.cli(Args)))\n"))
    out = tmp_path / "run"
    done = run_remix(*tiny_cli(tiny_model, train_file, out, "--steps", "1"), program=str(fork),
                     env={"PYTHONPATH": str(ROOT)})
    one_error_line(done, 'starts a run when imported, and the grader\'s workers import it: put the run under '
                         '`if __name__ == "__main__":`')
    assert not out.exists()


def test_a_worker_killed_while_it_warms_up_is_replaced(helpers):
    """A SIGKILL of a worker still running its warm-up (a 3 s import): a new worker warms up and answers; a warm-up
    that fails by itself still stops the call with its error."""
    def killer():
        deadline = time.time() + 60
        while time.time() < deadline and not children():
            time.sleep(0.05)
        time.sleep(0.5)  # inside the warm-up's nap
        for pid in children():
            os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=killer)
    thread.start()
    assert grader.map_with_deadline(helpers.pid, [(0,)], 1, 30.0, "timeout", helpers.nap, (3,))[0] in children()
    thread.join()
    with pytest.raises(RuntimeError, match="failed in a worker process: ValueError"):
        grader.map_with_deadline(helpers.pid, [(0,)], 1, 30.0, "timeout", int, ("not a number",))
