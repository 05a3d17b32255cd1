"""One clear line: what the programs print for bad input (exit 2) and for progress, from the first process only.
A reader of the method may skip this module."""

import sys

from machinery import dist


def fail(message: str, prog: str = "remix"):
    """Bad input: one clear line on stderr (from the first process only) and exit code 2, no traceback."""
    say(f"error: {message}", prog, sys.stderr)
    raise SystemExit(2)


def say(message: str, prog: str = "remix", stream=None):
    """One line on stdout (or stream), from the first process only, on a line of its own beside a progress bar."""
    if dist.rank() == 0:
        from tqdm.auto import tqdm

        tqdm.write(f"{prog}: {message}", file=stream or sys.stdout)
        (stream or sys.stdout).flush()
