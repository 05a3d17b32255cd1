"""The grader's worker pool, three designs side by side in one run, measured against the promises of issue 57: a
worker that shares nothing with the trainer, is replaced when it dies, and may compute with torch.

    python benchmarks/grader_workers.py > docs/bench/grader_workers.md      # about 2 minutes on 2 busy cores

(A) fork: pebble's ProcessPool with a fork context, what machinery/grader.py used before; it needs
    `pip install pebble==5.2.3` (no longer a requirement of the project) and its column is left out without it.
(B) forkserver: concurrent.futures.ProcessPoolExecutor on multiprocessing's forkserver context, its server preloading
    the method (remix) and math_verify.
(C) fresh interpreters: machinery.grader.map_with_deadline, what the project uses (report.grade_many for grading).

This process plays the trainer: before any pool starts it imports torch, vLLM and the method, allocates 1 GiB of
tensors, runs a 1500 x 1500 matmul (torch's OpenMP threads start) and holds a locked file and a log file open, as a
run holds its folder's lock and its logs. Then for each design, 2 workers each: (1) seconds from a cold pool to the
first graded answer (the method's remix.grade_response); (2) seconds from the SIGKILL of both workers during a task to
the next answer (by a new pool where the design has no replacement); (3) each worker's proportional set size (PSS,
/proc/PID/smaps_rollup) with the method and math-verify loaded, and again after this process writes its 1 GiB in place
(copy-on-write), with the growth of trainer + workers together; (4) whether a 1500 x 1500 matmul in a worker answers
within 10 s; (5) how many of the trainer's descriptors a worker holds (its /proc/PID/fd targets that are the trainer's)
and whether it holds the locked file; (6) whether the pool still answers after a worker died idle; (7) whether a
method file without a main guard can work (from the design, not run). Every wait is bounded (a hang reads
"hangs (>10 s)") and every process started is ended. Prints the markdown page: the table, the trainer's own PSS and
the notes.
"""

import argparse
import concurrent.futures
import fcntl
import multiprocessing
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the workers of (B) import this file as __mp_main__: keep its top cheap

ITEM = ("Halving 3 gives \\boxed{\\dfrac{3}{2}}.", ["1.5"])  # right: the rewrite and math-verify both work
LIMIT = 10.0  # seconds: past it, a call "hangs"
HANGS = f"hangs (>{LIMIT:.0f} s)"
GIB = 2**30


def grade(response: str, answers: list) -> float:
    """A worker's task in (A) and (B): the method's answer check, as report.grade_any calls it."""
    import remix

    return max(remix.grade_response(response, answer)[0] for answer in answers)


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def matmul() -> float:
    """Seconds of a 1500 x 1500 matmul here."""
    import torch

    a = torch.rand(1500, 1500)
    start = time.perf_counter()
    a @ a
    return time.perf_counter() - start


def import_torch():
    import torch  # noqa: F401 (C's warm-up: the import does not count against the matmul's deadline)


def log(line: str):
    print(line, file=sys.stderr, flush=True)


def memory(pid: int) -> dict[str, int]:
    """{"Rss": bytes, "Pss": bytes, ...} of a process, from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def targets(pid: int) -> set[str]:
    """What a process's open descriptors point at (paths, pipe:[inode], socket:[inode], anon_inode:...)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return found


def kill(pids):
    """SIGKILL each of pids that is still a worker of ours (a child of this process or of the forkserver): a pid seen
    earlier may name another program's process by now."""
    from multiprocessing import forkserver

    parents = {os.getpid(), getattr(forkserver._forkserver, "_forkserver_pid", None)}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent in parents:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass


class Fork:
    """(A) pebble's ProcessPool, fork context: a worker past its timeout or dead while busy is replaced by pebble."""

    name = "A: fork (pebble)"

    def start(self):
        import pebble

        self.pool, self.seen = pebble.ProcessPool(2, context=multiprocessing.get_context("fork")), set()

    def run(self, fn, items, timeout=LIMIT):
        futures, out = [], []
        for item in items:
            try:
                futures.append(self.pool.schedule(fn, item, timeout=timeout))
            except RuntimeError as error:  # the pool's error state
                futures.append(f"{type(error).__name__}: {error}")
        for future in futures:
            if isinstance(future, str):
                out.append(future)
                continue
            try:
                out.append(future.result(timeout=timeout + 5))
            except TimeoutError:  # pebble's own timeout (the worker killed) or ours
                out.append(HANGS)
            except Exception as error:  # noqa: BLE001 reported: ProcessExpired
                out.append(f"{type(error).__name__}: {error}")
        return out

    def pids(self) -> list[int]:
        pids = list(self.pool._pool_manager.worker_manager.workers)
        self.seen.update(pids)
        return pids

    def others(self) -> list[int]:
        return []

    def close(self):
        self.pids()
        self.pool.stop()
        self.pool.join(timeout=5)
        kill(self.seen)


