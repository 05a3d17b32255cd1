"""What a program does in its first instant, before it imports torch (seconds on a busy machine): Ctrl-C,
SIGTERM and SIGHUP already end it with one line instead of a traceback of the import machinery, unless the program
was started ignoring them (nohup): those stay ignored, then and later. And output that cannot be written (stdout or
stderr closed, `>&-`; a reader gone, `| head -1`) is dropped for the rest of the program, which goes on: the run's
logs and checkpoints are in --out. This module imports nothing heavy. A reader of the method may skip it.
"""

import os
import signal
import sys

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
    installs its own handlers (signals.catch_interrupts), a signal is one line on stderr and the signal's exit code,
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
