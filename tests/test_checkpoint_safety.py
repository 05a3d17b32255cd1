"""Checkpoints: the layout a run keeps (the newest full, the older ones model folders, the bytes on disk after and
during each save), and checkpoints and model folders that are not what they seem: a kill while --keep-last prunes,
reduces or casts, a copy of a checkpoint under a newer name, a checkpoint folder that is a symbolic link, a file of
the newest checkpoint edited, added or deleted (its manifest's digests name it, and the previous full checkpoint
resumes), a trainer state whose manifest entry was rewritten to match but that holds a pickled object (refused by the
weights-only loader, never run), a checkpoint of another format, a FIFO where a file should be, a truncated base
model, a model whose context is shorter than the run needs, and a hub generation config that transformers refuses to
save.

    pytest -q tests/test_checkpoint_safety.py
"""

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also run as a script, under torchrun

import eval as eval_cli  # noqa: E402
import remix  # noqa: E402
from machinery import checkpoints, console, data, models, runfolder  # noqa: E402
from tests.common import (ROOT, every_file, one_error_line, read_metrics, refused_in_one_line,  # noqa: E402
                          rewrite_manifest, run_remix, tiny_args, tiny_cli, two_step_ppo_run, unlock)

DIFFERS = "differs from what was saved (its size or SHA-256 against manifest.json): damaged or edited"
HELD = ("the optimizers' moments, the critic, the replay deque, the RNG states, the step and the place in the data")


@pytest.fixture(scope="module")
def finished(tiny_model, train_file, tmp_path_factory):
    """A two-step PPO run (a critic, two optimizers) with a checkpoint after each step, keeping the last 2, both full
    (checkpoint-1 as a kill during its reduction leaves it): the resume's fallback has somewhere to go."""
    return two_step_ppo_run(tiny_model, train_file, tmp_path_factory.mktemp("finished"), keep_last=2,
                            older_full=True)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(folder, out, symlinks=True)
    return out


class FakePolicy(torch.nn.Module):
    """A policy without parameters whose save_pretrained writes a model folder's files (config.json, a stand-in for
    its weights): what checkpoints.save writes for it, the manifest lists."""

    def save_pretrained(self, folder, state_dict=None):
        Path(folder, "config.json").write_text("{}")
        Path(folder, "model.safetensors").write_bytes(b"the policy")


class FakeTokenizer:
    def save_pretrained(self, folder):
        pass


def trainer_state(step: int, run: dict | None = None) -> dict:
    """What Session.save hands checkpoints.save at step (no settings but run's, an empty deque)."""
    return {"args": {"method": {}, "run": run or {}}, "method": {"file": "remix.py", "sha256": None}, "inputs": {},
            "replay": [], "progress": {"step": step, "rollouts": 0, "tokens": 0, "data_position": 0, "bad_updates": 0},
            "in_flight": None}


def save(out: Path, step: int, keep_last: int):
    """checkpoints.save as a run calls it, without real models: the stand-in policy's model folder, a trainer state
    and an optimizer file of that step, and the manifest of them."""
    checkpoints.save(str(out), step, {"policy": FakePolicy()}, FakeTokenizer(), {}, trainer_state(step), keep_last)


