"""The run folder: its lock, refusing to clobber a run, and the only way anything is written under --out.

Every file and folder remix.py, eval.py and machinery create, append to, replace, rename, delete or lock goes through
the primitives at the end (makedirs, open_file, new_file, replace, remove, fresh_folder, replace_file), which walk
from --out down one component at a time with O_NOFOLLOW: a symbolic link inside --out, on the file or on any folder
between, is never followed (Linked, one line). Nor is anything written into a file that is not the run's alone: a
file written whole is written anew and renamed into place (a hard link's other name and a FIFO there are replaced,
never written into), and a file appended to that is not a regular file, or has another name, is refused in one line
(Unwritable). --out itself, and the folders above it, are the user's to name (machinery.paths checks where it may
be, and that every path a job writes is free before it starts). A reader of the method may skip this
module."""

import contextlib
import errno
import fcntl
import glob
import os
import secrets
import shutil
import socket
import stat

from machinery import dist
from machinery.console import fail


LOCK = ".remix.lock"  # held by the run in the folder (fcntl), released when its process ends
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "tb", "eval", "checkpoint-*", ".tmp-checkpoint-*", ".trash-*")
WRITES = (*RUN_FILES, LOCK, "plan.json", "wandb")  # every name a run writes, replaces or deletes at --out's top


_locks: list = []  # (lock file, folder descriptor) pairs held: a lock lasts as long as the process, however it ends


def lock(out: str, prog: str = "remix"):
    """Create --out and hold an exclusive lock on it for the whole job (the kernel releases it when the process
    dies, however it dies): a second run, eval or resume of a folder in use is refused with one line. The lock is
    on the folder itself, which cannot be deleted from under a live job as OUT/.remix.lock can; that file names
    the holder and is locked too (on a file system without folder locks, such as NFS, it is the lock)."""
    error = None
    writes_into(out)
    held = os.path.isdir(out) and any(os.path.isdir(os.path.dirname(h.name))  # a folder removed since: not held
                                      and os.path.samefile(os.path.dirname(h.name), out) for h, _ in _locks)
    if dist.rank() == 0 and not held:
        folder = handle = None
        try:
            makedirs(out)
            folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held by another process
                raise
            except OSError:  # no folder locks on this file system: the file's lock alone
                os.close(folder)
                folder = None
            handle = _lock_file(os.path.join(out, LOCK))
            _locks.append((handle, folder))
        except BlockingIOError:
            error = f"--out {out} is in use by a running job ({holder(out)}); wait for it to end, or choose another --out"
        except Unwritable as caught:
            error = f"--out {out}: {caught}"
        except OSError as caught:
            error = f"cannot create --out {out}: {caught.strerror or caught}"
        if error and handle is not None:
            handle.close()
        if error and folder is not None:
            os.close(folder)
    error = dist.broadcast(error)
    if error:
        fail(error, prog)


def _lock_file(path: str):
    """The lock file, naming this process, locked and held open: written anew beside path and renamed over it, so
    a hard link there (another name's contents) or a FIFO is replaced, never written into; a symbolic link is refused
    (Linked). A lock file another job holds is never replaced (BlockingIOError): without folder locks (NFS) it is the
    lock, taken on the file at path (a file renamed away since it was opened is looked at again)."""
    while True:
        old = _open_plain(path)  # what is there now, when it is a regular file (none for a FIFO: never opened)
        try:
            if old is not None:
                fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not _still_at(old, path):
                    continue
            aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
            remove(aside, missing_ok=True)
            handle = open_file(aside, "x")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: no one else holds it
                handle.write(f"{socket.gethostname()} {os.getpid()}\n")
                handle.flush()
                replace(aside, path)
            except BaseException:
                handle.close()
                remove(aside, missing_ok=True)
                raise
            handle.buffer.raw.name = path  # as open(path) names it
            return handle
        finally:
            if old is not None:
                os.close(old)


def _open_plain(path: str) -> int | None:
    """A read-only descriptor of the regular file at path, or None where there is none (nothing, a FIFO, a device:
    opening one could block or act); a symbolic link is refused (Linked)."""
    with _parent(path) as (fd, name):
        try:
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            raise Linked(os.path.abspath(path))
        if not stat.S_ISREG(mode):
            return None
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            return None


