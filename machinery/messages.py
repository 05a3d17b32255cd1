"""One clear line: what the programs print for bad input (exit 2) and for progress, from the first process only.
A reader of the method may skip this module."""

import sys
import time

from machinery import dist

# Seconds a rank other than 0 waits before it says its refusal. Every rank checks the same input, and where rank 0
# refuses too it says so and exits at once, and torchrun stops the other ranks (it looks every 0.1 s) before they
# repeat the line; a rank still there after the wait refuses alone (its own checkpoint shard, its own GPU).
OTHER_RANK_WAIT = 2.0


def fail(message: str, prog: str = "remix"):
    """Bad input: one clear line on stderr and exit code 2, no traceback. From the first process; under torchrun a
    rank refusing what rank 0 did not says it itself after OTHER_RANK_WAIT seconds, naming its rank (its exit ends
    every rank: torchrun stops the others)."""
    if dist.rank() != 0:
        time.sleep(OTHER_RANK_WAIT)
        print(f"{prog}: error: rank {dist.rank()}: {message}", file=sys.stderr, flush=True)
    say(f"error: {message}", prog, sys.stderr)
    raise SystemExit(2)


def say(message: str, prog: str = "remix", stream=None):
    """One line on stdout (or stream), from the first process only, on a line of its own beside a progress bar."""
    if dist.rank() == 0:
        from tqdm.auto import tqdm

        tqdm.write(f"{prog}: {message}", file=stream or sys.stdout)
        (stream or sys.stdout).flush()