class Forkserver:
    """(B) ProcessPoolExecutor on the forkserver context: a dead worker breaks the executor (BrokenProcessPool), so a
    design on it replaces the whole executor; the server stays (warm) for the next one."""

    name = "B: forkserver (ProcessPoolExecutor)"

    def start(self):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["remix", "math_verify"])
        self.context, self.seen = context, set()
        self.pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=context)

    def run(self, fn, items, timeout=LIMIT):
        futures, out = [], []
        for item in items:
            try:
                futures.append(self.pool.submit(fn, *item))
            except Exception as error:  # noqa: BLE001 reported: a broken executor refuses new work
                futures.append(f"{type(error).__name__}: {error}")
        deadline = time.monotonic() + timeout
        for future in futures:
            if isinstance(future, str):
                out.append(future)
                continue
            try:
                out.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:  # the worker still runs it: only a new executor gets rid of it
                out.append(HANGS)
                self.renew()
            except Exception as error:  # noqa: BLE001 BrokenProcessPool
                out.append(f"{type(error).__name__}: {error}")
        return out

    def renew(self):
        self.close()
        self.pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=self.context)

    def pids(self) -> list[int]:
        pids = list(self.pool._processes or {})
        self.seen.update(pids)
        return pids

    def close(self):
        self.pids()
        self.pool.shutdown(wait=False, cancel_futures=True)
        kill(self.seen)
        self.seen = set()

    def others(self) -> list[int]:
        from multiprocessing import forkserver

        return [forkserver._forkserver._forkserver_pid]

    @staticmethod
    def end_server():
        from multiprocessing import forkserver

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if pid:
            os.kill(pid, signal.SIGKILL)  # our child
            os.waitpid(pid, 0)
            forkserver._forkserver._forkserver_pid = None


class Fresh:
    """(C) machinery.grader.map_with_deadline: fresh interpreters fed over pipes, replaced when one dies."""

    name = "C: fresh interpreters (the project's)"

    def start(self):
        from machinery import grader

        self.grader, self.seen = grader, set()

    def run(self, fn, items, timeout=LIMIT):
        import remix
        from machinery import report

        if fn is grade:  # the project's own path: the method's grade_response by report.grade_many
            return [g[0] if g[1] != "timeout" else HANGS for g in report.grade_many(remix.METHOD, items, 2, timeout)]
        warm = import_torch if fn is matmul else None
        return self.grader.map_with_deadline(fn, items, 2, timeout, HANGS, warm=warm)

    def pids(self) -> list[int]:
        pids = [worker.proc.pid for worker in self.grader._pool]
        self.seen.update(pids)
        return pids

    def others(self) -> list[int]:
        return []

    def close(self):
        self.grader.close_pool()


def settle(design):
    """Every worker idle: C's warm-ups of new workers finish after the call that started them returns."""
    if isinstance(design, Fresh):
        design.grader.map_with_deadline(nap, [], 2, LIMIT, None)


