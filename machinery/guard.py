"""The guard against non-finite updates: a mini-batch whose loss or gradient is not finite is skipped, and three in
a row stop the run. A reader of the method may skip this module; remix.update shows where it acts."""

import math
import sys

import torch

from machinery import dist
from machinery.messages import fail, say


_guard = {"in_a_row": 0, "out": ""}


def reset(in_a_row: int, out: str):
    """A run's start: the skipped updates in a row its checkpoint ended with, and the folder its line names."""
    _guard.update(in_a_row=in_a_row, out=out)


def in_a_row() -> int:
    return _guard["in_a_row"]


def finite_update(terms: dict, norms: list[float], stats: dict, step: int) -> bool:
    """The end of a mini-batch: its logged terms summed over the ranks and kept in stats with the gradient norm,
    if the loss and every gradient are finite. Otherwise the optimizer step is skipped (one line on stderr,
    train/skipped_updates), and three skipped in a row stop the run."""
    values = dist.all_reduce(torch.tensor(list(terms.values()), dtype=torch.float64))
    if not torch.isfinite(values).all() or not all(map(math.isfinite, norms)):
        _guard["in_a_row"] += 1
        stats["train/skipped_updates"].append(1)
        say(f"step {step}: non-finite loss or gradient, update skipped", stream=sys.stderr)
        if _guard["in_a_row"] >= 3:
            fail(f"3 non-finite updates in a row at step {step}; stopping. The last good checkpoint is the newest "
                 f"checkpoint-* in {_guard['out']}")
        return False
    _guard["in_a_row"] = 0
    for name, value in zip(terms, values.tolist()):
        stats[name].append(value)
    stats["losses/grad_norm"].append(norms[0])
    stats["train/optimizer_steps"].append(1)
    return True
