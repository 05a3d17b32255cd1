"""Checkpoints: the layout a run keeps (the newest full, the older ones model folders, the bytes on disk after and
during each save), and checkpoints and model folders that are not what they seem: a kill while --keep-last prunes or
reduces, a copy of a checkpoint
under a newer name, a checkpoint folder that is a symbolic link, a trainer state or optimizer shard that the safe
loader accepts but whose content is wrong, a FIFO where a file should be, a truncated base model, a model whose
context is shorter than the run needs, and a hub generation config that transformers refuses to save.

    pytest -q tests/test_checkpoint_safety.py
"""

import dataclasses
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
from machinery import checkpoints, flags, runfolder  # noqa: E402
from tests.common import (ROOT, one_error_line, read_metrics, refused_in_one_line, run_remix, tiny_args,  # noqa: E402
                          tiny_cli, two_step_ppo_run)

DEFAULTS = dataclasses.asdict(flags.settings(remix.Args))


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


def save(out: Path, step: int, keep_last: int) -> str:
    """checkpoints.save as a run calls it, without models: a trainer state and an optimizer file of that step, and
    a config.json put in afterwards as the policy's model folder would hold it."""
    folder = checkpoints.save(str(out), step, {}, None, {}, {"progress": {"step": step}}, keep_last)
    Path(folder, "config.json").write_text("{}")
    return folder


def entries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def digests(folder: Path) -> dict:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


# ----------------------------------------------------------------------------------------------
# --keep-last: crash-safe, and only ever older checkpoints than the new one
# ----------------------------------------------------------------------------------------------
def test_a_kill_while_pruning_leaves_nothing_that_the_next_save_does_not_delete(tmp_path, monkeypatch):
    """The kill lands in the middle of deleting checkpoint-1, after its trainer_state.pt is gone: the next save
    deletes what is left. A checkpoint-0 without a trainer state (what such a kill left before) goes too."""
    out = tmp_path / "run"
    save(out, 1, keep_last=1)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, dir_fd=None, **kwargs):  # runfolder.remove passes a name within dir_fd
        state = os.path.join(path, "trainer_state.pt")
        try:
            os.stat(state, dir_fd=dir_fd)
        except FileNotFoundError:
            return real_rmtree(path, *args, dir_fd=dir_fd, **kwargs)
        os.remove(state, dir_fd=dir_fd)  # the first file the delete reached
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save(out, 2, keep_last=1)
    monkeypatch.undo()
    (out / "checkpoint-0").mkdir()
    (out / "checkpoint-0" / "model.safetensors").write_bytes(b"weights without a trainer state")
    save(out, 3, keep_last=1)
    assert entries(out) == ["checkpoint-3"]