def measure(design, trainer: dict) -> dict:
    """The seven measurements of one design, its pool closed after."""
    row, me = {}, os.getpid()
    alone = memory(me)["Pss"]  # the trainer before the pool (and before A's warm-up in it)
    start = time.perf_counter()
    if isinstance(design, Fork):  # the old grader warmed in the trainer, then forked: part of its cold start
        import remix

        remix.parse_boxed("1")
    design.start()
    answer = design.run(grade, [ITEM])[0]
    row["cold"] = f"{time.perf_counter() - start:.1f}" if answer == 1.0 else f"no answer ({answer})"
    log(f"{design.name}: cold start {row['cold']} s")

    design.run(grade, [ITEM] * 8)  # both workers have graded (A's and B's spread the items)
    settle(design)
    pids = design.pids()
    pool = pids + design.others()  # B: its server, whose pages its workers share
    before = {pid: memory(pid)["Pss"] for pid in pool}
    group_before = memory(me)["Pss"] + sum(before.values())
    for t in trainer["tensors"]:
        t.add_(1.0)  # the trainer changes its pages in place (an optimizer step does)
    after = {pid: memory(pid)["Pss"] for pid in pool}
    group_after = memory(me)["Pss"] + sum(after.values())
    row["pss"] = " / ".join(f"{before[p] / GIB:.2f}" for p in pids)
    row["pss_after"] = " / ".join(f"{after[p] / GIB:.2f}" for p in pids)
    row["added"] = f"{(group_before - alone) / GIB:.2f}"
    row["growth"] = f"{(group_after - group_before) / GIB:+.2f}".replace("-0.00", "+0.00")
    row["workers_pss"] = sum(before[p] for p in pids)
    row["workers_rss"] = sum(memory(pid)["Rss"] for pid in pids)
    log(f"{design.name}: PSS {row['pss']} -> {row['pss_after']} GiB, the pool adds {row['added']} GiB, trainer + "
        f"pool {row['growth']} GiB by the write")

    mine = targets(me) - {os.readlink(f"/proc/{me}/fd/{fd}") for fd in (0, 1, 2)}  # std streams: below
    held = [targets(pid) & mine for pid in pids]
    files = max(len({t for t in h if t.startswith("/")}) for h in held)
    others = max(len({t for t in h if not t.startswith("/")}) for h in held)
    locked = any(trainer["lock"] in h for h in held)
    row["fds"] = f"{files} files, {others} pipes/sockets/other; lock {'held' if locked else 'not held'}"

    result = design.run(matmul, [()])[0]
    row["matmul"] = f"{result:.2f} s" if isinstance(result, float) else result
    log(f"{design.name}: matmul {row['matmul']}")

    row["replace"] = replacement(design)
    log(f"{design.name}: replacement {row['replace']}")

    design.run(grade, [ITEM] * 4)
    settle(design)
    idle = design.pids()[:1]
    kill(idle)
    time.sleep(1.0)  # dead and idle: no task of its own
    answers = design.run(grade, [ITEM] * 4)
    wrong = [a for a in answers if a != 1.0]
    row["idle"] = "usable (4 of 4 answered)" if not wrong else f"unusable: {str(wrong[0]).split(',')[0]}"
    log(f"{design.name}: idle death {row['idle']}")
    design.close()
    return row


def replacement(design) -> str:
    """Both workers SIGKILLed during a task; seconds from the kill to the next graded answer."""
    design.run(grade, [ITEM, ITEM])
    killed = {}

    def strike():
        pids = design.pids()
        killed["at"] = time.perf_counter()
        kill(pids)

    timer = threading.Timer(2.0, strike)
    timer.start()
    design.run(nap, [(30.0,), (30.0,)], timeout=60.0)
    timer.join()
    answer = design.run(grade, [ITEM])[0]
    renewed = ""
    if answer != 1.0 and isinstance(design, Forkserver):  # its executor is broken: a new one, from the warm server
        design.renew()
        answer, renewed = design.run(grade, [ITEM])[0], " (a new executor)"
    if answer != 1.0:
        return f"no answer ({str(answer)[:60]})"
    return f"{time.perf_counter() - killed['at']:.1f}{renewed}"


NOTES = """How to read it:

- PSS (proportional set size) splits each shared page among the processes that map it; libtorch's file pages are
  shared with every other Python process on the machine too, so absolute figures move with what else runs. RSS,
  which counts every page a process maps, is the upper bound. "The pool adds" is the PSS of the trainer and its pool
  together less the trainer's alone before the pool started: what the pool costs the host.
- (1) A forks the trainer after warming math-verify in it (the old grader's order), so its workers start with
  everything loaded. B's server imports the method and math_verify (torch with them) once; C imports them in each
  worker. (2) ProcessPoolExecutor does not replace a dead worker: it breaks (BrokenProcessPool) and B's figure is for a
  new executor forked from the still-warm server. C's replacement imports torch, the method and math-verify anew in a
  fresh interpreter (mostly waiting for the busy cores here); it is paid only when a worker dies or outlives its
  deadline, and an import never counts against a deadline.
- (3) A's workers share the trainer's pages: before the write each holds a third of the 1 GiB (trainer and 2 workers
  map it); each page the trainer then changes is copied, so trainer and pool grow by the 1 GiB written, once per
  generation of workers alive. B's and C's workers hold none of the trainer's pages.
- (4) The trainer's OpenMP threads do not exist in a forked child, which waits for them forever. B's server never ran
  an OpenMP region; C's workers run one OpenMP thread (OMP_NUM_THREADS=1).
- (5) Standard streams are left out of the count: every design keeps the trainer's stderr on purpose, and B's server
  and workers also keep its stdout (here, this file). The pipes counted are the pool's own channels (C: a worker's
  stdin and stdout; B: the executor's queues and the server's), but A's workers hold every descriptor the trainer had
  at the fork, its run lock and log file among them.
- (6) pebble's pool enters its error state when a worker dies with no task; ProcessPoolExecutor breaks. C finds the
  dead worker at its next task and gives the task to a new one.
- (7) B's server also imports the method by module name for its preload, so a method file without a main guard would
  start a run in the server as well."""