def entries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def digests(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


# ----------------------------------------------------------------------------------------------
# --keep-last: crash-safe, and only ever older checkpoints than the new one
# ----------------------------------------------------------------------------------------------
def test_a_kill_while_pruning_leaves_nothing_that_the_next_save_does_not_delete(tmp_path, monkeypatch):
    """The kill lands in the middle of deleting checkpoint-1, after its trainer_state.pt is gone: checkpoint-1 was
    renamed into a .trash-* folder before the delete began, so no checkpoint-1 is left, and the next save deletes the
    trash. A checkpoint-0 without a trainer state (what such a kill left before) goes too."""
    out = tmp_path / "run"
    save(out, 1, keep_last=1)
    real_rmtree, reached = shutil.rmtree, []

    def killed_midway(path, *args, dir_fd=None, **kwargs):  # runfolder.remove passes a name within dir_fd
        state = os.path.join(path, "trainer_state.pt")
        try:
            os.stat(state, dir_fd=dir_fd)
        except FileNotFoundError:
            return real_rmtree(path, *args, dir_fd=dir_fd, **kwargs)
        os.remove(state, dir_fd=dir_fd)  # the first file the delete reached
        reached.append(path)
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save(out, 2, keep_last=1)
    monkeypatch.undo()
    assert len(reached) == 1 and reached[0].startswith(".trash-"), reached  # the kill landed in the delete
    trash = [p for p in entries(out) if p.startswith(".trash-")]
    assert entries(out) == [*trash, "checkpoint-2"] and len(trash) == 1
    assert entries(out / trash[0]) == ["config.json", "manifest.json", "model.safetensors", "optim"]
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-2")]
    assert checkpoints.verify(str(out / "checkpoint-2")) is None
    (out / "checkpoint-0").mkdir()
    (out / "checkpoint-0" / "model.safetensors").write_bytes(b"weights without a trainer state")
    save(out, 3, keep_last=1)
    assert entries(out) == ["checkpoint-3"]


def test_a_kill_while_reducing_leaves_no_resumable_folder_and_the_next_save_finishes_it(tmp_path, monkeypatch):
    """The kill lands after checkpoint-1's manifest has moved into the trash, before its trainer state: checkpoint-1
    is no resume's candidate (complete, verify) yet keeps its model folder; the next save clears the trash and
    reduces what is left."""
    out = tmp_path / "run"
    save(out, 1, keep_last=3)
    real_replace, moved = os.replace, []

    def killed_midway(src, dst, **fds):
        if moved:
            raise KeyboardInterrupt  # the process dies here
        moved.append(os.path.basename(src))
        return real_replace(src, dst, **fds)

    # runfolder.replace renames within folder descriptors: the names are bare, the trash is the target's folder
    monkeypatch.setattr(os, "replace", lambda src, dst, **fds: killed_midway(src, dst, **fds)
                        if re.match(r"\d+-", os.path.basename(str(dst)))  # reduce's moves: N-NAME in the trash
                        else real_replace(src, dst, **fds))
    with pytest.raises(KeyboardInterrupt):
        save(out, 2, keep_last=3)
    monkeypatch.undo()
    assert moved == ["manifest.json"]  # the manifest first: nothing resumes from what is left
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-2")]
    assert checkpoints.verify(str(out / "checkpoint-1")) == f"{out / 'checkpoint-1' / 'manifest.json'} is missing or " \
                                                           f"damaged"
    assert checkpoints.verify(str(out / "checkpoint-2")) is None
    assert entries(out / "checkpoint-1") == ["config.json", "model.safetensors", "optim", "trainer_state.pt"]
    assert len([p for p in entries(out) if p.startswith(".trash-")]) == 1
    save(out, 3, keep_last=3)
    assert entries(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert entries(out / "checkpoint-1") == ["config.json", "model.safetensors"]
    assert entries(out / "checkpoint-2") == ["config.json", "model.safetensors"]
    assert entries(out / "checkpoint-3") == ["config.json", "manifest.json", "model.safetensors", "optim",
                                             "trainer_state.pt"]


def test_keep_last_counts_model_folders_and_keeps_one_full_checkpoint(tmp_path):
    out = tmp_path / "run"
    for step in range(1, 6):
        save(out, step, keep_last=3)
    assert entries(out) == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    model_folder = ["config.json", "model.safetensors"]
    assert [entries(out / f"checkpoint-{k}") for k in (3, 4, 5)] == [
        model_folder, model_folder, ["config.json", "manifest.json", "model.safetensors", "optim", "trainer_state.pt"]]
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-5")]
    newest = out / "checkpoint-5"  # its manifest: every other file, its size and SHA-256, and the step
    assert manifest_of(newest) == {"format": checkpoints.FORMAT, "step": 5, "files": every_file(newest)}
    assert sorted(every_file(newest)) == ["config.json", "model.safetensors", "optim/rank-0.pt", "trainer_state.pt"]
    assert checkpoints.verify(str(newest)) is None


@pytest.mark.parametrize("keep", [3, 1, 0])
def test_a_saves_peak_is_two_full_checkpoints_and_keep_last_minus_one_model_folders(keep, tmp_path, monkeypatch):
    """The module docstring's arithmetic against what the saves leave: at a save's peak (the new checkpoint in place,
    nothing pruned yet) two full checkpoints and keep_last - 1 model folders (every earlier one with 0), between
    saves one full checkpoint and keep_last - 1 model folders."""
    out, real_prune, seen = tmp_path / "run", checkpoints.prune, []

    def census(when: str):
        folders = checkpoints.named(str(out))
        full = [f for f in folders if checkpoints.is_full(f)]
        seen.append((when, len(full), len([f for f in folders if f not in full and checkpoints.is_model_folder(f)])))

    def prune(*args):
        census("peak")
        return real_prune(*args)

    monkeypatch.setattr(checkpoints, "prune", prune)
    for step in range(1, 6):
        save(out, step, keep_last=keep)
        census("between")
    kept = (lambda n: n) if keep == 0 else (lambda n: min(n, keep - 1))  # model folders among n older ones
    expected = [(when, full, kept(older)) for step in range(1, 6)
                for when, full, older in (("peak", min(step, 2), max(step - 2, 0)), ("between", 1, step - 1))]
    assert seen == expected


def top_level_bytes(folder: Path, leave_out=("trainer_state", "manifest.json")) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.name.startswith(leave_out))


def all_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.long
@pytest.mark.slow
def test_a_default_like_schedule_keeps_one_full_state_and_model_folders_that_eval_reads(tiny_model, train_file,
                                                                                        tmp_path, monkeypatch, capsys):
    """PPO, a save every step, --keep-last 3, 4 steps: after each save the newest checkpoint is full and the older
    ones hold exactly the policy's files they held when full; the bytes on disk are the new full checkpoint plus
    those model folders, and at the save's peak (the new one renamed in, nothing pruned yet) the previous full one
    too. eval.py evaluates a reduced checkpoint; a damaged newest one stops a resume in one line naming what to do."""
    out, keep = tmp_path / "run", 3
    real_save, real_prune = checkpoints.save, checkpoints.prune
    policy_files, policy_bytes, after, peaks, listed = {}, {}, [], [], {}

    def prune(run, step, *rest):  # the peak: the new checkpoint renamed into place, the older ones as they were
        peaks.append((step, sum(all_bytes(p) for p in out.glob("checkpoint-*"))))
        return real_prune(run, step, *rest)

    def save(run, step, *rest):
        real_save(run, step, *rest)
        folder = Path(run) / f"checkpoint-{step}"
        policy_files[step] = sorted(p.name for p in folder.iterdir() if p.is_file()
                                    and p.name not in ("trainer_state.pt", "manifest.json"))
        policy_bytes[step] = top_level_bytes(folder)
        listed[step] = manifest_of(folder) == {"format": checkpoints.FORMAT, "step": step, "files": every_file(folder)}
        after.append((step, sorted(p.name for p in out.glob("checkpoint-*")),
                      sum(all_bytes(p) for p in out.glob("checkpoint-*")), all_bytes(folder)))
        return str(folder)

    monkeypatch.setattr(checkpoints, "save", save)
    monkeypatch.setattr(checkpoints, "prune", prune)
    remix.train(tiny_args(tiny_model, train_file, out, algo="ppo", steps=4, save_every=1, keep_last=keep))
    monkeypatch.undo()
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
        str(out / "checkpoint-4")).parameters())
    assert 4 * n_params <= (out / "checkpoint-4" / "model.safetensors").stat().st_size < 4 * n_params + 2**16
    for step, names, total, full in after:
        kept = list(range(max(1, step - keep + 1), step + 1))
        assert names == [f"checkpoint-{k}" for k in kept]
        assert total == full + sum(policy_bytes[k] for k in kept[:-1])  # one full state, the rest model folders
    for step, peak in peaks:
        previous = [k for k in range(max(1, step - keep), step)]  # before the prune: keep - 1 older ones
        full_before = dict((s, f) for s, _, _, f in after)
        assert peak == full_before[step] + (full_before[step - 1] - policy_bytes[step - 1] if step > 1 else 0) + \
            sum(policy_bytes[k] for k in previous)
    assert listed == {1: True, 2: True, 3: True, 4: True}  # each new checkpoint's manifest: its every file
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-4")]
    for k in (2, 3):
        folder = out / f"checkpoint-{k}"
        assert sorted(p.name for p in folder.iterdir()) == policy_files[k]  # no critic/, optim/, reference/
        assert "model.safetensors" in policy_files[k] and "config.json" in policy_files[k]
    assert {"critic", "optim", "trainer_state.pt", "manifest.json"} <= {p.name for p in
                                                                        (out / "checkpoint-4").iterdir()}
    done = run_remix("--model", str(out / "checkpoint-2"), "--benchmarks", "aime24", "--limit", "2", "--sampler", "hf",
                     "--max-tokens", "8", "--out", str(tmp_path / "eval"), program="eval.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len((tmp_path / "eval" / "samples.jsonl").read_text().splitlines()) == 2
    state = out / "checkpoint-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # this process still holds the run's lock: latest() as --resume calls it
        checkpoints.latest(str(out))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(
        f"remix: error: --resume {str(out)!r}: {state} {DIFFERS}; "), err
    assert err[0].endswith(f"no earlier checkpoint holds a training state (the optimizers' moments, the critic, the "
                           f"replay deque, the RNG states, the step and the place in the data), so "
                           f"{out / 'checkpoint-4'} is left as it is: restore the file from a copy and resume again, or "
                           f"continue from the policy saved at step 3 as a new run (--model {out / 'checkpoint-3'} and "
                           f"another --out), which starts without them and with that policy as its KL reference"), err


def test_keep_last_never_deletes_the_new_checkpoint_nor_a_folder_named_newer(tmp_path):
    out = tmp_path / "run"
    save(out, 1, keep_last=1)
    shutil.copytree(out / "checkpoint-1", out / "checkpoint-999999999999")  # an old checkpoint under a big name
    save(out, 2, keep_last=1)
    assert entries(out) == ["checkpoint-2", "checkpoint-999999999999"]
    save(out, 3, keep_last=2)
    assert entries(out) == ["checkpoint-2", "checkpoint-3", "checkpoint-999999999999"]


def test_a_checkpoint_name_that_is_a_link_is_replaced_in_one_line_and_its_target_kept(tmp_path, capsys):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    save(out, 1, keep_last=0)
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    (out / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    capsys.readouterr()
    save(out, 2, keep_last=0)
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "checkpoint-2 was a symbolic link" in said[0], said
    assert not (out / "checkpoint-2").is_symlink() and (out / "checkpoint-2" / "trainer_state.pt").is_file()
    assert entries(elsewhere) == ["notes.txt"] and entries(out) == ["checkpoint-1", "checkpoint-2"]
    (out / "checkpoint-3").symlink_to(elsewhere, target_is_directory=True)  # --overwrite removes the link only
    runfolder.prepare_out(str(out), overwrite=True)
    assert entries(out) == [] and entries(elsewhere) == ["notes.txt"]


def immutable(path: Path, on: bool = True):
    """chattr +i (-i): the path cannot be deleted, renamed or (a folder) emptied, by root too; skip where unsupported."""
    done = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True, text=True)
    if done.returncode and on:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.strip()}")


@pytest.mark.parametrize("leftover", ["a-file-that-cannot-be-deleted", "links-in-a-folder-that-cannot-be-emptied"])
def test_a_leftover_temporary_folder_that_cannot_be_deleted_stops_the_save_in_one_line(leftover, tmp_path, capsys):
    """A .tmp-checkpoint-2 an earlier save left that cannot be deleted (chattr +i: a file in it, or the folder itself
    holding links to files outside the run): the save of step 2 stops in one line naming it, exit 2, and writes
    nothing (before, it wrote into the leftover: the save went on with the leftover's file in checkpoint-2, or it
    wrote the policy through the links into the files outside)."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    save(out, 1, keep_last=0)
    tmp, elsewhere_files = out / ".tmp-checkpoint-2", {"config.json": "not the run's", "model.safetensors": "mine"}
    tmp.mkdir()
    elsewhere.mkdir()
    if leftover == "a-file-that-cannot-be-deleted":
        (tmp / "stale.bin").write_bytes(b"half")
        stuck = tmp / "stale.bin"
    else:
        for name, text in elsewhere_files.items():
            (elsewhere / name).write_text(text)
            (tmp / name).symlink_to(elsewhere / name)
        stuck = tmp
    before = digests(out / "checkpoint-1")
    immutable(stuck)
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:
            save(out, 2, keep_last=0)
    finally:
        immutable(stuck, on=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [
        f"remix: error: cannot write checkpoint {out / 'checkpoint-2'}: {tmp}, left by an earlier save, cannot be "
        f"deleted (Operation not permitted); delete it by hand (the previous checkpoints are intact)"], err
    assert entries(out) == [".tmp-checkpoint-2", "checkpoint-1"] and digests(out / "checkpoint-1") == before
    assert {p.name: p.read_text() for p in elsewhere.iterdir()} == (
        {} if leftover == "a-file-that-cannot-be-deleted" else elsewhere_files)  # nothing written through a link
    assert sorted(p.name for p in tmp.iterdir()) == (["stale.bin"] if leftover == "a-file-that-cannot-be-deleted"
                                                     else sorted(elsewhere_files))


@pytest.mark.long
@pytest.mark.slow
def test_a_resume_skips_a_misnamed_copy_and_a_link_in_one_line_each_and_clears_leftovers(finished, tmp_path):
    """checkpoint-999999999999 holds step 1 and checkpoint-5 is a link: each is named and skipped, the run resumes
    from checkpoint-2, and its save at step 3 prunes checkpoint-1 (--keep-last 2) but neither of them."""
    out, elsewhere = copy_of(finished, tmp_path), tmp_path / "elsewhere"
    shutil.copytree(out / "checkpoint-1", out / "checkpoint-999999999999")
    shutil.copytree(out / "checkpoint-2", elsewhere)
    (out / "checkpoint-5").symlink_to(elsewhere, target_is_directory=True)
    for leftover in (".trash-checkpoint-0", ".tmp-checkpoint-7"):  # what a killed prune and a killed save leave
        (out / leftover).mkdir()
        (out / leftover / "model.safetensors").write_bytes(b"half")
    done = run_remix("--resume", str(out), "--steps", "3")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = done.stdout.splitlines()
    assert f"remix: --resume: {out / 'checkpoint-999999999999'} holds step 1 (a copy or a rename); the step is what " \
           f"its manifest says; resuming from {out / 'checkpoint-5'} instead" in said, done.stdout
    assert f"remix: --resume: {out / 'checkpoint-5'} is a symbolic link, not one of the run's own checkpoints; " \
           f"resuming from {out / 'checkpoint-2'} instead" in said, done.stdout
    assert f"resuming {out} after step 2 from {out / 'checkpoint-2'}" in done.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert [p for p in entries(out) if "checkpoint" in p] == ["checkpoint-2", "checkpoint-3", "checkpoint-5",
                                                              "checkpoint-999999999999"]
    assert (out / "checkpoint-5").is_symlink() and (elsewhere / "trainer_state.pt").is_file()


# ----------------------------------------------------------------------------------------------
# A checkpoint counts once it is on the disk; older ones in the base model's dtype
# ----------------------------------------------------------------------------------------------
def policy_of(source: str):
    """A model loaded as a run's policy is (fp32 master weights, unsharded here), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), AutoTokenizer.from_pretrained(source)


