"""The run's logs: metrics.jsonl (one record per step), completions.jsonl, TensorBoard and wandb, kept up to a
resumed checkpoint's step. A reader of the method may skip this module."""

import contextlib
import json
import os
import threading

from machinery import dist, runfolder, signals
from machinery.runfolder import replace_file
from machinery.messages import fail, say


def check_logs(out: str):
    """A resumed run's logs are files it can read and rewrite: a FIFO in their place would block it for good, and a
    link would be read as the run's own (its target is never written: the rewrite replaces the link)."""
    for name in ("metrics.jsonl", "completions.jsonl"):
        path = os.path.join(out, name)
        if os.path.islink(path):
            fail(str(runfolder.Linked(path)))
        if os.path.lexists(path) and not os.path.isfile(path):
            fail(f"--resume {out}: {path} is not a regular file (a FIFO, socket, device or broken link); remove it")


def read_jsonl_upto(path: str, done: int) -> list[str]:
    """The lines of a log whose step is at most done. A line that is no record with a step (a partial last line
    from a crash mid-write, or junk) is dropped with a note naming the file and line: it holds nothing to keep."""
    kept = []
    if not os.path.exists(path):
        return kept
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        try:
            if json.loads(line)["step"] <= done:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            if line.strip():
                say(f"{path}, line {number}: dropped an unreadable line"
                    + (" (a write cut short)" if number == len(lines) and not line.endswith("\n") else ""))
    return kept



def _quiet_writer_thread(report, default=threading.excepthook):
    """TensorBoard's writer thread hands a failed write (a full disk) to the next call of the main thread, where
    RunLog reports it in one line, and then re-raises it: that second report, a traceback, is not printed."""
    if not (isinstance(report.exc_value, OSError) and type(report.thread).__name__ == "_AsyncWriterThread"):
        default(report)


class RunLog:
    """metrics.jsonl (one JSON object per step), completions.jsonl, TensorBoard and, with --track, wandb; on the
    first process only. A resumed run keeps the steps up to its checkpoint and drops any logged after it. A failed
    write (a full disk) stops the run with one line; the checkpoints, written apart, stay as they were."""

    def __init__(self, out: str, config: dict, done: int, track: bool):
        self.active, self.out, self.failed = dist.rank() == 0, out, False
        if not self.active:
            return
        runfolder.writes_into(out)
        self.files = {}
        for name in ("metrics", "completions"):
            path = os.path.join(out, f"{name}.jsonl")
            with self.writing(path):
                replace_file(path, read_jsonl_upto(path, done) if done else [])
                self.files[name] = runfolder.open_file(path, "a")
        from torch.utils.tensorboard import SummaryWriter

        threading.excepthook = _quiet_writer_thread
        with self.writing(os.path.join(out, "tb")):
            runfolder.check_tree(os.path.join(out, "tb"))  # TensorBoard opens its files by name: no link in there
            self.writer = SummaryWriter(os.path.join(out, "tb"), purge_step=done + 1 if done else None)
            self.writer.add_text("args", json.dumps(config, indent=1))
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb
            with self.writing(os.path.join(out, "wandb")):  # wandb replaces its own latest-run link
                runfolder.check_tree(os.path.join(out, "wandb"), allowed=("latest-run",))
            wandb.init(project=os.environ.get("WANDB_PROJECT", "remix"), config=config, dir=out)

    @contextlib.contextmanager
    def writing(self, what: str):
        """An OSError in the block (a full disk, a file-size limit) stops the run with one line naming what."""
        try:
            yield
        except OSError as error:
            if self.failed:  # closing the logs after the failure already reported
                return
            self.failed = True
            if isinstance(error, runfolder.Unwritable):
                fail(str(error))
            fail(f"cannot write {what}: {error.strerror or error}; {signals.resume_line(self.out)}")

    def write(self, record: dict):
        if not self.active:
            return
        with self.writing(self.files["metrics"].name):
            self.files["metrics"].write(json.dumps(record) + "\n")
            self.files["metrics"].flush()
        with self.writing(os.path.join(self.out, "tb")):  # flushed each step: a failed write shows here
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def completions(self, step: int, rows: list[dict]):
        if not self.active or not rows:
            return
        with self.writing(self.files["completions"].name):
            self.files["completions"].writelines(json.dumps(row) + "\n" for row in rows)
            self.files["completions"].flush()
        with self.writing(os.path.join(self.out, "tb")):
            self.writer.add_text("completions", "\n\n".join(
                f"**step {r['step']}, reward {r['reward']}, age {r['age']}**\n\n    {r['response'][:2000]}"
                for r in rows), step)
        if self.wandb is not None:
            columns = list(rows[0])
            self.wandb.log({"completions": self.wandb.Table(columns=columns, data=[[json.dumps(r[c]) if isinstance(
                r[c], (dict, list)) else r[c] for c in columns] for r in rows])}, step=step)

    def close(self):
        if self.active:
            for f in getattr(self, "files", {}).values():
                with self.writing(f.name):
                    f.close()
            if hasattr(self, "writer"):
                with self.writing(os.path.join(self.out, "tb")):
                    self.writer.close()


def completion_rows(step: int, batch: list[dict], tokenizer, n: int, final_answer) -> list[dict]:
    """n of the step's responses, spread over the batch (fresh ones first, then historical), as records to read:
    the text, its reward and parts, the grader's status and the answer it extracted, the policy version that
    sampled it and its age (0 when fresh), its length and whether it was cut at the limit."""
    if n <= 0 or not batch:
        return []
    picked = [batch[round(i * (len(batch) - 1) / max(n - 1, 1))] for i in range(min(n, len(batch)))]
    rows = []
    for s in {id(s): s for s in picked}.values():  # each once
        response = tokenizer.decode(s["response_ids"], skip_special_tokens=True)
        rows.append({"step": step, "historical": s["version"] < step, "version": s["version"],
                     "age": step - s["version"], "prompt": tokenizer.decode(s["prompt_ids"], skip_special_tokens=True),
                     "response": response, "answer": s["answer"], "extracted": final_answer(response),
                     "reward": s["reward"], "reward_parts": s.get("reward_parts", {}), "status": s.get("status"),
                     "length": len(s["response_ids"]), "truncated": s["truncated"]})
    return rows