GUARD = {  # (7), from each design
    "A": "works: a fork never imports the method again",
    "B": "no: each worker runs the main script again as `__mp_main__` (a run starts in every worker)",
    "C": "no: a worker imports the method's file, so a run would start; refused in one line (runner.NO_MAIN_GUARD)",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--designs", default="ABC", help="which columns to measure (default ABC)")
    cli = parser.parse_args()
    started = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams  # noqa: F401 what machinery.engines imports before an engine starts

    import remix  # noqa: F401 the method, as a run's process holds it

    trainer_memory = memory(os.getpid())
    log(f"trainer (Python, torch, vLLM, the method): PSS {trainer_memory['Pss'] / 1e9:.2f} GB")
    tensors = [torch.ones(2**25) for _ in range(8)]  # 8 x 128 MiB of fp32, every page written
    trainer_start = time.perf_counter()
    torch.rand(1500, 1500) @ torch.rand(1500, 1500)  # torch's OpenMP threads now run in the trainer
    folder = tempfile.mkdtemp(prefix="grader-workers-")
    lock = open(os.path.join(folder, "run.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    log_file = open(os.path.join(folder, "log.txt"), "a")
    trainer = {"tensors": tensors, "lock": lock.name, "matmul": time.perf_counter() - trainer_start}

    designs = []
    try:
        import pebble  # noqa: F401

        designs.append(("A", Fork()))
    except ImportError:
        log("pebble is not installed (pip install pebble==5.2.3): column A is left out")
    designs += [("B", Forkserver()), ("C", Fresh())]
    rows = {}
    try:
        for key, design in designs:
            if key in cli.designs:
                try:
                    rows[key] = measure(design, trainer)
                finally:
                    design.close()
                    Forkserver.end_server()  # B's server shares pages (libtorch's) with the next column's processes
    finally:
        Forkserver.end_server()
        lock.close()
        log_file.close()
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)

    names = {key: design.name for key, design in designs}
    lines = [
        "| measurement | " + " | ".join(names[k] for k in rows) + " |",
        "|---|" + "---|" * len(rows),
        "| (1) cold pool to the first graded answer (s) | " + " | ".join(r["cold"] for r in rows.values()) + " |",
        "| (2) SIGKILL of both busy workers to the next answer (s) | "
        + " | ".join(r["replace"] for r in rows.values()) + " |",
        "| (3) PSS per worker, method and math-verify loaded (GiB) | "
        + " | ".join(r["pss"] for r in rows.values()) + " |",
        "| (3) PSS per worker after the trainer writes its 1 GiB (GiB) | "
        + " | ".join(r["pss_after"] for r in rows.values()) + " |",
        "| (3) PSS the pool adds: trainer + pool, less the trainer before it (GiB) | "
        + " | ".join(r["added"] for r in rows.values()) + " |",
        "| (3) trainer + pool PSS grown by the write (GiB) | " + " | ".join(r["growth"] for r in rows.values()) + " |",
        f"| (4) 1500 x 1500 matmul in a worker after the trainer's ({trainer['matmul']:.2f} s there) | "
        + " | ".join(r["matmul"] for r in rows.values()) + " |",
        "| (5) the trainer's descriptors a worker holds | " + " | ".join(r["fds"] for r in rows.values()) + " |",
        "| (6) after a worker died idle | " + " | ".join(r["idle"] for r in rows.values()) + " |",
        "| (7) a method file without a main guard | " + " | ".join(GUARD[k] for k in rows) + " |",
    ]
    workers = rows.get("C")
    print("# The grader's worker pool: fork, forkserver, fresh interpreters\n")
    command = " ".join(["python benchmarks/grader_workers.py", *sys.argv[1:]])
    print(f"`{command} > docs/bench/grader_workers.md` (Python {platform.python_version()}, "
          f"torch {torch.__version__}, vLLM {vllm.__version__}; {os.cpu_count()} CPU cores, no GPU; load average "
          f"{os.getloadavg()[0]:.1f} at the end; {time.perf_counter() - started:.0f} s)\n")
    print("\n".join(lines) + "\n")
    print(f"The trainer's own process (Python, torch, vLLM and the method imported, before any tensor): PSS "
          f"{trainer_memory['Pss'] / 1e9:.2f} GB, RSS {trainer_memory['Rss'] / 1e9:.2f} GB.")
    if workers:
        print(f"Design C's 2 workers together, method and math-verify loaded: PSS "
              f"{workers['workers_pss'] / 1e9:.2f} GB, RSS {workers['workers_rss'] / 1e9:.2f} GB.")
    print("\n" + NOTES)


if __name__ == "__main__":
    main()
