"""The run folder: its lock, where a job may write, and every write under --out, or into a folder it made and checked.

Writes walk from --out with O_NOFOLLOW: a link inside is never followed (Linked); a file written whole is renamed over
(a hard link or FIFO there replaced), one appended to must be a regular file of one name (Unwritable).
"""

import contextlib
import errno
import fcntl
import fnmatch
import glob
import os
import pathlib
import secrets
import shutil
import socket
import stat

from machinery import console, dist

LOCK = ".remix.lock"  # names the job holding --out (fcntl), released when its process ends
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "tb", "eval", "checkpoint-*", ".tmp-checkpoint-*", ".trash-*")
WRITES = (*RUN_FILES, LOCK, "plan.json", "wandb")  # every name a run writes, replaces or deletes at --out's top
_locks: list = []  # (lock file, folder descriptor) pairs held: a lock lasts as long as the process
_roots: set[str] = set()  # the folders (each --out) this process writes into

class Unwritable(OSError):
    """A path where a program writes that it will not write into: one line naming it and what is wrong."""

    def __str__(self):
        return self.strerror

class Linked(Unwritable):
    """A symbolic link where a program writes (the file, or a folder between --out and it): never followed."""

    def __init__(self, path: str):
        super().__init__(errno.ELOOP, f"{path} is a symbolic link, and nothing is written through one: remove it "
                                      f"(what it points to is untouched)")

def special(path: str) -> Unwritable:
    return Unwritable(errno.EPERM, f"{path} is not a regular file (a FIFO, socket or device), and nothing is written "
                                   f"into one: remove it")

def lock(out: str):
    """Create --out and lock it until the process ends (a second job: one line). The folder is locked, and so is
    OUT/.remix.lock, which names the holder (the lock itself where folders cannot be locked, as on NFS)."""
    writes_into(out)
    held = os.path.isdir(out) and any(os.path.isdir(os.path.dirname(h.name))
                                      and os.path.samefile(os.path.dirname(h.name), out) for h, _ in _locks)
    error, folder = None, None
    if dist.rank() == 0 and not held:
        try:
            makedirs(out)
            folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise
            except OSError:  # no folder locks here: the file's alone
                os.close(folder)
                folder = None
            _locks.append((_lock_file(os.path.join(out, LOCK)), folder))
        except BlockingIOError:
            error = (f"--out {out} is in use by a running job ({holder(out)}); wait for it to end, or choose another "
                     f"--out")
        except OSError as caught:
            error = f"--out {out}: {caught}" if isinstance(caught, Unwritable) else \
                f"cannot create --out {out}: {caught.strerror or caught}"
        if error and folder is not None:
            os.close(folder)
    if error := dist.broadcast(error):
        console.fail(error)

def _lock_file(path: str):
    """The lock file naming this process, locked, held open, written aside and renamed over one no other job holds."""
    while True:
        old = _open_plain(path)  # the regular file there now, or None
        try:
            if old is not None:
                fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: another job holds it
                with _parent(path) as (fd, name):
                    if not os.path.samestat(os.stat(name, dir_fd=fd, follow_symlinks=False), os.fstat(old)):
                        continue  # renamed away since it was opened: look again
            with contextlib.ExitStack() as closed_unless_renamed:
                with new_file(path) as new:  # locked before the rename: no other job takes the file at path first
                    fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    new.write(f"{socket.gethostname()} {os.getpid()}\n")
                    handle = os.fdopen(os.dup(new.fileno()), "w")  # the same open file: its lock outlives new's close
                    closed_unless_renamed.enter_context(handle)
                closed_unless_renamed.pop_all()
            handle.buffer.raw.name = path
            return handle
        except FileNotFoundError:
            continue  # renamed away between the look and the stat
        finally:
            if old is not None:
                os.close(old)

def _open_plain(path: str) -> int | None:
    """A read-only descriptor of the regular file at path, or None (nothing there, or a FIFO); a link: Linked."""
    with _parent(path) as (fd, name), contextlib.suppress(FileNotFoundError):
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            raise Linked(os.path.abspath(path))
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd) \
            if stat.S_ISREG(mode) else None
    return None

def holder(out: str) -> str:
    """Who holds --out's lock, as its lock file says."""
    with contextlib.suppress(OSError, ValueError):
        if (descriptor := _open_plain(os.path.join(out, LOCK))) is not None:
            with os.fdopen(descriptor, errors="replace") as f:
                return f.read(200).strip() or "another process"
    return "another process"

def prepare_out(out: str, overwrite: bool):
    """A new run never silently replaces an old one's logs and checkpoints (--overwrite removes them first)."""
    found = [p for pattern in RUN_FILES for p in glob.glob(os.path.join(out, pattern))]
    if found and not overwrite:
        console.fail(f"--out {out} already holds a run ({os.path.basename(sorted(found)[0])}, ...): continue it with "
                     f"--resume {out}, choose a new --out, or pass --overwrite to replace it")
    dist.barrier()
    if dist.rank() == 0:
        for path in found:
            remove(path)
    dist.barrier()

