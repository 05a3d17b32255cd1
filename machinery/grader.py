"""Worker processes that run a function on many items with a hard deadline per item: the grader. math-verify's
own timeouts use SIGALRM, which works only on a process's main thread, and some answers hang inside C code
where no signal reaches; a worker past its deadline is killed (the only way to stop such code) and replaced.
The workers are plain subprocesses talking over pipes: nothing of the caller's __main__ is imported, so a script
without a __main__ guard, `python -c`, `python -` and an interactive session all work. A reader of the method
may skip this module: remix.score shows what is graded.
"""

import atexit
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import pickle
import select
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds machinery/


def _send(fd: int, obj):
    data = pickle.dumps(obj)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data):]


def _recv(fd: int):
    """One message from a pipe between this process and its own workers (both sides are this module's code)."""
    def exact(n):
        chunks = []
        while n:
            chunk = os.read(fd, n)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    return pickle.loads(exact(int.from_bytes(exact(8), "little")))


def _worker_main():
    """A worker: warm up, then run tasks (a module-level function by reference(), and its arguments) until its input
    closes. Any function of an importable module: one pool serves the grader, the training reward and others."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the workers
    out = os.dup(1)
    os.dup2(2, 1)  # prints of the task go to stderr, never into the protocol
    warm = _recv(0)
    if warm:  # reference() of the warm-up function, and its arguments
        resolve(warm[:4])(*warm[4])
    _send(out, "ready")
    while True:
        try:
            *ref, args = _recv(0)
        except EOFError:
            return
        if _module_key(ref[1], ref[3]) not in sys.modules:  # a first import is no part of the task's time
            _send(out, "importing")
            resolve(ref)
            _send(out, "imported")
        try:
            _send(out, ("ok", resolve(ref)(*args)))
        except Exception as error:  # the caller decides; the worker lives on
            _send(out, ("error", f"{type(error).__name__}: {error}"))


def reference(fn) -> tuple[str, str, str, str | None]:
    """How a worker finds fn when a task is handed it as an argument (the method's answer check, say): its folder,
    module, name and, for a module that is one file (a method: remix.py, remix_mine.py), that file, as resolve()
    takes them."""
    return _importable(fn)


def _module_key(module: str, path: str | None) -> str:
    """The name a worker keeps a module under: a module of a package by its own name; a one-file module by its
    file's path, so two files of one name (a fork's remix.py in another folder) are never taken for each other."""
    return module if path is None else "_by_path_" + hashlib.sha256(path.encode()).hexdigest()[:16]


def resolve(ref: tuple):
    """The function a reference() names, imported in this process: a one-file module from its file (whatever else
    of that name sys.path or sys.modules holds), a module of a package by name; its folder goes last on sys.path, so
    a module of its own (a fork's helper beside it) is found and a torch.py or json.py there never shadows an
    installed package."""
    folder, module, name, path = ref
    if folder not in sys.path:
        sys.path.append(folder)
    key = _module_key(module, path)
    if path is None:
        return getattr(importlib.import_module(module), name)
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        loaded = sys.modules[key] = importlib.util.module_from_spec(spec)  # before it runs: dataclasses look it up
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[key]
            raise
    return getattr(sys.modules[key], name)


def _importable(fn) -> tuple[str, str, str, str | None]:
    """(folder, module, name, file) that a fresh interpreter can import fn from; __main__ maps to its file; file is
    None for a module of a package (imported by name) and the module's own file otherwise (imported from it)."""
    module = fn.__module__
    path = getattr(getattr(inspect.unwrap(fn), "__code__", None), "co_filename", None)  # the file it was made from
    if not path or not os.path.isfile(path):  # whatever module of its name sys.modules holds is no guide
        path = getattr(sys.modules.get(module), "__file__", None)
    if module == "__main__":
        if path is None:
            raise ValueError("the worker function must live in an importable file")
        module = os.path.splitext(os.path.basename(path))[0]
    depth = module.count(".")  # a module of a package: the folder that holds the package
    folder = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    for _ in range(depth):
        folder = os.path.dirname(folder)
    one_file = path is not None and depth == 0 and os.path.basename(path) != "__init__.py"
    return folder, module, fn.__name__, os.path.abspath(path) if one_file else None


class _Worker:
    def __init__(self, fn, warm, warm_args):
        # the machinery this process runs on, imported from its files (not found by name on sys.path, where a
        # machinery/ beside a fork would come first); the function's own folder last on sys.path (resolve), after the
        # installed packages, so a torch.py, json.py or sympy.py beside a fork never runs here. -P keeps the working
        # directory off sys.path too (python -c puts it first): a tyro.py, sympy.py or select.py in the folder the
        # user runs from (a downloaded model's, say) is never imported and run
        package = os.path.join(HERE, "machinery")
        init = os.path.join(package, "__init__.py")
        start = ("import importlib.util, sys; "
                 f"spec = importlib.util.spec_from_file_location('machinery', {init!r}, "
                 f"submodule_search_locations=[{package!r}]); "
                 "sys.modules['machinery'] = importlib.util.module_from_spec(spec); "
                 "spec.loader.exec_module(sys.modules['machinery']); "
                 f"sys.path.append({_importable(fn)[0]!r}); from machinery import grader; grader._worker_main()")
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", start], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=os.getcwd())
        self.write, self.read = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        _send(self.write, (*_importable(warm), warm_args) if warm else None)  # found from its own folder
        self.task, self.started, self.ready = None, 0.0, False

    def kill(self):
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


_pool: list[_Worker] = []
IMPORT_SECONDS = 300.0  # a worker's first import of a task's module (sympy, math-verify: seconds on a busy machine)


def map_with_deadline(fn, items: list[tuple], workers: int, timeout: float, on_timeout, warm=None, warm_args=()):
    """[fn(*item) for item in items] in worker processes. A task still running `timeout` seconds after its
    turn came gets `on_timeout`, and its worker is killed and replaced; so does a task whose worker dies under it
    (SIGKILL, the OOM killer). warm(*warm_args) runs in each new worker
    before it takes a task, so slow first imports never count against a deadline. The workers are kept between
    calls, whatever their fn; fn and warm are module-level functions (one module of a name per process)."""
    if workers < 1 or timeout <= 0:
        raise ValueError(f"map_with_deadline needs workers >= 1 and timeout > 0, got {workers} and {timeout}")
    task = _importable(fn)  # (folder, module, name)
    while len(_pool) < workers:
        _pool.append(_Worker(fn, warm, warm_args))
    results, todo, done = [None] * len(items), list(range(len(items))), 0
    while done < len(items):
        now = time.monotonic()
        for i, worker in enumerate(_pool):
            if worker.ready and worker.task is None and todo:
                worker.task, worker.started = todo.pop(0), now
                try:
                    _send(worker.write, (*task, items[worker.task]))
                except OSError:  # it died between two tasks (killed): the task goes to its replacement
                    todo.insert(0, worker.task)
                    worker.kill()
                    _pool[i] = _Worker(fn, warm, warm_args)
        deadlines = [w.started + timeout - now for w in _pool if w.task is not None]
        readable, _, _ = select.select([w.read for w in _pool], [], [], max(min(deadlines, default=1.0), 0.0))
        for i, worker in enumerate(_pool):
            if worker.read in readable:
                try:
                    message = _recv(worker.read)
                except EOFError:
                    if not worker.ready:  # it never started (an import that fails): a replacement would too
                        close_pool()
                        raise RuntimeError(f"a worker process for {fn.__name__} exited (see its error above)") from None
                    # killed mid-task (SIGKILL, the OOM killer): its answer fails as a timed-out one does
                    if worker.task is not None:
                        results[worker.task], done = on_timeout, done + 1
                    worker.kill()
                    _pool[i] = _Worker(fn, warm, warm_args)
                    continue
                if message in ("ready", "imported"):  # imports never count against a deadline
                    worker.ready, worker.started = True, time.monotonic()
                    continue
                if message == "importing":  # the task's clock waits for the import, which has a bound of its own
                    worker.started = time.monotonic() + IMPORT_SECONDS
                    continue
                status, value = message
                if status == "error":  # the pool goes with it: no task of this call is left to answer the next
                    close_pool()
                    raise RuntimeError(f"{fn.__name__} failed in a worker process: {value}")
                results[worker.task], worker.task, done = value, None, done + 1
            elif worker.task is not None and time.monotonic() - worker.started >= timeout:
                results[worker.task], done = on_timeout, done + 1
                worker.kill()
                _pool[i] = _Worker(fn, warm, warm_args)
    return results


def close_pool():
    """End the worker processes; the next call starts fresh ones."""
    global _pool
    for worker in _pool:
        worker.kill()
    _pool = []


atexit.register(close_pool)
