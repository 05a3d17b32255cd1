"""The run folder: where it may be, its lock, refusing to clobber a run, and files rewritten whole (aside, then
renamed). A reader of the method may skip this module."""

import contextlib
import fcntl
import glob
import os
import shutil
import socket

from machinery import dist
from machinery.messages import fail


LOCK = ".remix.lock"  # held by the run in the folder (fcntl), released when its process ends
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "tb", "eval", "checkpoint-*", ".tmp-checkpoint-*", ".trash-*")


def is_run_folder(path: str) -> bool:
    """A folder some run wrote into (its lock, its metrics, a complete checkpoint), or a checkpoint itself."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("metrics.jsonl", LOCK, "trainer_state.pt")) \
        or bool(glob.glob(os.path.join(path, "checkpoint-*", "trainer_state.pt")))


def check_out(out: str, resuming: bool, prog: str = "remix"):
    """--out can be written, and is not inside another run's folder or checkpoint (a parent's --keep-last rotation
    would delete a run nested there). Nothing is created here."""
    path = os.path.abspath(out)
    for parent in list(_parents(path))[1:]:
        if os.path.isdir(parent) and is_run_folder(parent):
            fail(f"--out {out} is inside the run folder {parent}: choose a folder outside it", prog)
    existing = next(p for p in _parents(path) if os.path.exists(p))
    if not os.path.isdir(existing):
        fail(f"--out {out} is under {existing}, which is a file, not a folder", prog)
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--out {out}: {existing} is not writable", prog)


def _parents(path: str):
    """path, then each folder above it, up to the root."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


_locks: list = []  # (lock file, folder descriptor) pairs held: a lock lasts as long as the process, however it ends


def lock(out: str, prog: str = "remix"):
    """Create --out and hold an exclusive lock on it for the whole job (the kernel releases it when the process
    dies, however it dies): a second run, eval or resume of a folder in use is refused with one line. The lock is
    on the folder itself, which cannot be deleted from under a live job as OUT/.remix.lock can; that file names
    the holder and is locked too (on a file system without folder locks, such as NFS, it is the lock)."""
    error = None
    held = os.path.isdir(out) and any(os.path.isdir(os.path.dirname(h.name))  # a folder removed since: not held
                                      and os.path.samefile(os.path.dirname(h.name), out) for h, _ in _locks)
    if dist.rank() == 0 and not held:
        folder = handle = None
        try:
            os.makedirs(out, exist_ok=True)
            folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by another process
                raise
            except OSError:  # no folder locks on this file system: the file's lock alone
                os.close(folder)
                folder = None
            handle = open(os.path.join(out, LOCK), "a+")
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0)
            handle.truncate()
            handle.write(f"{socket.gethostname()} {os.getpid()}\n")
            handle.flush()
            _locks.append((handle, folder))
        except BlockingIOError:
            error = f"--out {out} is in use by a running job ({holder(out)}); wait for it to end, or choose another --out"
        except OSError as caught:
            error = f"cannot create --out {out}: {caught.strerror}"
        if error and handle is not None:
            handle.close()
        if error and folder is not None:
            os.close(folder)
    error = dist.broadcast(error)
    if error:
        fail(error, prog)


def holder(out: str) -> str:
    """Who holds --out's lock, as its lock file says (a deleted file says nothing)."""
    try:
        with open(os.path.join(out, LOCK), errors="replace") as f:
            return f.read().strip() or "another process"
    except OSError:
        return "another process"


def held() -> list:
    """The (lock file, folder descriptor) pairs this process holds."""
    return list(_locks)


def unlock():
    while _locks:
        handle, folder = _locks.pop()
        handle.close()
        if folder is not None:
            os.close(folder)


def prepare_out(out: str, overwrite: bool):
    """A new run never silently replaces an old one's logs and checkpoints (--overwrite removes them first)."""
    found = [p for pattern in RUN_FILES for p in glob.glob(os.path.join(out, pattern))]
    if found and not overwrite:
        fail(f"--out {out} already holds a run ({os.path.basename(sorted(found)[0])}, ...): continue it with "
             f"--resume {out}, choose a new --out, or pass --overwrite to replace it")
    dist.barrier()
    if dist.rank() == 0:
        for path in found:  # a link is removed, never what it points to
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    dist.barrier()

def replace_file(path: str, lines: list[str]):
    """path's new content, written aside in its folder, synced and renamed over it: a crash or a signal at any
    instant leaves the old file or the new one whole (a log rewritten in place lost its rows to a SIGTERM)."""
    folder, name = os.path.split(os.path.abspath(path))
    aside = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        with open(aside, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(aside, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(aside)
    descriptor = os.open(folder, os.O_RDONLY)  # the rename itself reaches the disk
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