def check_out(out: str):
    """--out can be written and is not inside another run's folder (whose rotation would delete it); creates nothing."""
    parents = [os.path.abspath(out), *map(str, pathlib.PurePath(os.path.abspath(out)).parents)]
    for parent in parents[1:]:
        if any(os.path.isfile(os.path.join(parent, n)) for n in ("metrics.jsonl", LOCK, "trainer_state.pt")) \
                or glob.glob(os.path.join(parent, "checkpoint-*", "trainer_state.pt")):
            console.fail(f"--out {out} is inside the run folder {parent}: choose a folder outside it")
    existing = next(p for p in parents if os.path.exists(p))
    if not os.path.isdir(existing):
        console.fail(f"--out {out} is under {existing}, which is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        console.fail(f"--out {out}: {existing} is not writable")

def check_writes(out: str, planned: list[tuple]):
    """Each planned (path under out, kind[, a library's own links]) is free, or one line names the first that is not.
    kind: "folder", "tree" (a library's folder), "file" (written whole), "append", "replaced"; nothing is created."""
    for path, kind, *allowed in planned:
        if problem := _in_the_way(out, path, kind, *allowed):
            console.fail(problem)

def _in_the_way(out: str, path: str, kind: str, allowed: tuple = ()) -> str | None:
    parts = path.split(os.sep)
    for depth in range(1, len(parts) + 1):
        place, last = os.path.join(out, *parts[:depth]), depth == len(parts)
        try:
            mode = os.lstat(place).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode) and not (last and kind in ("file", "replaced")):
            return str(Linked(place))
        if (not last or kind in ("folder", "tree", "replaced")) and not stat.S_ISDIR(mode) and not stat.S_ISLNK(mode):
            what = "is a file, not a folder" if stat.S_ISREG(mode) else "is not a folder (a FIFO, socket or device)"
            return f"{place} {what}, and the run writes a folder there: move it away"
        if last and kind == "file" and stat.S_ISDIR(mode):
            return f"{place} is a folder, and the run writes a file there: move it away"
        if last and kind == "append" and not stat.S_ISREG(mode):
            return f"{place} is not a regular file, and the run appends to it: move it away"
    link = _link_inside(os.path.join(out, path), allowed) if kind == "tree" else None
    return str(Linked(link)) if link else None

def opened_through(path: str, hops: int = 0) -> list[str]:
    """Every directory entry (real folder + name) the kernel passes through to open path, links' targets included."""
    folder, entries = os.sep, []
    for part in os.path.join(os.getcwd(), path).split(os.sep):
        if part == "..":
            folder = os.path.dirname(folder)
        elif part not in ("", "."):
            entry = os.path.join(folder, part)
            entries.append(entry)
            linked = os.path.islink(entry) and hops < 40  # a loop of links: opening it fails anyway
            if linked:
                entries += opened_through(os.path.join(folder, os.readlink(entry)), hops + 1)
            folder = os.path.realpath(entry) if linked else entry
    return entries

def read_where_written(out: str, reads: dict, names: tuple) -> tuple[str, str, str] | None:
    """(flag, value, entry) of the first path of reads ({flag: (value, [paths])}) opened through out/NAME, or None."""
    real_out = os.path.realpath(out)
    return next(((flag, value, entry) for flag, (value, paths) in reads.items() for path in paths
                 for entry in opened_through(path) if os.path.dirname(entry) == real_out
                 and any(fnmatch.fnmatch(os.path.basename(entry), name) for name in names)), None)

def writes_into(out: str):
    """out is a folder this process writes into: the primitives accept paths inside it (and no others)."""
    _roots.add(os.path.abspath(out))

@contextlib.contextmanager
def _folder(path: str, create: bool = False):
    """A descriptor of folder path, reached from its --out one component at a time, none a link (Linked)."""
    path = os.path.abspath(path)
    roots = [r for r in _roots if path == r or path.startswith(r.rstrip(os.sep) + os.sep)]
    if not roots:
        raise ValueError(f"{path} is outside every --out this process writes into (runfolder.writes_into)")
    root = max(roots, key=len)
    parts = [] if path == root else os.path.relpath(path, root).split(os.sep)
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
            os.close(fd)
            place = os.path.join(root, *parts[:depth + 1])
            if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(place):
                raise Linked(place) from None
            if error.errno == errno.ENOTDIR:  # a file, a FIFO where a folder goes: never opened
                raise Unwritable(errno.ENOTDIR, f"{place} is not a folder, and the run writes a folder there: "
                                                f"remove it") from None
            raise
        os.close(fd)
        fd = inner
    try:
        yield fd
    finally:
        os.close(fd)

