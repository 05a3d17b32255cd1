"""What a program does in its first instant, before it imports torch (seconds on a busy machine): Ctrl-C,
SIGTERM and SIGHUP already end it with one line instead of a traceback of the import machinery, unless the program
was started ignoring them (nohup): those stay ignored, then and later. This module
imports nothing heavy. A reader of the method may skip it.
"""

import os
import signal

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
    """Until the program installs its own handlers (signals.catch_interrupts): one line on stderr and the signal's
    exit code, with nothing written and nothing to resume."""
    def handler(signum, frame):
        os.write(2, f"\n{prog}: {NAMES[signum]} while starting; nothing was written\n".encode())
        os._exit(EXIT_CODES[signum])

    handle(handler)