def _still_at(descriptor: int, path: str) -> bool:
    """Whether the file open as descriptor is still the one at path (not renamed away since)."""
    with _parent(path) as (fd, name):
        try:
            there = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
    held = os.fstat(descriptor)
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def holder(out: str) -> str:
    """Who holds --out's lock, as its lock file says (a deleted file says nothing; nothing else is read)."""
    try:
        descriptor = _open_plain(os.path.join(out, LOCK))
    except (OSError, ValueError):
        return "another process"
    if descriptor is None:
        return "another process"
    with os.fdopen(descriptor, errors="replace") as f:
        return f.read(200).strip() or "another process"


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
            remove(path)
    dist.barrier()

# ----------------------------------------------------------------------------------------------
# The write primitives: nothing is written through a symbolic link inside --out
# ----------------------------------------------------------------------------------------------
_roots: list[str] = []  # the folders (each --out) this process writes into


def writes_into(out: str):
    """out is a folder this process writes into: the primitives below accept paths inside it (and no others)."""
    path = os.path.abspath(out)
    if path not in _roots:
        _roots.append(path)


class Unwritable(OSError):
    """A path where a program writes that it will not write into: one line naming it and what is wrong."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)

    def __str__(self):
        return self.strerror


class Linked(Unwritable):
    """A symbolic link found where a program writes (the file, or a folder between --out and it): never followed."""

    def __init__(self, path: str):
        super().__init__(errno.ELOOP, f"{path} is a symbolic link, and nothing is written through one: remove it "
                                      f"(what it points to is untouched)")


def _check_appendable(descriptor: int, path: str):
    """A file opened to be appended to is a regular file of one name (Unwritable otherwise): a FIFO would block or
    feed a reader, and a hard link would write into another name's file too."""
    found = os.fstat(descriptor)
    if not stat.S_ISREG(found.st_mode):
        os.close(descriptor)
        raise Unwritable(errno.EPERM, f"{path} is not a regular file (a FIFO, socket or device), and nothing is "
                                      f"written into one: remove it")
    if found.st_nlink > 1:
        os.close(descriptor)
        raise Unwritable(errno.EPERM, f"{path} has {found.st_nlink} hard links (another name shares its contents), "
                                      f"and nothing is written through one: remove it (the other names keep it)")


def _split(path: str) -> tuple[str, list[str]]:
    """(the --out that holds path, path's components below it)."""
    path = os.path.abspath(path)
    roots = [r for r in _roots if path == r or path.startswith(r.rstrip(os.sep) + os.sep)]
    if not roots:
        raise ValueError(f"{path} is outside every --out this process writes into (runfolder.writes_into)")
    root = max(roots, key=len)
    return root, ([] if path == root else os.path.relpath(path, root).split(os.sep))


def _folder(path: str, create: bool) -> int:
    """A descriptor of folder path, reached from its --out one component at a time, none a link (Linked);
    missing folders are made when create."""
    root, parts = _split(path)
    if create:
        os.makedirs(root, exist_ok=True)  # --out itself: named by the user
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for depth, part in enumerate(parts):
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as error:
            linked = error.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd)
            os.close(fd)
            if linked:
                raise Linked(os.path.join(root, *parts[:depth + 1])) from None
            if error.errno == errno.ENOTDIR:  # a file, a FIFO where a folder goes: never opened
                raise Unwritable(errno.ENOTDIR, f"{os.path.join(root, *parts[:depth + 1])} is not a folder, and "
                                                f"the run writes a folder there: remove it") from None
            raise
        os.close(fd)
        fd = inner
    return fd


