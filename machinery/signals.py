"""Interrupts: Ctrl-C, SIGTERM (a scheduler's preemption) and SIGHUP (a closed terminal) end a program with one
line that says what is kept and how to continue. A reader of the method may skip this module."""

import os
import signal
import sys

from machinery import runfolder, startup


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

    startup.handle(handler)  # a signal the program was started ignoring (nohup's SIGHUP) stays ignored
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
        what = startup.NAMES[_interrupt["seen"] or signal.SIGINT]
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
        return f"{startup.NAMES[signum]} at step {step}; {resume_line(out)}"
    folders = [os.path.dirname(handle.name) for handle, _ in runfolder.held()]
    return f"{startup.NAMES[signum]} while starting; " + (resume_line(folders[0]) if folders else "nothing to resume")
