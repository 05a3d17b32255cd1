"""Progress on the long waits (machinery.console): the lines a log file gets (how often, and their numbers: done of
total, tokens per second, a time left from the measured rate), a terminal's redrawn line, vLLM's bar adapter, and
the line of each training step. A fake clock stands in for time: no assert depends on how fast anything runs.

    pytest -q tests/test_progress.py
"""

import io
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machinery import console  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def meter(total: int, tty: bool = False, **kwargs):
    clock, stream = Clock(), io.StringIO()
    return console.Meter("evaluation at step 25", total, stream=stream, clock=clock, tty=tty, **kwargs), clock, stream


def lines(stream) -> list[str]:
    return stream.getvalue().splitlines()


def test_durations_read_as_hours_minutes_seconds():
    assert [console.duration(s) for s in (0, 7.4, 59.6, 190, 3600, 3725, 90061)] == \
        ["0s", "7s", "1m00s", "3m10s", "1h00m", "1h02m", "25h01m"]


def test_a_log_gets_a_line_at_each_tenth_with_the_time_left_from_the_measured_rate():
    m, clock, stream = meter(100)
    for done in range(1, 101):  # 2 s a problem, 50 tokens each: every tenth comes 20 s after the last
        clock.now += 2.0
        m.advance(1, tokens=50)
    m.finish()
    said = lines(stream)
    assert len(said) == 10 and all("\r" not in line for line in said)
    # at 10 of 100 after 20 s: 2 s a problem, 90 to go -> 180 s; 50 tokens / 2 s = 25 tokens/s
    assert said[0] == "remix: evaluation at step 25: 10/100 problems (10%), 25 tokens/s, 3m00s left"
    assert said[4] == "remix: evaluation at step 25: 50/100 problems (50%), 25 tokens/s, 1m40s left"
    assert said[-1] == "remix: evaluation at step 25: 100/100 problems in 3m20s, 25 tokens/s"


def test_the_time_left_follows_a_rate_that_changes():
    m, clock, stream = meter(40)
    for _ in range(4):  # 4 problems in 4 s
        clock.now += 1.0
        m.advance()
    for _ in range(4):  # then 4 in 60 s: 8 in 64 s, 8 s a problem, 32 to go -> 256 s
        clock.now += 15.0
        m.advance()
    said = lines(stream)
    assert said[0] == "remix: evaluation at step 25: 4/40 problems (10%), 36s left"  # 1 s a problem, 36 to go
    assert said[-1] == "remix: evaluation at step 25: 8/40 problems (20%), 4m16s left"


def test_a_slow_wait_prints_every_30_s_and_a_fast_one_no_more_than_each_tenth():
    slow, clock, stream = meter(1000)
    for _ in range(5):  # 1 problem a minute: far from a tenth, a line each time 30 s have passed
        clock.now += 60.0
        slow.advance()
    assert [line.split(": ", 2)[2].split(" (")[0] for line in lines(stream)] == ["1/1000 problems", "2/1000 problems",
                                                                                "3/1000 problems", "4/1000 problems",
                                                                                "5/1000 problems"]
    fast, clock, stream = meter(1000)
    for _ in range(250):  # 250 problems in 25 s: two tenths crossed, under 30 s
        clock.now += 0.1
        fast.advance()
    assert [line.split(": ", 2)[2].split(" (")[0] for line in lines(stream)] == ["100/1000 problems",
                                                                                "200/1000 problems"]


def test_a_terminal_redraws_one_line_and_ends_it():
    m, clock, stream = meter(10, tty=True)
    for _ in range(10):
        clock.now += 2.0
        m.advance()
    m.finish()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("10/10 problems in 20s\x1b[K\n")
    assert "\rremix: evaluation at step 25: 9/10 problems (90%), 2s left\x1b[K" in text


def test_vllms_bar_is_scaled_onto_the_problems_and_reads_its_speed():
    m, clock, stream = meter(50)
    prompts = [[1, 2], [3]]
    assert console.EngineBar(m)(prompts, desc="Rendering prompts") is prompts  # vLLM's first call: passed through
    bar = console.EngineBar(m)(total=100, desc="Processed prompts", dynamic_ncols=True, postfix="")  # n = 2
    for _ in range(10):  # vLLM counts each finished request's 2 responses
        clock.now += 1.0
        bar.postfix = "est. speed input: 812.00 toks/s, output: 1234.56 toks/s"
        bar.update(2)
    assert bar.format_dict["elapsed"] == 10.0 and bar.n == 20
    assert lines(stream) == ["remix: evaluation at step 25: 5/50 problems (10%), 1,235 tokens/s, 45s left",
                             "remix: evaluation at step 25: 10/50 problems (20%), 1,235 tokens/s, 40s left"]


def test_only_the_first_process_prints(monkeypatch):
    from machinery import dist

    monkeypatch.setattr(dist, "rank", lambda: 1)
    m, clock, stream = meter(10)
    for _ in range(10):
        clock.now += 40.0
        m.advance()
    m.finish()
    assert stream.getvalue() == ""


def test_a_steps_line_names_each_phase_and_the_time_left_to_steps():
    # resumed after step 10: 2 steps here in 20 s -> 10 s a step, 338 to go -> 3380 s
    line = console.step_line(12, 350, {"gen": 1.234, "trainer": 6.5, "weight_sync": 0.25}, 8.1, 0.4567, 2, 20.0)
    assert line == ("step 12/350: gen 1.2s, trainer 6.5s, weight_sync 0.2s, eval 0.0s; step 8.1s; reward 0.457; "
                    "56m20s left")
    assert console.step_line(350, 350, {}, 1.0, 0.0, 5, 50.0).endswith("0s left")


if __name__ == "__main__":
    os.execvp(sys.executable, [sys.executable, "-m", "pytest", "-q", __file__])
