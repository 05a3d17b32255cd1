"""Progress on the long waits (machinery.console, on tqdm): the plain lines a log file gets (how often, tqdm's monitor
thread included, none twice, and their numbers: done of total, the elapsed time and the time left at the rate
measured so far), a terminal's redrawn line (a real pty's too), the real vLLM CPU engine's bar with n responses a
problem, and the line of each training step (its time left without the first step's warm-up). A fake clock stands in
for time: no assert depends on how fast anything runs.

    pytest -q tests/test_progress.py
"""

import io
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from machinery import console  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    import tqdm.std

    fake = Clock()
    monkeypatch.setattr(tqdm.std, "time", fake)  # what each bar reads its time from
    return fake


def lines(stream) -> list[str]:
    return stream.getvalue().splitlines()


def test_durations_read_as_hours_minutes_seconds():
    assert [console.duration(s) for s in (0, 7.4, 59.6, 190, 3600, 3725, 90061)] == \
        ["0s", "7s", "1m00s", "3m10s", "1h00m", "1h02m", "25h01m"]


def test_a_log_gets_a_plain_line_every_30_s_with_the_time_left_at_the_measured_rate(clock):
    stream = io.StringIO()
    bar = console.progress("evaluation at step 25", 100, stream=stream)
    for _ in range(100):  # 2 s a problem: 30 s is 15 problems
        clock.now += 2.0
        bar.update(1)
    bar.close()
    said = lines(stream)
    assert all("\r" not in line and line.startswith("remix: evaluation at step 25: ") for line in said), said
    assert [re.search(r"\| (\d+/\d+) \[", line).group(1) for line in said[:-1]] == \
        ["0/100", "15/100", "30/100", "45/100", "60/100", "75/100", "90/100"]  # at the start, then one per 30 s
    # at 30 of 100 after 60 s: 0.5 problems a second, 70 to go -> 2m20s left
    assert "30/100 [01:00<02:20,  2.00s/ problems]" in said[2], said[2]
    assert said[-1].endswith("100/100 [03:20<00:00,  2.00s/ problems]"), said[-1]


def test_the_time_left_follows_a_rate_that_changes(clock):
    stream = io.StringIO()
    bar = console.progress("evaluation at step 25", 40, stream=stream)
    for _ in range(4):  # 4 problems in 4 s
        clock.now += 1.0
        bar.update(1)
    for _ in range(4):  # then 4 in 60 s: 8 in 64 s, 8 s a problem, 32 to go -> 256 s
        clock.now += 15.0
        bar.update(1)
    assert "8/40 [01:04<04:16," in str(bar), str(bar)
    bar.close()


def test_a_terminal_redraws_one_line_and_ends_it(clock):
    stream = Terminal()
    bar = console.progress("evaluation at step 25", 10, stream=stream)
    for _ in range(10):
        clock.now += 2.0
        bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") >= 10
    assert "\rremix: evaluation at step 25:  90%|" in text and "| 9/10 [00:18<00:02," in text


def counts(said: list[str]) -> list[str]:
    """Each progress line's 'done/total'."""
    return [re.search(r"\| (\d+/\d+) \[", line).group(1) for line in said]


def seconds(said: list[str]) -> list[int]:
    """Each progress line's elapsed time, '[01:30<...' -> 90."""
    return [int(m[1]) * 60 + int(m[2]) for m in (re.search(r" \[(\d+):(\d+)<", line) for line in said)]


@pytest.mark.long
@pytest.mark.slow
def test_vllms_bar_counts_every_response_of_n_a_problem_to_its_end_once(tiny_model, capsys):
    """The real CPU engine, 3 problems of 4 responses: vLLM hands its bar its count of requests (each response one,
    in this vLLM) and adds a problem's n at a time; the bar counts the 12 responses, its last line once."""
    from transformers import AutoTokenizer

    import remix
    from machinery import dist, engines

    dist.init()
    args = remix.finalize_args(console.settings(remix.Args, model=tiny_model, max_prompt_tokens=64,
                                                max_response_tokens=8))
    llm, tokenizer = engines.start(args), AutoTokenizer.from_pretrained(tiny_model)
    capsys.readouterr()
    try:
        out = engines.generate(llm, tokenizer, [[65, 66], [67], [68, 69, 70]], 4, 0.6, 1.0, 8, seed=1,
                               label="evaluation at step 25")
    finally:
        engines.stop(llm)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("remix: evaluation at step 25")]
    assert [len(group) for group in out] == [4, 4, 4]
    assert counts(said)[0] == "0/12" and counts(said)[-1] == "12/12" and "100%" in said[-1], said
    assert len(set(counts(said))) == len(said), said  # no line twice (vLLM refreshes its bar before closing it)
    assert "est. speed input: " in said[-1]  # vLLM's own measure