def test_a_kill_while_reducing_leaves_no_resumable_folder_and_the_next_save_finishes_it(tmp_path, monkeypatch):
    """The kill lands after checkpoint-1's trainer state has moved into the trash, before its optimizer: checkpoint-1
    is no resume's candidate (complete, latest's list) yet keeps its model folder; the next save clears the trash
    and reduces what is left."""
    out = tmp_path / "run"
    save(out, 1, keep_last=3)
    (out / "checkpoint-1" / "model.safetensors").write_bytes(b"the policy")
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
    Path(out, "checkpoint-2", "config.json").write_text("{}")  # what the interrupted helper had still to write
    assert moved == ["trainer_state.pt"]  # the trainer state first: nothing resumes from what is left
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-2")]
    assert entries(out / "checkpoint-1") == ["config.json", "model.safetensors", "optim"]
    assert len([p for p in entries(out) if p.startswith(".trash-")]) == 1
    save(out, 3, keep_last=3)
    assert entries(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert entries(out / "checkpoint-1") == ["config.json", "model.safetensors"]
    assert entries(out / "checkpoint-2") == ["config.json"]
    assert entries(out / "checkpoint-3") == ["config.json", "optim", "trainer_state.pt"]


def test_keep_last_counts_model_folders_and_keeps_one_full_checkpoint(tmp_path):
    out = tmp_path / "run"
    for step in range(1, 6):
        save(out, step, keep_last=3)
    assert entries(out) == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    assert [entries(out / f"checkpoint-{k}") for k in (3, 4, 5)] == [
        ["config.json"], ["config.json"], ["config.json", "optim", "trainer_state.pt"]]
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-5")]


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


def top_level_bytes(folder: Path, leave_out=("trainer_state",)) -> int:
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
    policy_files, policy_bytes, after, peaks = {}, {}, [], []

    def prune(run, step, *rest):  # the peak: the new checkpoint renamed into place, the older ones as they were
        peaks.append((step, sum(all_bytes(p) for p in out.glob("checkpoint-*"))))
        return real_prune(run, step, *rest)

    def save(run, step, *rest):
        folder = Path(real_save(run, step, *rest))
        policy_files[step] = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "trainer_state.pt")
        policy_bytes[step] = top_level_bytes(folder)
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
    assert checkpoints.complete(str(out)) == [str(out / "checkpoint-4")]
    for k in (2, 3):
        folder = out / f"checkpoint-{k}"
        assert sorted(p.name for p in folder.iterdir()) == policy_files[k]  # no critic/, optim/, reference/
        assert "model.safetensors" in policy_files[k] and "config.json" in policy_files[k]
    assert {"critic", "optim", "trainer_state.pt"} <= {p.name for p in (out / "checkpoint-4").iterdir()}
    done = run_remix("--model", str(out / "checkpoint-2"), "--benchmarks", "aime24", "--limit", "2", "--sampler", "hf",
                     "--max-tokens", "8", "--out", str(tmp_path / "eval"), program="eval.py")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len((tmp_path / "eval" / "samples.jsonl").read_text().splitlines()) == 2
    state = out / "checkpoint-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # this process still holds the run's lock: latest() as --resume calls it
        checkpoints.latest(str(out), DEFAULTS)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("remix: error: --resume"), err
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
    assert "checkpoint-999999999999/trainer_state.pt holds step 1, but its folder is named" in done.stdout
    assert f"{out / 'checkpoint-5'} is a symbolic link" in done.stdout
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


def save_policy(out: Path, step: int, keep_last: int, policy, tokenizer, base: str) -> str:
    """checkpoints.save as a run calls it, with a real policy and tokenizer and no optimizer; the trainer state names
    the base model, as a run's arguments do."""
    return checkpoints.save(str(out), step, {"policy": policy}, tokenizer, {},
                            {"args": {"method": {}, "run": {"model": base}}, "progress": {"step": step}}, keep_last)