def save_policy(out: Path, step: int, keep_last: int, policy, tokenizer, base: str):
    """checkpoints.save as a run calls it, with a real policy and tokenizer and no optimizer; the trainer state names
    the base model, as a run's arguments do."""
    checkpoints.save(str(out), step, {"policy": policy}, tokenizer, {}, trainer_state(step, {"model": base}),
                     keep_last)


def inode(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


def test_a_new_checkpoint_is_on_the_disk_before_the_previous_ones_training_state_is_stripped(tiny_model, tmp_path,
                                                                                             monkeypatch):
    """Every file and folder of checkpoint-2, its manifest of every other file among them, is flushed (fsync) before
    it is renamed into place, --out after that rename, and only then does checkpoint-1's training state (its manifest
    first) move into the trash: a power loss at any instant leaves a full checkpoint on the disk. Recorded: each fsync
    (by the inode of what it flushed) and each rename."""
    out = tmp_path / "run"
    policy, tokenizer = policy_of(tiny_model)
    save_policy(out, 1, 2, policy, tokenizer, tiny_model)
    events, real_fsync, real_replace = [], os.fsync, runfolder.replace

    def fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync", (info.st_dev, info.st_ino)))
        return real_fsync(fd)

    def replace(source, target):
        events.append(("rename", os.path.relpath(source, out), os.path.relpath(target, out)))
        return real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(runfolder, "replace", replace)
    save_policy(out, 2, 2, policy, tokenizer, tiny_model)
    monkeypatch.undo()
    put = events.index(("rename", ".tmp-checkpoint-2", "checkpoint-2"))
    strip = next(i for i, e in enumerate(events) if e[0] == "rename" and e[1].startswith("checkpoint-1/"))
    assert [e[:2] for e in events[strip:strip + 2]] == [("rename", "checkpoint-1/manifest.json"),
                                                        ("rename", "checkpoint-1/trainer_state.pt")], events[strip:]
    new = [out / "checkpoint-2", *(out / "checkpoint-2").rglob("*")]
    assert {"model.safetensors", "config.json", "optim", "trainer_state.pt", "manifest.json"} <= {p.name for p in new}
    assert manifest_of(out / "checkpoint-2") == {"format": checkpoints.FORMAT, "step": 2,
                                                 "files": every_file(out / "checkpoint-2")}
    synced = {key for kind, key, *_ in events[:put] if kind == "fsync"}
    assert [p.name for p in new if inode(p) not in synced] == []
    assert ("fsync", inode(out)) in events[put:strip]  # the rename itself, before the strip
    assert entries(out / "checkpoint-1") == sorted(p.name for p in new if p.is_file() and p.parent == new[0]
                                                   and p.name not in ("trainer_state.pt", "manifest.json"))


def checkpoint_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def nudged(policy):
    """The policy after a step: its fp32 weights moved by about 1e-3, to values bf16 cannot hold exactly."""
    with torch.no_grad():
        for weight in policy.parameters():
            weight.add_(torch.randn_like(weight) * 1e-3)
    return policy


def test_an_older_checkpoint_is_cast_to_the_base_models_dtype_and_the_newest_keeps_fp32(tiny_bf16_model, tmp_path):
    """A bf16 base: once checkpoint-2 is saved, checkpoint-1's weights are its fp32 weights cast to bf16 (about half
    the bytes) and its config.json says bfloat16; checkpoint-2 holds the policy's fp32 weights exactly. A loader
    (transformers, as eval.py's hf sampler loads it) reads the cast folder; the checks a resume makes pass."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    torch.manual_seed(0)
    policy, tokenizer = policy_of(tiny_bf16_model)
    save_policy(out, 1, 2, nudged(policy), tokenizer, tiny_bf16_model)
    fp32, fp32_bytes = checkpoint_weights(out / "checkpoint-1"), (out / "checkpoint-1" / "model.safetensors").stat().st_size
    save_policy(out, 2, 2, nudged(policy), tokenizer, tiny_bf16_model)
    older, newest = checkpoint_weights(out / "checkpoint-1"), checkpoint_weights(out / "checkpoint-2")
    assert set(older) == set(fp32) and all(older[k].dtype == torch.bfloat16 for k in older)
    assert all(torch.equal(older[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    assert any(not torch.equal(older[k].float(), fp32[k]) for k in fp32)  # the cast rounded: it was no copy
    trained = policy.state_dict()
    assert all(newest[k].dtype == torch.float32 and torch.equal(newest[k], trained[k]) for k in newest)
    size = (out / "checkpoint-1" / "model.safetensors").stat().st_size
    assert abs(size - fp32_bytes / 2) < 0.01 * fp32_bytes
    with safe_open(str(out / "checkpoint-1" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers' own mark, kept
    assert json.loads((out / "checkpoint-1" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "checkpoint-2" / "config.json").read_text())["dtype"] == "float32"
    assert [p for p in entries(out) if not p.startswith("checkpoint-")] == []  # no .trash-* left
    loaded = AutoModelForCausalLM.from_pretrained(str(out / "checkpoint-1"), dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], older[k].float()) for k in older)
    models.pretrained(str(out / "checkpoint-1"), torch.bfloat16)  # its weights are its config's


CAST_MEASURE = """
import os, sys, threading, time
import torch
from machinery import checkpoints, runfolder

def anonymous():  # resident bytes less the file-backed ones (safetensors reads through a memory map): the heap's
    resident, file_backed = map(int, open("/proc/self/statm").read().split()[1:3])
    return (resident - file_backed) * os.sysconf("SC_PAGE_SIZE")

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.0005)

folder, peak, done = sys.argv[1], [0], threading.Event()
runfolder.writes_into(os.path.dirname(folder))
before, watcher = anonymous(), threading.Thread(target=watch)
watcher.start()
checkpoints.cast_folder(folder, torch.bfloat16)
done.set()
watcher.join()
print(peak[0] - before)
"""


def test_an_older_checkpoints_cast_holds_one_tensor_at_a_time_in_host_memory(tmp_path):
    """A model folder of 16 fp32 tensors of 16 MiB (256 MiB) cast to bf16 in a fresh process, its heap sampled every
    half millisecond: it grows by about one tensor read and cast (8 to 24 MiB measured), under three tensors' 48 MiB;
    casting into one dict first held the whole bf16 model (128 MiB measured). The cast file holds each tensor."""
    from safetensors.torch import load_file, save_file

    folder, count, numbers = tmp_path / "run" / "checkpoint-1", 16, 4 * 2**20
    folder.mkdir(parents=True)
    save_file({f"w{i}": torch.full((numbers,), i + 0.5) for i in range(count)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"dtype": "float32"}))
    done = subprocess.run([sys.executable, "-c", CAST_MEASURE, str(folder)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    grown, tensor = int(done.stdout.split()[-1]), numbers * 4
    assert tensor / 4 < grown < 3 * tensor, grown / 2**20  # half a bf16 tensor at least: the watch saw the cast
    cast = load_file(str(folder / "model.safetensors"))
    assert set(cast) == {f"w{i}" for i in range(count)} and all(
        cast[f"w{i}"].dtype == torch.bfloat16 and torch.equal(cast[f"w{i}"], torch.full((numbers,), i + 0.5,
                                                                                        dtype=torch.bfloat16))
        for i in range(count))
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_plans_host_memory_counts_what_a_save_holds_by_hand():
    """A save holds rank 0's whole fp32 model (4 bytes a parameter), then every rank's AdamW moments copied off its GPU
    to be written (8 bytes a trained parameter, over the ranks); a prune casts a tensor at a time. 7B policy and a
    6.5B critic (PPO), beside each rank's process (read off the --offload figure, which the save does not change): one
    rank 8 x 13.5B = 108 GB (the plan said 28 GB, the model alone); two ranks on a node the same 108 GB; eight, the
    load's 8 x 28 GB is larger; with --offload the moments are on the host already."""
    from machinery import plan

    shape = plan.Shape(params=7e9, critic_params=6.5e9, tensors=300, hidden=4096, layers=32, intermediate=11008,
                       vocab=32000, kv=1024, layer_params=200e6, root_params=260e6, side_bytes=0.0)
    ppo, grpo = console.settings(remix.Args, algo="ppo"), console.settings(remix.Args, algo="grpo")
    process = plan.host(shape, ppo, 1, 1, True) - (16 * 13.5e9 + 28e9 + 28e9)  # offloaded states, the step, the model
    assert 0 < process < 5e9
    assert plan.host(shape, ppo, 1, 1, False) == process + 8 * 13.5e9
    assert plan.host(shape, ppo, 2, 2, False) == 2 * process + 108e9
    assert plan.host(shape, ppo, 8, 8, False) == 8 * (process + 28e9)
    assert plan.host(shape, grpo, 1, 1, False) == process + 56e9


