"""What a program does in its first instant, before it imports torch (seconds on a busy machine): Ctrl-C,
SIGTERM and SIGHUP already end it with one line instead of a traceback of the import machinery. This module
imports nothing heavy. A reader of the method may skip it.
"""

import os
import signal

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + the signal's number
NAMES = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}


def one_line_interrupts(prog: str):
    """Until the program installs its own handlers (run.catch_interrupts): one line on stderr and the signal's
    exit code, with nothing written and nothing to resume."""
    def handler(signum, frame):
        os.write(2, f"\n{prog}: {NAMES[signum]} while starting; nothing was written\n".encode())
        os._exit(EXIT_CODES[signum])

    for signum in EXIT_CODES:
        signal.signal(signum, handler)