def inode(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


def test_a_new_checkpoint_is_on_the_disk_before_the_previous_ones_training_state_is_stripped(tiny_model, tmp_path,
                                                                                             monkeypatch):
    """Every file and folder of checkpoint-2 is flushed (fsync) before it is renamed into place, --out after that
    rename, and only then does checkpoint-1's trainer state move into the trash: a power loss at any instant leaves
    a full checkpoint on the disk. Recorded: each fsync (by the inode of what it flushed) and each rename."""
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
    strip = next(i for i, e in enumerate(events) if e[0] == "rename" and e[1] == "checkpoint-1/trainer_state.pt")
    new = [out / "checkpoint-2", *(out / "checkpoint-2").rglob("*")]
    assert {"model.safetensors", "config.json", "optim", "trainer_state.pt"} <= {p.name for p in new}
    synced = {key for kind, key, *_ in events[:put] if kind == "fsync"}
    assert [p.name for p in new if inode(p) not in synced] == []
    assert ("fsync", inode(out)) in events[put:strip]  # the rename itself, before the strip
    assert entries(out / "checkpoint-1") == sorted(p.name for p in new if p.is_file() and p.parent == new[0]
                                                   and p.name != "trainer_state.pt")


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

    from machinery import safeload

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
    safeload.check_weights(str(out / "checkpoint-1"), *safeload.model_parameters(str(out / "checkpoint-1"))[::2])


@pytest.mark.parametrize("where", ["writing-the-cast-file", "before-config-json"])
def test_a_kill_while_casting_an_older_checkpoint_leaves_whole_weights_and_the_next_save_finishes(
        where, tiny_bf16_model, tmp_path, monkeypatch):
    """The kill lands while checkpoint-1's bf16 file is half written (its fp32 file is untouched and loads), or after
    it replaced the fp32 one but before config.json says so (the bf16 file is whole): checkpoint-1 is a model folder
    either way, and the next save finishes the cast and deletes what the kill left."""
    from machinery import models

    out = tmp_path / "run"
    policy, tokenizer = policy_of(tiny_bf16_model)
    save_policy(out, 1, 3, nudged(policy), tokenizer, tiny_bf16_model)
    fp32 = (out / "checkpoint-1" / "model.safetensors").read_bytes()
    real_write = models.write_cast

    class KilledMidway:  # the open fp32 file, whose third tensor is never read: the process dies there
        def __init__(self, weights):
            self.weights, self.read = weights, 0

        def __getattr__(self, name):
            return getattr(self.weights, name)

        def get_tensor(self, name):
            self.read += 1
            if self.read == 3:
                raise KeyboardInterrupt
            return self.weights.get_tensor(name)

    if where == "writing-the-cast-file":
        monkeypatch.setattr(models, "write_cast", lambda weights, *rest: real_write(KilledMidway(weights), *rest))
    else:
        monkeypatch.setattr(models, "state_dtype", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save_policy(out, 2, 3, nudged(policy), tokenizer, tiny_bf16_model)
    monkeypatch.undo()
    assert not (out / "checkpoint-1" / "trainer_state.pt").exists() and checkpoints.is_model_folder(
        str(out / "checkpoint-1"))
    weights = checkpoint_weights(out / "checkpoint-1")  # whole: it loads
    if where == "writing-the-cast-file":
        assert (out / "checkpoint-1" / "model.safetensors").read_bytes() == fp32
        assert len([p for p in entries(out) if p.startswith(".trash-")]) == 1  # the half-written file, aside
    else:
        assert all(w.dtype == torch.bfloat16 for w in weights.values())
        assert json.loads((out / "checkpoint-1" / "config.json").read_text())["dtype"] == "float32"
    save_policy(out, 3, 3, nudged(policy), tokenizer, tiny_bf16_model)
    assert entries(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for k in (1, 2):
        assert all(w.dtype == torch.bfloat16 for w in checkpoint_weights(out / f"checkpoint-{k}").values())
        assert json.loads((out / f"checkpoint-{k}" / "config.json").read_text())["dtype"] == "bfloat16"


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
# Content the safe loader accepts but a resume cannot use: named, and the previous checkpoint resumes
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


DAMAGES = {  # what is changed, and the file the line must name
    "missing-field": (lambda c: edit_state(c, lambda s: s["progress"].pop("data_position")), "trainer_state.pt"),
    "mistyped-progress": (lambda c: edit_state(c, lambda s: s["progress"].update(tokens="32")), "trainer_state.pt"),
    "mistyped-argument": (lambda c: edit_state(c, lambda s: s["args"]["method"].update(actor_lr="fast")),
                          "trainer_state.pt"),
    "no-arguments": (lambda c: edit_state(c, lambda s: s.pop("args")), "trainer_state.pt"),
    "bad-torch-rng": (lambda c: edit_state(c, lambda s: s["rng"].update(torch=torch.zeros(7, dtype=torch.uint8))),
                      "trainer_state.pt"),
    "bad-python-rng": (lambda c: edit_state(c, lambda s: s["rng"].update(python=(3, (1, 2), None))),
                       "trainer_state.pt"),
    "replay-vector-too-short": (lambda c: edit_state(
        c, lambda s: first_sample(s).update(behaviour_logp=torch.zeros(3))), "trainer_state.pt"),
    "replay-token-outside-vocabulary": (lambda c: edit_state(c, lambda s: first_sample(s)["response_ids"].__setitem__(
        0, 10**6)), "trainer_state.pt"),
    "replay-sample-without-reward": (lambda c: edit_state(c, lambda s: first_sample(s).pop("reward")),
                                     "trainer_state.pt"),
    "replay-junk": (lambda c: edit_state(c, lambda s: s["replay"][0].append("junk")), "trainer_state.pt"),
    "optimizer-moment-shape": (lambda c: edit_state(
        c, lambda o: o["policy"]["state"][0].update(exp_avg=torch.zeros(5, 5)), "optim/rank-0.pt"), "optim/rank-0.pt"),
    "optimizer-without-critic": (lambda c: edit_state(c, lambda o: o.pop("critic"), "optim/rank-0.pt"),
                                 "optim/rank-0.pt"),
    "optimizer-lr-a-string": (lambda c: edit_state(
        c, lambda o: o["critic"]["param_groups"][0].update(lr="1e-6"), "optim/rank-0.pt"), "optim/rank-0.pt"),
    "vocabulary-changed": (lambda c: edit_config(c, vocab_size=300), "config.json"),
    "critic-hidden-size-changed": (lambda c: edit_config(c / "critic", hidden_size=64), "critic/config.json"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_wrong_content_in_the_newest_checkpoint_is_named_and_the_previous_one_resumes(damage, finished, tmp_path,
                                                                                       capsys):
    out = copy_of(finished, tmp_path)
    change, named = DAMAGES[damage]
    change(out / "checkpoint-2")
    folder, state, optim = checkpoints.latest(str(out), DEFAULTS)
    said = capsys.readouterr().out.strip().splitlines()
    assert folder == str(out / "checkpoint-1") and state["progress"]["step"] == 1 and optim, said
    assert len(said) == 1 and str(out / "checkpoint-2" / named) in said[0], said
    assert said[0].endswith(f"resuming from {out / 'checkpoint-1'} instead")


def test_when_no_checkpoint_is_left_the_resume_stops_in_one_line(finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    DAMAGES["replay-vector-too-short"][0](out / "checkpoint-2")
    DAMAGES["bad-torch-rng"][0](out / "checkpoint-1")
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.latest(str(out), DEFAULTS)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "no checkpoint can be read" in err[0], err


def test_a_run_saved_before_the_settings_parted_is_refused_on_resume_in_one_line(finished, tmp_path, capsys):
    """A checkpoint saves the method's settings and the run's apart; a run written before they parted (its trainer
    states as the code before wrote them: format 2, the arguments one flat dict) is refused on --resume in one line
    that says how to go on, and nothing in it is changed."""
    state = torch.load(finished / "checkpoint-2" / "trainer_state.pt", weights_only=True)
    assert state["format"] == checkpoints.FORMAT and set(state["args"]) == {"method", "run"}
    assert list(state["args"]["method"]) == [f.name for f in dataclasses.fields(remix.Args)]
    assert list(state["args"]["run"]) == [f.name for f in dataclasses.fields(flags.RunArgs)]
    out = copy_of(finished, tmp_path)
    for step in (1, 2):  # as the code before wrote them: {**trainer_state, ..., "format": 2}, args = asdict(args)
        edit_state(out / f"checkpoint-{step}", lambda s: s.update(args={**s["args"]["method"], **s["args"]["run"]},
                                                                  format=2))
    before = {name: value for name, value in digests(out).items() if name != runfolder.LOCK}  # the lock: this job's
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:
            remix.train(flags.settings(remix.Args, resume=str(out), steps=3))
    finally:
        runfolder.unlock()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [
        f"remix: error: --resume {str(out)!r}: the run was written by a remix from before the method's settings and "
        f"the run's were saved apart (trainer state format 2, this remix reads {checkpoints.FORMAT}): finish it with "
        f"the remix that wrote it, or continue from its policy as a new run (--model {out / 'checkpoint-2'} and "
        f"another --out), which starts without its optimizer state, replay deque and place in the data"], err
    assert {name: value for name, value in digests(out).items() if name != runfolder.LOCK} == before


GARBLED = {  # a file of the only full checkpoint, and what it is made: each is named, none is deleted or advised to be
    "state-random-bytes": ("trainer_state.pt", lambda b: random.Random(1).randbytes(len(b))),
    "state-truncated": ("trainer_state.pt", lambda b: b[:200]),
    "state-zeroed-middle": ("trainer_state.pt", lambda b: b[:len(b) // 2] + bytes(1000) + b[len(b) // 2 + 1000:]),
    "optimizer-random-bytes": ("optim/rank-0.pt", lambda b: random.Random(2).randbytes(len(b))),
}


@pytest.mark.parametrize("older", ["model-folder", "none"])
@pytest.mark.parametrize("garbled", GARBLED)
def test_a_garbled_file_in_the_only_full_checkpoint_is_left_and_the_line_says_what_can_be_done(garbled, older,
                                                                                              finished, tmp_path,
                                                                                              capsys):
    """checkpoint-2 holds the run's only training state (checkpoint-1 reduced to its model folder, or gone, as with
    --keep-last 1): whether the safe loader refuses the garbled file or finds it damaged, the line names it, leaves
    every file as it was, never says to remove it, and says what can be done: restore it, or a new run from the
    older model folder, naming what that run starts without."""
    out = copy_of(finished, tmp_path)
    runfolder.writes_into(str(out))
    if older == "model-folder":
        checkpoints.reduce(str(out / "checkpoint-1"))
    else:
        shutil.rmtree(out / "checkpoint-1")
    name, garble = GARBLED[garbled]
    (out / "checkpoint-2" / name).write_bytes(garble((out / "checkpoint-2" / name).read_bytes()))
    before = {entry: digests(out / entry) for entry in entries(out) if entry.startswith("checkpoint-")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.latest(str(out), DEFAULTS)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and str(out / "checkpoint-2" / name) in err[0], err
    assert {entry: digests(out / entry) for entry in entries(out) if entry.startswith("checkpoint-")} == before
    assert "remove" not in err[0] and "delete" not in err[0], err
    assert f"; no earlier checkpoint holds a training state (the optimizers' moments, the critic, the replay deque, " \
           f"the RNG states, the step and the place in the data), so {out / 'checkpoint-2'} is left as it is: restore " \
           f"the file from a copy and resume again, " in err[0], err
    assert err[0].endswith(f"or continue from the policy saved at step 1 as a new run (--model {out / 'checkpoint-1'} "
                           f"and another --out), which starts without them and with that policy as its KL reference"
                           if older == "model-folder" else "or start a new run with another --out"), err


def test_a_link_in_place_of_the_only_full_checkpoint_is_left_and_named(finished, tmp_path, capsys):
    """The newest checkpoint-STEP is a symbolic link (to a whole copy elsewhere) and the older one a model folder: the
    line names the link, and offers the run's own checkpoint put back or a new run; the link and its target stay."""
    out, elsewhere = copy_of(finished, tmp_path), tmp_path / "elsewhere"
    runfolder.writes_into(str(out))
    checkpoints.reduce(str(out / "checkpoint-1"))
    shutil.move(out / "checkpoint-2", elsewhere)
    (out / "checkpoint-2").symlink_to(elsewhere, target_is_directory=True)
    before = digests(elsewhere)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        checkpoints.latest(str(out), DEFAULTS)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out / 'checkpoint-2'} is a symbolic link" in err[0], err
    assert f"is left as it is: put the run's own checkpoint back and resume again, or continue from the policy saved " \
           f"at step 1 as a new run (--model {out / 'checkpoint-1'} and another --out)" in err[0], err
    assert (out / "checkpoint-2").is_symlink() and digests(elsewhere) == before


@pytest.mark.long
@pytest.mark.slow
def test_a_resume_past_an_optimizer_of_the_wrong_shape_completes_from_the_previous_checkpoint(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    DAMAGES["optimizer-moment-shape"][0](out / "checkpoint-2")
    done = run_remix("--resume", str(out), "--steps", "3")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-1'} instead" in done.stdout and "after step 1" in done.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


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
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert f"{weights} is damaged" in refused_in_one_line(program, model, train_file, out, capsys)  # no lock left


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