@contextlib.contextmanager
def _parent(path: str):
    """(descriptor of path's folder, path's name), the folder reached without following a link."""
    folder, name = os.path.split(os.path.abspath(path))
    with _folder(folder) as fd:
        yield fd, name

def makedirs(path: str):
    """os.makedirs(path, exist_ok=True), refusing a link on the way (Linked)."""
    with _folder(path, create=True):
        pass

MODES = {"w": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK,
         "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL}

def open_file(path: str, mode: str = "w", **kwargs):
    """open(path, mode) for writing ('w' unlinks what was there first, 'x', 'a', 'a+'; 'b' for bytes): never through a
    link (Linked); appending only to a regular file of one name (Unwritable)."""
    with _parent(path) as (fd, name):
        if mode.startswith("w"):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # a folder stays: the open refuses it
                os.unlink(name, dir_fd=fd)
        try:
            handle = os.open(name, MODES[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise Linked(os.path.abspath(path)) from None
            if error.errno == errno.ENXIO:  # a FIFO no one reads, or a socket
                raise special(os.path.abspath(path)) from None
            raise
    if mode.startswith("a"):
        found = os.fstat(handle)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink > 1:
            os.close(handle)
            raise special(os.path.abspath(path)) if not stat.S_ISREG(found.st_mode) else Unwritable(
                errno.EPERM, f"{os.path.abspath(path)} has {found.st_nlink} hard links (another name shares its "
                             f"contents), and nothing is written through one: remove it (the other names keep it)")
    opened = os.fdopen(handle, mode, **kwargs)
    (opened.buffer.raw if hasattr(opened, "buffer") else opened.raw).name = path  # as open(path) names it
    return opened

def replace(source: str, target: str):
    """os.replace(source, target) within --out: a link at target is replaced, a link on the way to either refused."""
    with _parent(source) as (source_fd, source_name), _parent(target) as (target_fd, target_name):
        os.replace(source_name, target_name, src_dir_fd=source_fd, dst_dir_fd=target_fd)

def remove(path: str, missing_ok: bool = False):
    """Delete a file, a link (never what it points to) or a whole folder (links inside are unlinked only)."""
    with _parent(path) as (fd, name):
        try:
            is_dir = stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
            (shutil.rmtree if is_dir else os.unlink)(name, dir_fd=fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

def new_folder(path: str) -> str:
    """A new empty folder at path (and its parents), never through a link: anything there, a link too, is
    FileExistsError."""
    with _folder(os.path.dirname(os.path.abspath(path)), create=True) as fd:
        os.mkdir(os.path.basename(path), dir_fd=fd)
    return path

def fresh_folder(parent: str, prefix: str) -> str:
    """A new empty folder parent/PREFIXrandom."""
    while True:
        with contextlib.suppress(FileExistsError):
            return new_folder(os.path.join(parent, f"{prefix}{secrets.token_hex(4)}"))

def sync_tree(folder: str):
    """Every file and folder under folder, and folder itself, flushed to the disk, none through a link."""
    def inside(fd: int):
        for entry in list(os.scandir(fd)):  # read whole (and closed) before descending
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir or entry.is_file(follow_symlinks=False):
                handle = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if is_dir else 0), dir_fd=fd)
                try:
                    inside(handle) if is_dir else os.fsync(handle)
                finally:
                    os.close(handle)
        os.fsync(fd)  # the folder's entries: the names of what it holds
    with _folder(folder) as fd:
        inside(fd)

def sync_folder(folder: str):
    """folder's own entries flushed to the disk: a rename or a new name in it survives a power loss."""
    with _folder(folder) as fd:
        os.fsync(fd)

def check_tree(folder: str, allowed: tuple = ()):
    """A folder a library writes into by name (tb, wandb): made, and Linked if it holds a link not named in allowed."""
    makedirs(folder)
    if link := _link_inside(folder, allowed):
        raise Linked(link)

def _link_inside(folder: str, allowed: tuple = ()) -> str | None:
    """The first symbolic link under folder whose name allowed does not hold, or None."""
    return next((os.path.join(inside, name) for inside, folders, files in os.walk(folder) for name in folders + files
                 if os.path.islink(os.path.join(inside, name)) and name not in allowed), None)

@contextlib.contextmanager
def new_file(path: str, mode: str = "w", **kwargs):
    """path's new content ('w', 'wb'): written aside, synced, renamed over path (a crash leaves old or new whole)."""
    aside = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    remove(aside, missing_ok=True)  # a leftover (or a link) of an earlier process with this pid
    try:
        with open_file(aside, mode.replace("w", "x"), **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        replace(aside, path)
    finally:
        remove(aside, missing_ok=True)
    sync_folder(os.path.dirname(aside))  # the rename itself reaches the disk

def replace_file(path: str, lines: list[str]):
    """path's new content, lines of text, as new_file writes it."""
    with new_file(path) as f:
        f.writelines(lines)