@pytest.mark.parametrize("where", ["inside-the-write", "at-the-rename", "before-config-json"])
def test_a_kill_while_casting_an_older_checkpoint_leaves_whole_weights_and_the_next_save_finishes(
        where, tiny_bf16_model, tmp_path, monkeypatch):
    """The kill lands while models.write_cast has written half of checkpoint-1's bf16 file into a .trash-*
    folder, or once that file is whole there but before it is renamed over the fp32 one (either way the fp32 file is
    untouched and loads), or after the rename but before config.json says bf16 (the bf16 file is whole): checkpoint-1
    is a model folder whose weights load whole in every case, and the next save finishes the cast (the fp32 weights
    rounded to bf16, config.json saying so) and deletes what the kill left."""
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "run"
    policy, tokenizer = policy_of(tiny_bf16_model)
    save_policy(out, 1, 3, nudged(policy), tokenizer, tiny_bf16_model)
    weights_file, config_file = out / "checkpoint-1" / "model.safetensors", out / "checkpoint-1" / "config.json"
    fp32 = weights_file.read_bytes()
    real_write_cast, real_replace, real_replace_file, killed = (models.write_cast, runfolder.replace,
                                                                runfolder.replace_file, [])

    def half_written(weights, f, dtype):  # the process dies halfway through the write
        real_write_cast(weights, f, dtype)
        f.flush()
        os.ftruncate(f.fileno(), f.tell() // 2)
        killed.append(f.name)
        raise KeyboardInterrupt

    def replace(source, target):
        if os.path.abspath(target) == str(weights_file):
            killed.append(target)
            raise KeyboardInterrupt  # the cast file is whole in the trash, not renamed yet
        return real_replace(source, target)

    def replace_file(path, lines):
        if os.path.abspath(path) == str(config_file):
            killed.append(path)
            raise KeyboardInterrupt  # the bf16 file in place, config.json not yet saying so
        return real_replace_file(path, lines)

    if where == "inside-the-write":
        monkeypatch.setattr(models, "write_cast", half_written)
    elif where == "at-the-rename":
        monkeypatch.setattr(runfolder, "replace", replace)
    else:
        monkeypatch.setattr(runfolder, "replace_file", replace_file)
    with pytest.raises(KeyboardInterrupt):
        save_policy(out, 2, 3, nudged(policy), tokenizer, tiny_bf16_model)
    monkeypatch.undo()
    assert len(killed) == 1, killed  # the kill landed where it was meant to
    assert not (out / "checkpoint-1" / "trainer_state.pt").exists() and checkpoints.is_model_folder(
        str(out / "checkpoint-1"))
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-2")]
    weights = checkpoint_weights(out / "checkpoint-1")  # whole: it loads
    trash = sorted(p for p in out.iterdir() if p.name.startswith(".trash-"))
    assert json.loads(config_file.read_text())["dtype"] == "float32"
    if where in ("inside-the-write", "at-the-rename"):
        assert weights_file.read_bytes() == fp32
        assert len(trash) == 1 and entries(trash[0]) == ["model.safetensors"]  # the cast file, aside
        aside = trash[0] / "model.safetensors"
        if where == "inside-the-write":
            with pytest.raises(SafetensorError):  # half a file: not loadable
                checkpoint_weights(trash[0])
        else:
            assert {w.dtype for w in checkpoint_weights(trash[0]).values()} == {torch.bfloat16}
        assert aside.stat().st_size < len(fp32)
    else:
        assert {w.dtype for w in weights.values()} == {torch.bfloat16} and trash == []
    save_policy(out, 3, 3, nudged(policy), tokenizer, tiny_bf16_model)
    assert entries(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # no .trash-* left
    original = safetensors.torch.load(fp32)
    cast = checkpoint_weights(out / "checkpoint-1")
    assert set(cast) == set(original) and all(torch.equal(cast[k], original[k].to(torch.bfloat16)) for k in original)
    for k in (1, 2):
        assert all(w.dtype == torch.bfloat16 for w in checkpoint_weights(out / f"checkpoint-{k}").values())
        assert json.loads((out / f"checkpoint-{k}" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {w.dtype for w in checkpoint_weights(out / "checkpoint-3").values()} == {torch.float32}


@pytest.mark.long
@pytest.mark.slow
def test_a_bf16_bases_run_keeps_bf16_model_folders_that_eval_reads_and_a_new_run_starts_from(tiny_bf16_model,
                                                                                            train_file, tmp_path):
    """A run of a bf16 base with --keep-last 3: checkpoint-1 and -2 in bf16, the newest in fp32; eval.py (vLLM) on
    checkpoint-1, and a new run from it (what the line for a damaged only training state offers)."""
    out = tmp_path / "run"
    remix.train(tiny_args(tiny_bf16_model, train_file, out, algo="grpo", group_size=2, prompts_per_step=4,
                          max_response_tokens=8, steps=3, save_every=1, keep_last=3))
    for step, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (3, torch.float32)):
        assert {w.dtype for w in checkpoint_weights(out / f"checkpoint-{step}").values()} == {dtype}, step
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-3")]
    done = run_remix("--model", str(out / "checkpoint-1"), "--benchmarks", "aime24", "--limit", "2", "--max-tokens",
                     "8", "--out", str(tmp_path / "eval"), program="eval.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len((tmp_path / "eval" / "samples.jsonl").read_text().splitlines()) == 2
    again = run_remix(*tiny_cli(str(out / "checkpoint-1"), train_file, tmp_path / "again", "--steps", "1"))
    assert again.returncode == 0 and (tmp_path / "again" / "checkpoint-1" / "trainer_state.pt").is_file(), \
        again.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# A save that fails on rank 0 (which alone writes the model folders) ends every rank at once
# ----------------------------------------------------------------------------------------------
def failing_save_main(argv: list[str]):
    """torchrun --nproc-per-node 2 tests/test_checkpoint_safety.py failing-save RECORD REMIX_FLAGS...: remix.py's run,
    with rank 0's write of checkpoint-2's policy failing as on a full disk. RECORD gets the instant of the failure
    and checkpoint-1's digests then (failed.json), each rank's stopping line and instant as it reaches it
    (stop-rankR.json), and each rank's exit code (exit-rankR.json) where the rank gets to write it."""
    import errno

    import transformers

    from machinery import dist, runner

    record, flags = Path(argv[1]), argv[2:]
    out = Path(flags[flags.index("--out") + 1])
    real_write, real_fail = transformers.PreTrainedModel.save_pretrained, checkpoints.fail

    def full_disk(model, folder, *args, **kwargs):
        if dist.rank() == 0 and os.path.basename(folder) == ".tmp-checkpoint-2":
            (record / "failed.json").write_text(json.dumps({"at": time.time(),
                                                            "checkpoint-1": digests(out / "checkpoint-1")}))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(model, folder, *args, **kwargs)

    def stopping(message, *args):
        (record / f"stop-rank{dist.rank()}.json").write_text(json.dumps({"at": time.time(), "line": message}))
        real_fail(message, *args)

    transformers.PreTrainedModel.save_pretrained, checkpoints.fail = full_disk, stopping
    sys.argv = [str(ROOT / "remix.py"), *flags]
    code = 0
    try:
        runner.main(lambda: remix.train(runner.cli(remix.Args)))
    except SystemExit as stop:
        code = stop.code
    (record / f"exit-rank{dist.rank()}.json").write_text(json.dumps({"at": time.time(), "code": code}))
    sys.stderr.flush()
    os._exit(code)  # skip the process group's teardown, which can abort at exit


@pytest.mark.slow
def test_a_save_that_fails_on_rank_0_ends_every_rank_within_seconds_in_one_line(tiny_model, train_file, tmp_path):
    """PPO on 2 processes (gloo): rank 0's write of checkpoint-2's policy fails (ENOSPC). Before, rank 0 went on to
    the error exchange while rank 1 gathered the critic (a collective mismatch: gloo aborted rank 0 with no line;
    NCCL waits out --dist-timeout). Now each rank reaches the one line, which names the checkpoint and the error,
    within seconds of the failure and exits 2; checkpoint-1 is as it was, and nothing of checkpoint-2 is left."""
    out, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(29500 + (os.getpid() + 500) % 1000), __file__, "failing-save", str(record),
                           *tiny_cli(tiny_model, train_file, out, "--algo", "ppo", "--group-size", "1", "--steps", "2",
                                     "--save-every", "1", "--dist-timeout", "1")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    ended = time.time()
    assert (record / "failed.json").exists(), done.stderr[-3000:]
    failed = json.loads((record / "failed.json").read_text())
    line = f"cannot write checkpoint {out / 'checkpoint-2'}: No space left on device; the previous checkpoints are intact"
    errors = [text for text in done.stderr.splitlines() if text.startswith("remix: error:")]
    assert done.returncode != 0 and errors == [f"remix: error: {line}"], done.stderr[-3000:]
    stops = {rank: record / f"stop-rank{rank}.json" for rank in (0, 1)}
    assert all(path.exists() for path in stops.values()), done.stderr[-3000:]  # each rank learned of it itself
    for stop in (json.loads(path.read_text()) for path in stops.values()):
        assert stop["line"] == line and stop["at"] - failed["at"] < 5, (stop, failed)
    for path in record.glob("exit-rank*.json"):  # torchrun may end a rank before it writes its own
        assert json.loads(path.read_text())["code"] == 2
    assert ended - failed["at"] < 30  # the whole job, torchrun's teardown included: never --dist-timeout's wait
    assert digests(out / "checkpoint-1") == failed["checkpoint-1"] and checkpoints.complete(str(out)) == [
        str(out / "checkpoint-1")]
    assert [p for p in entries(out) if "checkpoint" in p] == ["checkpoint-1"]  # no .tmp-checkpoint-2 left


# ----------------------------------------------------------------------------------------------
# A file of the newest checkpoint edited, added or deleted: its manifest names it, and the previous checkpoint resumes
# ----------------------------------------------------------------------------------------------
def edit_state(checkpoint: Path, edit, name: str = "trainer_state.pt"):
    state = torch.load(checkpoint / name, weights_only=True)
    edit(state)
    torch.save(state, checkpoint / name)


def first_sample(state: dict) -> dict:
    return state["replay"][0][0][0]


def edit_config(checkpoint: Path, **changes):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(checkpoint: Path):
    """One weight of the model folder's safetensors moved by 1e-3, written back as safetensors."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(checkpoint / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


class Payload:
    """What a planted pickle holds: unpickled by a loader that runs code, it creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def marker_of(checkpoint: Path) -> Path:
    return checkpoint.parent.parent / "payload-ran"  # beside the run folder: no file of the run


def plant_pickle(checkpoint: Path, name: str, rewrite: bool = True):
    """An object that runs code when unpickled put into a .pt file, and (rewrite) the manifest rewritten to match it
    (its size and SHA-256 recomputed): only the weights-only loader stands between the file and a resume."""
    edit_state(checkpoint, lambda state: state.update(note=Payload(marker_of(checkpoint))), name)
    if rewrite:
        manifest = manifest_of(checkpoint)
        manifest["files"][name] = every_file(checkpoint)[name]
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def plant(path: Path, data: bytes):
    path.write_bytes(data)


EDITED = re.escape(DIFFERS)
ADDED = re.escape("is not one of the files the checkpoint was saved with")
DELETED = re.escape("is missing or not a regular file")
REFUSED = r"holds objects the safe loader refuses \(.*Unsupported global: GLOBAL exec .*\); nothing of it was run"

DAMAGES = {  # what is changed (as by hand: a .pt loaded with torch and saved back edited, a config or weights
    # rewritten, a file planted or deleted), the file the line must name, and what it must say of it
    "missing-field": (lambda c: edit_state(c, lambda s: s["progress"].pop("data_position")), "trainer_state.pt",
                      EDITED),
    "mistyped-progress": (lambda c: edit_state(c, lambda s: s["progress"].update(tokens="32")), "trainer_state.pt",
                          EDITED),
    "mistyped-argument": (lambda c: edit_state(c, lambda s: s["args"]["method"].update(actor_lr="fast")),
                          "trainer_state.pt", EDITED),
    "no-arguments": (lambda c: edit_state(c, lambda s: s.pop("args")), "trainer_state.pt", EDITED),
    "bad-torch-rng": (lambda c: edit_state(c, lambda s: s["rng"].update(torch=torch.zeros(7, dtype=torch.uint8))),
                      "trainer_state.pt", EDITED),
    "bad-python-rng": (lambda c: edit_state(c, lambda s: s["rng"].update(python=(3, (1, 2), None))),
                       "trainer_state.pt", EDITED),
    "replay-vector-too-short": (lambda c: edit_state(
        c, lambda s: first_sample(s).update(behaviour_logp=torch.zeros(3))), "trainer_state.pt", EDITED),
    "replay-token-outside-vocabulary": (lambda c: edit_state(c, lambda s: first_sample(s)["response_ids"].__setitem__(
        0, 10**6)), "trainer_state.pt", EDITED),
    "replay-sample-without-reward": (lambda c: edit_state(c, lambda s: first_sample(s).pop("reward")),
                                     "trainer_state.pt", EDITED),
    "replay-junk": (lambda c: edit_state(c, lambda s: s["replay"][0].append("junk")), "trainer_state.pt", EDITED),
    "optimizer-moment-shape": (lambda c: edit_state(
        c, lambda o: o["policy"]["state"][0].update(exp_avg=torch.zeros(5, 5)), "optim/rank-0.pt"), "optim/rank-0.pt",
        EDITED),
    "optimizer-without-critic": (lambda c: edit_state(c, lambda o: o.pop("critic"), "optim/rank-0.pt"),
                                 "optim/rank-0.pt", EDITED),
    "optimizer-lr-a-string": (lambda c: edit_state(
        c, lambda o: o["critic"]["param_groups"][0].update(lr="1e-6"), "optim/rank-0.pt"), "optim/rank-0.pt", EDITED),
    "vocabulary-changed": (lambda c: edit_config(c, vocab_size=300), "config.json", EDITED),
    "critic-hidden-size-changed": (lambda c: edit_config(c / "critic", hidden_size=64), "critic/config.json", EDITED),
    "policy-weight-nudged": (edit_weights, "model.safetensors", EDITED),
    "critic-weight-nudged": (lambda c: edit_weights(c / "critic"), "critic/model.safetensors", EDITED),
    # what the manifest newly catches: a file added, a file deleted
    "code-planted": (lambda c: plant(c / "modeling_x.py", b"open('ran', 'w').close()\n"), "modeling_x.py", ADDED),
    "pickle-planted": (lambda c: shutil.copy(c / "optim" / "rank-0.pt", c / "pytorch_model.bin"), "pytorch_model.bin",
                       ADDED),
    "pickle-planted-in-critic": (lambda c: shutil.copy(c / "optim" / "rank-0.pt", c / "critic" / "pytorch_model.bin"),
                                 "critic/pytorch_model.bin", ADDED),
    "optimizer-deleted": (lambda c: (c / "optim" / "rank-0.pt").unlink(), "optim/rank-0.pt", DELETED),
    "critic-weights-deleted": (lambda c: (c / "critic" / "model.safetensors").unlink(), "critic/model.safetensors",
                               DELETED),
    "tokenizer-deleted": (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json", DELETED),
    "empty-folder-added": (lambda c: (c / "reference").mkdir(), "reference", ADDED),  # as if reincarnated
}


def fallback_line(out: Path, damage: str) -> str:
    """The one line a resume says of the damaged newest checkpoint, as a pattern."""
    _, named, why = DAMAGES[damage]
    return rf"remix: --resume: {re.escape(str(out / 'checkpoint-2' / named))} {why}; resuming from " \
           rf"{re.escape(str(out / 'checkpoint-1'))} instead"


@pytest.mark.parametrize("damage", DAMAGES)
def test_wrong_content_in_the_newest_checkpoint_is_named_and_the_previous_one_resumes(damage, finished, tmp_path,
                                                                                       capsys):
    """Each edit of a file of checkpoint-2 (checks the code before made field by field), each file added or deleted:
    the manifest's sizes and SHA-256 name it in one line and the resume takes checkpoint-1, its state and optimizer
    shard as saved; nothing is deleted. Where the manifest was rewritten to match a pickled object, the weights-only
    loader refuses it and the payload never runs (unpickled by torch.load(weights_only=False), it does)."""
    out = copy_of(finished, tmp_path)
    assert checkpoints.verify(str(out / "checkpoint-2")) is None  # the copy as saved: only the damage is named
    change, named, _ = DAMAGES[damage]
    change(out / "checkpoint-2")
    before = digests(out)
    capsys.readouterr()
    folder, state, optim = checkpoints.latest(str(out))
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and re.fullmatch(fallback_line(out, damage), said[0]), said
    saved = torch.load(out / "checkpoint-1" / "trainer_state.pt", weights_only=True)
    assert folder == str(out / "checkpoint-1") and state["progress"] == saved["progress"] and \
        saved["progress"]["step"] == 1, said
    assert set(optim) == {"policy", "critic"} and torch.equal(
        optim["policy"]["state"][0]["exp_avg"],
        torch.load(out / "checkpoint-1" / "optim" / "rank-0.pt", weights_only=True)["policy"]["state"][0]["exp_avg"])
    assert digests(out) == before  # the damaged checkpoint is left as it is


@pytest.mark.parametrize("rewritten", [True, False], ids=["manifest-rewritten", "manifest-as-saved"])
@pytest.mark.parametrize("name", ["trainer_state.pt", "optim/rank-0.pt"])
def test_a_pickled_object_in_a_checkpoint_stops_the_resume_in_one_line_and_never_runs(name, rewritten, finished,
                                                                                      tmp_path, capsys):
    """An object planted in a .pt file of the newest checkpoint, its manifest entry rewritten to match or not: the
    weights-only loader refuses it, and the resume stops (the folder may have been tampered with) in one line that
    names the file and how to go on; nothing is deleted, and the payload, live, never runs."""
    out = copy_of(finished, tmp_path)
    plant_pickle(out / "checkpoint-2", name, rewritten)
    assert (checkpoints.verify(str(out / "checkpoint-2")) is None) == rewritten
    before = digests(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.latest(str(out))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and re.fullmatch(
        rf"remix: error: --resume {re.escape(repr(str(out)))}: {re.escape(str(out / 'checkpoint-2' / name))} "
        rf"{REFUSED}\. If this folder is yours, remove {re.escape(str(out / 'checkpoint-2'))} to resume from the "
        rf"checkpoint before it", err[0]), err
    assert digests(out) == before and not marker_of(out / "checkpoint-2").exists()
    torch.load(out / "checkpoint-2" / name, weights_only=False)  # the payload is live: a loader that runs code runs it
    assert marker_of(out / "checkpoint-2").exists()


@pytest.mark.parametrize("entries, why", [
    ({"config.json": "x"}, "missing or damaged"),  # an entry that is no object
    ("[" * 100_000 + "]" * 100_000, "missing or damaged"),  # nested past Python's recursion limit
    ({"../../outside.txt": None}, "missing or not a regular file"),  # a name outside the checkpoint: never opened
    ({"/etc/hostname": None}, "missing or not a regular file"),
])
def test_a_manifest_that_is_no_list_of_the_checkpoints_own_files_is_named_in_one_line(entries, why, finished, tmp_path,
                                                                                      capsys):
    """A manifest whose entries are not objects, or are nested too deep to read, is damaged; one that names a path
    outside its folder (with that file's real size and SHA-256) has that file read as missing: nothing outside the
    checkpoint is hashed. Each is named and the checkpoint before resumes."""
    out = copy_of(finished, tmp_path)
    newest, outside = out / "checkpoint-2", tmp_path / "outside.txt"
    outside.write_text("a file beside the run\n")
    manifest = manifest_of(newest)
    if isinstance(entries, str):
        (newest / "manifest.json").write_text(entries)
    else:
        real = {"size": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
        manifest["files"].update({k: real if v is None else v for k, v in entries.items()})
        (newest / "manifest.json").write_text(json.dumps(manifest))
    opened = []
    real_digest = data.file_digest
    data.file_digest = lambda path: opened.append(path) or real_digest(path)
    try:
        capsys.readouterr()
        folder, _, _ = checkpoints.latest(str(out))
    finally:
        data.file_digest = real_digest
    said = capsys.readouterr().out.strip().splitlines()
    assert folder == str(out / "checkpoint-1") and len(said) == 1 and why in said[0] and \
        said[0].endswith(f"resuming from {out / 'checkpoint-1'} instead"), said
    assert all(Path(p).resolve().is_relative_to(out.resolve()) for p in opened), opened


HAND_EDITS = {  # a field of checkpoint-2's trainer state removed or retyped, its manifest rewritten to match, and
    # what the one line says of it
    "world-size-removed": (lambda s: s.pop("world_size"), "state.world_size is missing"),
    "a-flag-as-a-string": (lambda s: s["args"]["run"].update(offload="false"), "state.args.offload is 'false'"),
    "a-rate-as-a-string": (lambda s: s["args"]["method"].update(actor_lr="1e-6"), "state.args.actor_lr is '1e-6'"),
    "a-choice-not-offered": (lambda s: s["args"]["method"].update(algo="dpo"), "state.args.algo is 'dpo'"),
    "numpy-rng-short": (lambda s: s["rng"]["numpy"].__setitem__(1, s["rng"]["numpy"][1][:7]),
                        "state.rng cannot be restored ("),
    "python-rng-junk": (lambda s: s["rng"].update(python=(3, (1, 2), None)), "state.rng cannot be restored ("),
    "sample-without-reward": (lambda s: first_sample(s).pop("reward"),
                              "state.replay's samples differ in their field 'reward' (one lacks it, or types differ)"),
    "sample-reward-a-string": (lambda s: first_sample(s).update(reward="1"),
                               "state.replay's samples differ in their field 'reward'"),
    "replay-batch-a-string": (lambda s: s["replay"].insert(0, "junk"), "state.replay[0] is 'junk'"),
    "step-of-checkpoint-1": (lambda s: s["progress"].update(step=1),
                             "state.progress.step is 1, its folder's and manifest's step 2"),
    "progress-count-removed": (lambda s: s["progress"].pop("tokens"), "state.progress.tokens is missing"),
    "progress-count-a-float": (lambda s: s["progress"].update(rollouts=8.0), "state.progress.rollouts is 8.0"),
    "method-record-retyped": (lambda s: s["method"].update(file=3), "state.method.file is 3"),
    "settings-not-parted": (lambda s: s.update(args={**s["args"]["method"], **s["args"]["run"]}),
                            "state.args.actor_lr is no field a save writes"),
    "inputs-a-list": (lambda s: s.update(inputs=[]), "state.inputs is []"),
    "in-flight-of-another-step": (lambda s: s.update(in_flight={"step": 2, "version": 1, "prompts": [], "drawn": []}),
                                  "state.in_flight.step is 2, not the step after its folder's, 3"),
    "in-flight-without-its-batch": (lambda s: s.update(in_flight={"step": 3, "version": 2, "prompts": []}),
                                    "state.in_flight.drawn is missing"),
}


@pytest.mark.parametrize("edit", HAND_EDITS)
def test_a_hand_edited_trainer_state_stops_the_resume_in_one_line_before_anything_is_written(edit, finished, tmp_path,
                                                                                            capsys):
    """checkpoint-2's trainer state edited by hand and its manifest rewritten to match (the digests pass): the resume
    reads it through checkpoints.check_state, which holds it to what a save writes (STATE's fields and types, the
    settings' types against the settings classes', the RNG states, the replayed samples' fields, the step), and stops
    in one line naming the field, exit 2, before anything is written (plan.json included). Before, each ended in a
    traceback after plan.json was rewritten, or (the step of checkpoint-1) resumed from step 1 over checkpoint-2."""
    out = copy_of(finished, tmp_path)
    change, said = HAND_EDITS[edit]
    edit_state(out / "checkpoint-2", change)
    rewrite_manifest(out / "checkpoint-2")
    assert checkpoints.verify(str(out / "checkpoint-2")) is None
    before = {name: value for name, value in digests(out).items() if name != runfolder.LOCK}
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:
            remix.train(console.settings(remix.Args, resume=str(out), steps=3))
    finally:
        unlock()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(
        f"remix: error: --resume {str(out)!r}: {out / 'checkpoint-2' / 'trainer_state.pt'} is not a trainer state as "
        f"this remix saves it: {said}") and err[0].endswith(
        f"If this folder is yours, remove {out / 'checkpoint-2'} to resume from the checkpoint before it"), err
    assert {name: value for name, value in digests(out).items() if name != runfolder.LOCK} == before


def test_a_run_on_a_hub_dataset_resumed_with_a_file_of_other_problems_stops_in_one_line(tiny_model, train_file,
                                                                                       tmp_path, monkeypatch, capsys):
    """A run on a hub dataset (faked in the datasets library's own cache, offline) records the SHA-256 of its problems
    and answers as read; resumed with --dataset FILE, the file's are compared with them whatever the source: other
    problems (one answer changed) stop the resume in one line before anything is written (before, it trained on
    them); the same problems in a file go on."""
    import datasets.config

    from tests.test_model_folders import fake_hub_dataset, first_answer_changed, resume_refused

    cache, out = tmp_path / "datasets", tmp_path / "run"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    fake_hub_dataset(cache, "org/tiny_set", train_file, "a" * 40, tmp_path / "build")
    small = dict(algo="grpo", group_size=2, prompts_per_step=4, max_response_tokens=8, save_every=1)
    try:
        remix.train(tiny_args(tiny_model, "org/tiny_set", out, steps=1, **small))
    finally:
        unlock()
    other, same = tmp_path / "other.jsonl", tmp_path / "same.jsonl"
    other.write_bytes(first_answer_changed(Path(train_file).read_bytes()))
    shutil.copy(train_file, same)
    problems = data.problems_of(data.read_dataset(str(same))[0], str(same), "problem", "answer")
    assert checkpoints.read_pt(str(out / "checkpoint-1" / "trainer_state.pt"))["inputs"]["problems"] == \
        hashlib.sha256(json.dumps(problems).encode()).hexdigest()
    capsys.readouterr()
    resume_refused(capsys, out, f"--resume {out}: --dataset {other} holds other problems than the run began on "
                                f"(another SHA-256 of its problems and answers as read); put back (or give the place "
                                f"of) the data the run began with, or pass --resume-changed-data", steps=2,
                   dataset=str(other))
    try:
        remix.train(console.settings(remix.Args, resume=str(out), steps=2, dataset=str(same)))
    finally:
        unlock()
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_every_trainer_state_a_run_saved_is_what_check_state_reads(finished):
    """The schema is what a save writes: both checkpoints of a real PPO run pass check_state with the settings class,
    and their states hold exactly STATE's fields (a field a save adds, and forgets to add to STATE, stops its save)."""
    for step in (1, 2):
        path = str(finished / f"checkpoint-{step}" / "trainer_state.pt")
        state = checkpoints.read_pt(path)
        assert set(state) == set(checkpoints.STATE) and set(state["progress"]) == set(checkpoints.STATE["progress"])
        checked = checkpoints.check_state(state, path, step, console.settings_type(remix.Args))
        assert checked["args"] == {**state["args"]["method"], **state["args"]["run"]}
    with pytest.raises(ValueError, match=r"not what checkpoints.STATE says \(state.extra is no field a save writes\)"):
        checkpoints.write_rank_files(str(finished), {}, {**state, "extra": 1})


def test_a_resume_of_a_folder_that_holds_no_run_deletes_nothing_in_it(tmp_path, capsys):
    """--resume of a folder that is not a run (no checkpoint in it) is refused in one line before what a killed save
    leaves (.tmp-checkpoint-*, .trash-*) is cleared: folders of those names there are someone else's."""
    folder = tmp_path / "photos"
    for name in (".trash-2024", ".tmp-checkpoint-notes"):
        (folder / name).mkdir(parents=True)
        (folder / name / "kept.txt").write_text("mine\n")
    before = digests(folder)
    with pytest.raises(SystemExit):
        checkpoints.latest(str(folder))
    assert "holds no complete checkpoint-STEP/" in capsys.readouterr().err and digests(folder) == before


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_resume_past_a_damaged_checkpoint_completes_from_the_previous_one(damage, finished, tmp_path, capsys):
    """remix.py --resume past each damage of the newest checkpoint: named in one line, resumed after step 1 from
    checkpoint-1, and the run completes step 2 and 3 (its new checkpoint-3 matching its manifest); a planted pickle
    never runs."""
    out = copy_of(finished, tmp_path)
    DAMAGES[damage][0](out / "checkpoint-2")
    capsys.readouterr()
    try:
        remix.train(console.settings(remix.Args, resume=str(out), steps=3))
    finally:
        unlock()
    said = capsys.readouterr().out.splitlines()
    assert [line for line in said if line.startswith("remix: --resume:")] == [
        line for line in said if re.fullmatch(fallback_line(out, damage), line)] != [], said
    assert f"remix: resuming {out} after step 1 from {out / 'checkpoint-1'}" in said, said
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-3")]
    assert checkpoints.verify(str(out / "checkpoint-3")) is None
    assert not marker_of(out / "checkpoint-2").exists()


@pytest.mark.long
@pytest.mark.slow
def test_a_resume_past_an_optimizer_of_the_wrong_shape_completes_from_the_previous_checkpoint(finished, tmp_path):
    """The same as remix.py runs it from the command line: the edited optimizer shard named on stdout, no
    traceback, and the run completes from checkpoint-1."""
    out = copy_of(finished, tmp_path)
    DAMAGES["optimizer-moment-shape"][0](out / "checkpoint-2")
    done = run_remix("--resume", str(out), "--steps", "3")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(fallback_line(out, "optimizer-moment-shape"), done.stdout) and "after step 1" in done.stdout, \
        done.stdout[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_when_no_checkpoint_is_left_the_resume_stops_in_one_line(finished, tmp_path, capsys):
    """Both checkpoints edited: each is named as the resume passes it, and it stops in one line; nothing deleted."""
    out = copy_of(finished, tmp_path)
    DAMAGES["replay-vector-too-short"][0](out / "checkpoint-2")
    DAMAGES["bad-torch-rng"][0](out / "checkpoint-1")
    before = digests(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.latest(str(out))
    said = capsys.readouterr()
    err = said.err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [f"remix: error: --resume {str(out)!r}: no checkpoint can be read (see "
                                                 f"above); start a new run with another --out"], err
    assert said.out.strip().splitlines() == [
        f"remix: --resume: {out / 'checkpoint-2' / 'trainer_state.pt'} {DIFFERS}; resuming from {out / 'checkpoint-1'} "
        f"instead",
        f"remix: --resume: {out / 'checkpoint-1' / 'trainer_state.pt'} {DIFFERS}; no earlier checkpoint to fall back "
        f"to"], said.out
    assert digests(out) == before


@pytest.mark.parametrize("version", [3, 2])
def test_a_run_saved_before_the_settings_parted_is_refused_on_resume_in_one_line(version, finished, tmp_path, capsys):
    """A checkpoint of this remix holds a manifest and trainer states of format 4, the method's settings and the
    run's apart; a run another version wrote (no manifest; format 3, or format 2 with the arguments one flat dict) is
    refused on --resume in one line that says how to go on, and nothing in it is changed or deleted."""
    state = torch.load(finished / "checkpoint-2" / "trainer_state.pt", weights_only=True)
    assert state["format"] == checkpoints.FORMAT == 4 and set(state["args"]) == {"method", "run"}
    assert list(state["args"]["method"]) == [f.name for f in dataclasses.fields(remix.Args)]
    assert list(state["args"]["run"]) == [f.name for f in dataclasses.fields(console.RunArgs)]
    assert manifest_of(finished / "checkpoint-2")["format"] == 4
    out = copy_of(finished, tmp_path)
    for step in (1, 2):  # as another version wrote them: no manifest, its format (2: args = asdict(args))
        (out / f"checkpoint-{step}" / "manifest.json").unlink()
        edit_state(out / f"checkpoint-{step}", lambda s: s.update(format=version) if version == 3 else s.update(
            args={**s["args"]["method"], **s["args"]["run"]}, format=version))
    before = {name: value for name, value in digests(out).items() if name != runfolder.LOCK}  # the lock: this job's
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:
            remix.train(console.settings(remix.Args, resume=str(out), steps=3))
    finally:
        unlock()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [
        f"remix: error: --resume {str(out)!r}: the run was written by another version of remix (trainer state format "
        f"{version}, this remix reads 4): finish it with the remix that wrote it, or continue from its policy as a new "
        f"run (--model {out / 'checkpoint-2'} and another --out), which starts without its optimizer state, replay "
        f"deque and place in the data"], err
    assert {name: value for name, value in digests(out).items() if name != runfolder.LOCK} == before


GARBLED = {  # a file of the only full checkpoint, and what it is made: each is named, none is deleted or advised to be
    "state-random-bytes": ("trainer_state.pt", lambda b: random.Random(1).randbytes(len(b))),
    "state-truncated": ("trainer_state.pt", lambda b: b[:200]),
    "state-zeroed-middle": ("trainer_state.pt", lambda b: b[:len(b) // 2] + bytes(1000) + b[len(b) // 2 + 1000:]),
    "optimizer-random-bytes": ("optim/rank-0.pt", lambda b: random.Random(2).randbytes(len(b))),
    "critic-weights-truncated": ("critic/model.safetensors", lambda b: b[:len(b) // 2]),
    "manifest-random-bytes": ("manifest.json", lambda b: random.Random(3).randbytes(len(b))),
}


@pytest.mark.parametrize("older", ["model-folder", "none"])
@pytest.mark.parametrize("garbled", GARBLED)
def test_a_garbled_file_in_the_only_full_checkpoint_is_left_and_the_line_says_what_can_be_done(garbled, older,
                                                                                              finished, tmp_path,
                                                                                              capsys):
    """checkpoint-2 holds the run's only training state (checkpoint-1 reduced to its model folder, or gone, as with
    --keep-last 1): the line names the garbled file as the manifest finds it (differing from what was saved, or the
    manifest itself damaged), leaves every file as it was, never says to remove it, and says what can be done:
    restore it, or a new run from the older model folder, naming what that run starts without."""
    out = copy_of(finished, tmp_path)
    runfolder.writes_into(str(out))
    if older == "model-folder":
        checkpoints.reduce(str(out / "checkpoint-1"))
    else:
        shutil.rmtree(out / "checkpoint-1")
    name, garble = GARBLED[garbled]
    path = out / "checkpoint-2" / name
    path.write_bytes(garble(path.read_bytes()))
    before = {entry: digests(out / entry) for entry in entries(out) if entry.startswith("checkpoint-")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.latest(str(out))
    err = capsys.readouterr().err.strip().splitlines()
    problem = f"{path} is missing or damaged" if name == "manifest.json" else f"{path} {DIFFERS}"
    assert exit_info.value.code == 2 and err == [
        f"remix: error: --resume {str(out)!r}: {problem}; no earlier checkpoint holds a training state ({HELD}), so "
        f"{out / 'checkpoint-2'} is left as it is: restore the file from a copy and resume again, " + (
            f"or continue from the policy saved at step 1 as a new run (--model {out / 'checkpoint-1'} and another "
            f"--out), which starts without them and with that policy as its KL reference" if older == "model-folder"
            else "or start a new run with another --out")], err
    assert {entry: digests(out / entry) for entry in entries(out) if entry.startswith("checkpoint-")} == before
    assert "remove" not in err[0] and "delete" not in err[0], err


def test_a_link_in_place_of_the_only_full_checkpoint_is_left_and_named(finished, tmp_path, capsys):
    """The newest checkpoint-STEP is a symbolic link (to a whole copy elsewhere) and the older one a model folder: the
    line names the link, and offers the run's own checkpoint put back or a new run; the link and its target stay."""
    out, elsewhere = copy_of(finished, tmp_path), tmp_path / "elsewhere" / "checkpoint-2"
    runfolder.writes_into(str(out))
    checkpoints.reduce(str(out / "checkpoint-1"))
    elsewhere.parent.mkdir()
    shutil.move(out / "checkpoint-2", elsewhere)
    (out / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    assert checkpoints.verify(str(elsewhere)) is None  # whole: only the link is named
    before = digests(elsewhere)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.latest(str(out))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [
        f"remix: error: --resume {str(out)!r}: {out / 'checkpoint-2'} is a symbolic link, not one of the run's own "
        f"checkpoints; no earlier checkpoint holds a training state ({HELD}), so {out / 'checkpoint-2'} is left as it "
        f"is: put the run's own checkpoint back and resume again, or continue from the policy saved at step 1 as a new "
        f"run (--model {out / 'checkpoint-1'} and another --out), which starts without them and with that policy as "
        f"its KL reference"], err
    assert (out / "checkpoint-2").is_symlink() and digests(elsewhere) == before


# ----------------------------------------------------------------------------------------------
# Nothing in a folder blocks: a FIFO is named, never opened
# ----------------------------------------------------------------------------------------------
def fifo_in_place_of(path: Path):
    path.unlink()
    os.mkfifo(path)


LATEST = "import sys; from machinery import checkpoints; print(checkpoints.latest(sys.argv[1])[0])"


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.safetensors", "critic/config.json", "optim/rank-0.pt", "trainer_state.pt"])
def test_a_fifo_in_the_newest_checkpoint_is_named_and_the_previous_one_used(name, finished, tmp_path):
    out = copy_of(finished, tmp_path)
    fifo_in_place_of(out / "checkpoint-2" / name)
    done = subprocess.run([sys.executable, "-c", LATEST, str(out)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{out / 'checkpoint-2' / name} is not a regular file" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == str(out / "checkpoint-1")


@pytest.mark.long
@pytest.mark.slow
def test_a_fifo_in_place_of_a_log_stops_a_resume_in_one_line(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    fifo_in_place_of(out / "metrics.jsonl")
    done = run_remix("--resume", str(out), "--steps", "3", timeout=120)
    one_error_line(done, f"{out / 'metrics.jsonl'} is not a regular file")


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("program", ["remix.py", "eval.py"])
def test_a_fifo_in_the_model_folder_is_named_before_anything_is_written(program, tiny_model, train_file, tmp_path):
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny_model, model)
    fifo_in_place_of(model / "tokenizer.json")
    argv = tiny_cli(str(model), train_file, out) if program == "remix.py" else \
        ["--model", str(model), "--out", str(out), "--limit", "1", "--sampler", "hf"]
    done = run_remix(*argv, program=program, timeout=120)
    one_error_line(done, f"{model / 'tokenizer.json'} is not a regular file", prog=program.removesuffix(".py"))
    assert not out.exists()


@pytest.mark.long
@pytest.mark.slow
def test_eval_names_a_fifo_in_the_out_folder_it_continues_before_reading_it(tiny_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = eval_cli.EvalArgs(model=tiny_model, out=str(out), limit=1, sampler="hf")
    (out / "settings.json").write_text(json.dumps(eval_cli.settings_of(args)))  # an evaluation to continue
    os.mkfifo(out / "samples.jsonl")  # opening it would wait for a writer forever
    done = run_remix("--model", tiny_model, "--out", str(out), "--limit", "1", "--sampler", "hf", program="eval.py",
                     timeout=120)
    one_error_line(done, f"{out / 'samples.jsonl'} is not a regular file", prog="eval")


# ----------------------------------------------------------------------------------------------
# The base model: whole weights, and a context long enough, before --out is touched
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("program", ["remix", "eval"])
def test_a_truncated_base_model_is_one_line_and_leaves_no_lock(program, tiny_model, train_file, tmp_path, capsys):
    """remix.py refuses it as it loads the model (models.pretrained), before --out is made; eval.py as its sampler
    starts, before --out is written: safetensors' own reason, in one line of the program's own name."""
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = refused_in_one_line(program, model, train_file, out, capsys)  # exit 2, one line, nothing at out: no lock
    assert line.startswith(f"{program}: error: cannot load model {str(model)!r}: SafetensorError: Error while "
                           f"deserializing header"), line


def short_context_model(tiny_model: str, folder: Path, length: int) -> str:
    shutil.copytree(tiny_model, folder)
    edit_config(folder, max_position_embeddings=length)
    return str(folder)


def test_a_model_context_shorter_than_the_run_needs_is_one_line_before_anything_is_written(tiny_model, train_file,
                                                                                           tmp_path, capsys):
    """vLLM would refuse max_model_len 1024 + 24 for a model of 512 positions, after the models had loaded."""
    model, out = short_context_model(tiny_model, tmp_path / "model", 512), tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        remix.train(tiny_args(model, train_file, out, sampler="vllm"))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert "takes at most 512 tokens (max_position_embeddings in config.json)" in err[0]
    assert "the run needs 1048: --max-prompt-tokens 1024 plus --max-response-tokens 24" in err[0]
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_info:  # eval: its longest prompt plus --max-tokens
        eval_cli.main(eval_cli.EvalArgs(model=model, out=str(out), limit=1, benchmarks=("math500",)))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "takes at most 512 tokens" in err[0], err
    assert "plus --max-tokens 8192" in err[0] and not out.exists()


def test_the_context_is_what_vllm_derives_from_the_config(tiny_model, tmp_path):
    """Its max_position_embeddings, times a linear RoPE factor, at most the tokenizer's limit."""
    from machinery import models
    from transformers import AutoTokenizer

    model = short_context_model(tiny_model, tmp_path / "model", 224)
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert models.context_length(model, tokenizer) == (224, "max_position_embeddings in config.json")
    edit_config(Path(model), rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert models.context_length(model, tokenizer)[0] == 448
    tokenizer.model_max_length = 300  # vLLM takes the tokenizer's limit too
    assert models.context_length(model, tokenizer) == (300, "model_max_length in tokenizer_config.json")


# ----------------------------------------------------------------------------------------------
# A hub generation config that transformers loads but refuses to save
# ----------------------------------------------------------------------------------------------
def test_sampling_values_without_do_sample_save_with_every_checkpoint_which_loads_and_resumes(tiny_model, train_file,
                                                                                              tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.95)  # as many hub models have it: no do_sample
    (model / "generation_config.json").write_text(json.dumps(config))
    small = dict(algo="grpo", group_size=2, prompts_per_step=4, max_response_tokens=8, save_every=1)
    remix.train(tiny_args(str(model), train_file, out, steps=2, **small))
    assert "sets sampling values without do_sample" in capsys.readouterr().out
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2").generation_config
    saved.validate(strict=True)
    assert (saved.temperature, saved.top_p, saved.do_sample) == (0.6, 0.95, True)
    remix.train(tiny_args(str(model), train_file, out, steps=3, resume=str(out), **small))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3] and (out / "checkpoint-3" / "trainer_state.pt").is_file()


if __name__ == "__main__" and len(sys.argv) > 1:
    {"failing-save": failing_save_main}[sys.argv[1]](sys.argv[1:])