def test_a_logs_lines_come_30_s_apart_with_tqdms_monitor_thread_and_none_twice(clock, monkeypatch):
    """tqdm's monitor thread refreshes a bar left unprinted for its maxinterval (10 s by default): in a log, a line
    10 s after each 30-s one. Its clock is the fake one here, and it wakes every 10 ms."""
    import time

    import tqdm._monitor
    import tqdm.std

    monkeypatch.setattr(tqdm._monitor, "time", clock)
    if tqdm.std.tqdm.monitor is not None:  # one started with the real clock and a 10-s nap
        tqdm.std.tqdm.monitor.exit()
    monkeypatch.setattr(tqdm.std.tqdm, "monitor", None)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0.01)
    stream = io.StringIO()
    bar = console.progress("evaluation at step 25", 100, stream=stream)
    try:
        for _ in range(100):  # 1 s a problem
            clock.now += 1.0
            bar.update(1)
            time.sleep(0.02)  # the monitor's turn
        bar.close()
    finally:
        tqdm.std.tqdm.monitor.exit()
    said = lines(stream)
    assert seconds(said)[0] == 0 and seconds(said)[-1] == 100 and counts(said)[-1] == "100/100", said
    assert all(b - a >= 30 for a, b in zip(seconds(said), seconds(said)[1:-1])), said  # the last may come sooner
    assert len(set(counts(said))) == len(said), said


def test_a_terminal_that_reports_no_width_shows_the_bar(tmp_path):
    """A pty says 0 columns until a terminal sets its size (script(1) with no terminal around it, a CI runner): tqdm
    would draw an empty line there. A real pty, the bar in another process (stdout its only terminal)."""
    import subprocess

    code = ("from machinery import console\nbar = console.progress('evaluation at step 25', 6, 'responses')\n"
            "for _ in range(6):\n    bar.update(1)\nbar.close()\n")
    leader, follower = os.openpty()
    assert os.get_terminal_size(follower).columns == 0
    with os.fdopen(leader, "rb", buffering=0) as terminal:
        done = subprocess.run([sys.executable, "-c", code], stdout=follower, stderr=follower, timeout=120,
                              cwd=Path(__file__).resolve().parent.parent)
        os.close(follower)
        text = b""
        while True:
            try:
                chunk = terminal.read(65536)
            except OSError:  # EIO: the other end closed and read to its end
                break
            if not chunk:
                break
            text += chunk
    text = text.decode()
    assert done.returncode == 0, text
    assert "remix: evaluation at step 25: 100%|" in text and "| 6/6 [" in text, repr(text)


@pytest.mark.long
def test_the_time_left_leaves_out_the_first_steps_warm_up(tiny_model, train_file, tmp_path, monkeypatch, capsys):
    """A first step 1e6 s longer than the others (an engine's warm-up, a first compile): after step 2 the time left
    is step 2's own pace times the step to go (under an hour), not the warm-up spread over them (hundreds of hours);
    after step 1 it is not known yet."""
    import time

    import remix
    from machinery import runner
    from tests.common import tiny_args

    class Shifted:  # the runner's time module, whose clock jumps 1e6 s as step 1 ends
        offset = 0.0

        def __getattr__(self, name):
            return getattr(time, name)

        def perf_counter(self):
            return time.perf_counter() + self.offset

    clock = Shifted()
    monkeypatch.setattr(runner, "time", clock)
    remix.train(tiny_args(tiny_model, train_file, tmp_path / "run", prompts_per_step=5, max_response_tokens=8),
                on_step=lambda step, *ignored: setattr(clock, "offset", 1e6 if step == 1 else clock.offset))
    said = {line.split(":")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if re.match(r"remix: step \d/3:", line)}
    assert said["step 1/3"].endswith("; time left unknown yet"), said
    assert re.search(r"; (\d+m)?\d+s left$", said["step 2/3"]), said  # no hours
    assert said["step 3/3"].endswith("; 0s left"), said


if __name__ == "__main__":
    os.execvp(sys.executable, [sys.executable, "-m", "pytest", "-q", __file__])