def _is_link(name: str, fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def _parent(path: str):
    """(descriptor of path's folder, path's name), the folder reached without following a link."""
    folder, name = os.path.split(os.path.abspath(path))
    fd = _folder(folder, create=False)
    try:
        yield fd, name
    finally:
        os.close(fd)


def makedirs(path: str):
    """os.makedirs(path, exist_ok=True), refusing a link on the way (Linked)."""
    os.close(_folder(path, create=True))


MODES = {"w": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK,
         "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}


def open_file(path: str, mode: str = "w", **kwargs):
    """open(path, mode) for writing ('w', 'a', 'a+', 'x', with 'b' for bytes), never through a link: 'w' writes a new
    file, whatever was at path (a symbolic or hard link, a FIFO) unlinked first, as a rename would replace it; 'a' and
    'a+' refuse a symbolic link (Linked), and anything but a regular file of one name (Unwritable); 'x' a new file."""
    with _parent(path) as (fd, name):
        if mode.startswith("w"):
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
        try:
            handle = os.open(name, MODES[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise Linked(os.path.abspath(path)) from None
            if error.errno == errno.ENXIO:  # a FIFO no one reads, or a socket
                raise Unwritable(errno.EPERM, f"{os.path.abspath(path)} is not a regular file (a FIFO, socket or "
                                              f"device), and nothing is written into one: remove it") from None
            raise
    if mode.startswith("a"):
        _check_appendable(handle, os.path.abspath(path))
    opened = os.fdopen(handle, mode, **kwargs)
    (opened.buffer.raw if hasattr(opened, "buffer") else opened.raw).name = path  # as open(path) names it
    return opened


def replace(source: str, target: str):
    """os.replace(source, target) within --out: a link at target is replaced (its target untouched), a link on
    the way to either is refused."""
    with _parent(source) as (source_fd, source_name), _parent(target) as (target_fd, target_name):
        os.replace(source_name, target_name, src_dir_fd=source_fd, dst_dir_fd=target_fd)


def remove(path: str, missing_ok: bool = False):
    """Delete a file, a link (never what it points to) or a whole folder (links inside are unlinked only)."""
    with _parent(path) as (fd, name):
        try:
            is_folder = stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
            shutil.rmtree(name, dir_fd=fd) if is_folder else os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            if not missing_ok:
                raise


def fresh_folder(parent: str, prefix: str) -> str:
    """A new empty folder parent/PREFIXrandom, as tempfile.mkdtemp makes, never through a link."""
    with _parent(os.path.join(parent, "x")) as (fd, _):
        while True:
            name = f"{prefix}{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=fd)
                return os.path.join(parent, name)


def sync_tree(folder: str):
    """Every file and folder under folder, and folder itself, flushed to the disk (fsync): once this returns, a power
    loss leaves them as they are now. Each is opened from its folder's descriptor without following a link (a link is
    no file of ours: it is left alone)."""
    fd = _folder(folder, create=False)
    try:
        _sync_inside(fd)
    finally:
        os.close(fd)


def _sync_inside(fd: int):
    with os.scandir(fd) as entries:
        found = list(entries)
    for entry in found:
        if entry.is_dir(follow_symlinks=False):
            inner = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                _sync_inside(inner)
            finally:
                os.close(inner)
        elif entry.is_file(follow_symlinks=False):
            handle = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                os.fsync(handle)
            finally:
                os.close(handle)
    os.fsync(fd)  # the folder's entries: the names of what it holds


def sync_folder(folder: str):
    """folder's own entries flushed to the disk (fsync of the folder, not of what is in it): a rename or a new name
    in it survives a power loss."""
    fd = _folder(folder, create=False)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_tree(folder: str, allowed: tuple = ()):
    """A folder that a library writes into by name (TensorBoard's tb, wandb's): made, and refused (Linked) if it or
    anything inside it is a link (but the allowed names, links the library makes itself), before the library opens
    it."""
    makedirs(folder)
    no_links_inside(folder, allowed)


def no_links_inside(folder: str, allowed: tuple = ()):
    for inside, folders, files in os.walk(folder):
        for name in folders + files:
            if os.path.islink(os.path.join(inside, name)) and name not in allowed:
                raise Linked(os.path.join(inside, name))


@contextlib.contextmanager
def new_file(path: str, mode: str = "w", **kwargs):
    """A file to write path's new content into ('w' or 'wb'), written aside in its folder, synced and renamed over
    path when the block ends: a crash or a signal at any instant leaves the old file or the new one whole (a log
    rewritten in place lost its rows to a SIGTERM). Whatever was at path (a symbolic or hard link, a FIFO) is
    replaced, never written into or followed; the aside file is new (O_EXCL), so a link planted there is refused."""
    folder, name = os.path.split(os.path.abspath(path))
    aside = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    remove(aside, missing_ok=True)  # a leftover (or a link) of an earlier process with this pid
    try:
        with open_file(aside, mode.replace("w", "x"), **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace(aside, path)
    finally:
        remove(aside, missing_ok=True)
    with _parent(path) as (descriptor, _):  # the rename itself reaches the disk
        os.fsync(descriptor)


def replace_file(path: str, lines: list[str]):
    """path's new content, lines of text, as new_file writes it."""
    with new_file(path) as f:
        f.writelines(lines)
