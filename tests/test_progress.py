"""Progress on the long waits (machinery.console, on tqdm): the plain lines a log file gets (how often, and their
numbers: done of total, the elapsed time and the time left at the rate measured so far), a terminal's redrawn line,
the bar vLLM's generate takes, and the line of each training step. A fake clock stands in for time: no assert depends
on how fast anything runs.

    pytest -q tests/test_progress.py
"""

import io
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def test_vllms_bar_counts_each_requests_responses_and_shows_its_speed(clock):
    stream = io.StringIO()
    prompts = [[1, 2], [3]]
    bar_of = console.engine_progress("evaluation at step 25", 2)
    assert bar_of(prompts, desc="Rendering prompts") is prompts  # vLLM's first call: passed through
    bar = console.engine_progress("evaluation at step 25", 2, stream=stream)(total=50, desc="Processed prompts",
                                                                              dynamic_ncols=True, postfix="")
    for _ in range(40):  # vLLM counts each finished request's 2 responses
        clock.now += 1.0
        bar.postfix = "est. speed input: 812.00 toks/s, output: 1234.56 toks/s"
        bar.update(2)
    bar.close()
    assert bar.total == 100 and bar.n == 80  # 50 requests of 2 responses each
    assert "| 60/100 [00:30<00:20," in lines(stream)[1] and "output: 1234.56 toks/s" in lines(stream)[1], lines(stream)


def test_only_the_first_process_prints(clock, monkeypatch):
    monkeypatch.setitem(console._state, "rank", 1)
    stream = io.StringIO()
    bar = console.progress("evaluation at step 25", 10, stream=stream)
    for _ in range(10):
        clock.now += 40.0
        bar.update(1)
    bar.close()
    assert stream.getvalue() == ""
    assert console.engine_progress("evaluation", 2) is False  # vLLM's own bar would divide by its 0 s elapsed


def test_a_steps_line_names_each_phase_and_the_time_left_to_steps():
    # resumed after step 10: 2 steps here in 20 s -> 10 s a step, 338 to go -> 3380 s
    line = console.step_line(12, 350, {"gen": 1.234, "trainer": 6.5, "weight_sync": 0.25}, 8.1, 0.4567, 2, 20.0)
    assert line == ("step 12/350: gen 1.2s, trainer 6.5s, weight_sync 0.2s, eval 0.0s; step 8.1s; reward 0.457; "
                    "56m20s left")
    assert console.step_line(350, 350, {}, 1.0, 0.0, 5, 50.0).endswith("0s left")


if __name__ == "__main__":
    os.execvp(sys.executable, [sys.executable, "-m", "pytest", "-q", __file__])
