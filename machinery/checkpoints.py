"""Checkpoints: written atomically, rotated, and read back for a resume without running anything they hold.

Written by every rank, each holds everything a resumed run needs. A reader of the method may skip this module.

    checkpoint-STEP/             the policy and tokenizer: a plain transformers / vLLM model folder (safetensors)
        critic/, reference/      the critic (PPO) and, once reincarnated, the reference, likewise
        optim/rank-R.pt          each rank's shard of both optimizers' state: tensors and numbers only
        trainer_state.pt         rank 0's progress, arguments, replay deque and RNG states; -rankR.pt for rank R

Only the newest checkpoint is full. Once a new one is on the disk (every file and folder flushed) and renamed into
place, every older one that --keep-last keeps is reduced to its policy model folder (weights, config.json,
generation_config.json, tokenizer files: what eval.py and vLLM load), its weights cast to the base model's dtype
(machinery.models; the newest keeps the fp32 master weights, so a resume is exact): a resume needs only the
newest, and the older ones are kept for evaluation. So a save's peak on disk is two full checkpoints (the new one and
the last) plus keep_last - 1 model folders (every earlier save's with --keep-last 0), and between saves one full
checkpoint and keep_last - 1 model folders.

Every .pt file holds only tensors, numbers, strings, lists, tuples and dicts, and is read with torch's
weights-only loader, which refuses anything else (a pickled object that could run code); model weights are
safetensors (machinery.safeload reads them). Every file is checked before it is used: its type (no FIFO, which would
block), its fields and shapes against what save() writes (machinery.safeload), each model's weights against its
config. A damaged,
tampered, misnamed (the step is what trainer_state.pt says) or linked checkpoint is named in one line, and --resume
falls back to the previous full one if there is one (a kill during a reduction can leave one); the only one holding
a training state is left as it is, the line saying what can be done. Deletes and reductions are crash-safe: what goes
is renamed into a .trash-* folder first (trainer_state.pt first), then removed.
"""

import glob
import os
import random
import re
import sys

import numpy as np
import torch

from machinery import dist, flags, models, paths, runfolder, safeload
from machinery.console import fail, say
from machinery.models import base_dtype  # save() holds the models under the name models

FORMAT = 3  # 1: optimizers in torch.distributed.checkpoint's format, trainer state pickled (no longer read)
FLAT_SETTINGS = 2  # the arguments as one dict, before the method's and the run's settings parted: refused in one line
TRAINING_PARTS = ("critic", "reference", "optim")  # with trainer_state*.pt: what an older checkpoint loses


def state_file(folder: str, r: int) -> str:
    return os.path.join(folder, "trainer_state.pt" if r == 0 else f"trainer_state-rank{r}.pt")


def optim_file(folder: str, r: int) -> str:
    return os.path.join(folder, "optim", f"rank-{r}.pt")


def rng_state() -> dict:
    """Every RNG a step draws from, as plain values (numpy's state array as a list of ints)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(dist.device())  # this rank's own GPU only
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], dist.device())


def optimizer_shard(model, optim) -> dict:
    """This rank's part of an optimizer's state: each DTensor (FSDP2) as its local shard."""
    state = optim.state_dict()
    local = {index: {key: (value.to_local() if hasattr(value, "to_local") else value).detach().cpu()
                     if torch.is_tensor(value) else value for key, value in entry.items()}
             for index, entry in state["state"].items()}
    return {"state": local, "param_groups": state["param_groups"]}


def load_optimizer_shard(model, optim, shard: dict):
    """The inverse of optimizer_shard: each local shard back into a DTensor placed like its parameter."""
    params = [p for group in optim.param_groups for p in group["params"]]
    state = {}
    for index, entry in shard["state"].items():
        param = params[index]
        state[index] = {}
        for key, value in entry.items():
            if torch.is_tensor(value) and hasattr(param, "device_mesh") and key != "step":
                from torch.distributed.tensor import DTensor

                value = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                           run_check=False, shape=param.shape, stride=param.stride())
            state[index][key] = value
    optim.load_state_dict({"state": state, "param_groups": shard["param_groups"]})


def save(out: str, step: int, models: dict, tokenizer, optimizers: dict, trainer_state: dict, keep_last: int) -> str:
    """OUT/checkpoint-STEP (the layout above). Every rank writes into a temporary folder; rank 0 alone writes the model
    folders, and a failure there reaches every rank before the next model is gathered, so none goes on into a
    collective the others have left. A failed write (a full disk, a read-only folder), whatever the writer raises,
    removes the temporary folder, keeps the previous checkpoints and stops every rank with one line. Once all have
    written, every file and folder of it is flushed to the disk, it is renamed into place and --out flushed: only
    then does it count, and only then does --keep-last prune the older ones and strip the previous one's training
    state (prune)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    final, tmp = os.path.join(out, f"checkpoint-{step}"), os.path.join(out, f".tmp-checkpoint-{step}")
    runfolder.writes_into(out)
    if dist.rank() == 0:
        clear_leftovers(out)
    dist.barrier()
    error = None
    for name, model in models.items():
        if model is None:
            continue
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.rank() == 0:
            error = failure(write_model, tmp, name, model, full, tokenizer)
        del full  # before the next model's is gathered: one whole fp32 model on the host at a time
        error = dist.broadcast(error)  # rank 0's failure, on every rank before the next gather
        if error:
            break
    if error is None:
        error = failure(write_rank_files, tmp, models, optimizers, trainer_state)
    errors = [e for e in dist.all_gather(error) if e]
    if not errors:  # every rank has written: rank 0 puts the checkpoint in place
        placed = failure(put_in_place, out, tmp, final) if dist.rank() == 0 else None
        errors = [e for e in [dist.broadcast(placed)] if e]
    if errors:
        if dist.rank() == 0:
            _delete(tmp)
        fail(f"cannot write checkpoint {final}: {errors[0]}; the previous checkpoints are intact")
    if dist.rank() == 0:
        prune(out, step, keep_last, base_dtype(trainer_state.get("args", {}).get("run", {}).get("model")))
    dist.barrier()
    return final


def failure(write, *args) -> str | None:
    """None when write(*args) succeeds, else what went wrong in a few words: an OSError's reason, the first line of
    anything else (safetensors' SafetensorError, torch's RuntimeError)."""
    try:
        write(*args)
    except Exception as caught:
        return getattr(caught, "strerror", None) or (str(caught).splitlines() or [""])[0] or type(caught).__name__
    return None


def write_model(tmp: str, name: str, model, full: dict, tokenizer):
    """Rank 0: one model's folder in the new checkpoint, from its gathered weights (the policy's with the tokenizer)."""
    folder = tmp if name == "policy" else os.path.join(tmp, name)
    runfolder.makedirs(folder)  # new (leftovers were cleared): nothing in it is a link
    model.save_pretrained(folder, state_dict=full)
    if name == "policy":
        tokenizer.save_pretrained(folder)


def write_rank_files(tmp: str, models: dict, optimizers: dict, trainer_state: dict):
    """This rank's optimizer shard and trainer state."""
    runfolder.makedirs(os.path.join(tmp, "optim"))
    with runfolder.open_file(optim_file(tmp, dist.rank()), "wb") as f:
        torch.save({name: optimizer_shard(models[name], optim) for name, optim in optimizers.items()
                    if optim is not None}, f)
    with runfolder.open_file(state_file(tmp, dist.rank()), "wb") as f:
        torch.save({**trainer_state, "rng": rng_state(), "world_size": dist.world(), "format": FORMAT}, f)


def put_in_place(out: str, tmp: str, final: str):
    """Rank 0, once every rank has written: the new checkpoint on the disk, then renamed into place."""
    runfolder.sync_tree(tmp)  # every rank's files and the folders, before the checkpoint counts
    if os.path.islink(final):
        say(f"{final} was a symbolic link: replaced by this run's checkpoint (what it pointed to is untouched)")
    if os.path.lexists(final):  # this step saved before (a resume from an earlier checkpoint): the new one wins
        remove(final)
    runfolder.replace(tmp, final)
    runfolder.sync_folder(out)  # the rename itself


def step_of(folder: str) -> int:
    return int(folder.rsplit("-", 1)[1])


def named(out: str) -> list[str]:
    """Every OUT/checkpoint-STEP entry (folders, links, leftovers without a trainer state), oldest name first."""
    found = [p for p in glob.glob(os.path.join(out, "checkpoint-*")) if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))]
    return sorted(found, key=step_of)


def is_full(folder: str) -> bool:
    """A checkpoint a run resumes from: renamed into place whole (every rank wrote it), with its trainer state."""
    return not os.path.islink(folder) and os.path.isfile(state_file(folder, 0))


def is_model_folder(folder: str) -> bool:
    """An older kept checkpoint: the policy's model folder alone (a full one reduced), or a full one."""
    return not os.path.islink(folder) and os.path.isfile(os.path.join(folder, "config.json"))


def training_parts(folder: str) -> list[str]:
    """What a full checkpoint holds beyond its policy's model folder, rank 0's trainer state first."""
    states = sorted(glob.glob(os.path.join(folder, "trainer_state-rank*.pt")))
    return [p for p in [state_file(folder, 0), *states, *(os.path.join(folder, n) for n in TRAINING_PARTS)]
            if os.path.lexists(p)]


def model_folder_bytes(folder: str) -> int:
    """The bytes a checkpoint keeps once reduced: every file of its top level but the trainer states."""
    parts = set(training_parts(folder))
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*"))
               if p not in parts and os.path.isfile(p) and not os.path.islink(p))


def complete(out: str) -> list[str]:
    """The full checkpoints of a run folder (a resume's candidates), oldest first; a symbolic link is none of the
    run's own."""
    return [p for p in named(out) if is_full(p)]


def prune(out: str, step: int, keep_last: int, dtype: torch.dtype = torch.float32):
    """--keep-last: the new checkpoint-STEP and the keep_last - 1 newest checkpoints before it stay (full or model
    folders; 0 keeps all), each older one reduced to its policy's model folder in dtype (reduce); only folders named
    older than STEP are touched (a copy named checkpoint-999999999999 is never newer than the run's own, and never
    deleted), with what an interrupted delete left. Links are never followed or removed."""
    older = [p for p in named(out) if step_of(p) < step and not os.path.islink(p)]
    if keep_last <= 0:
        kept = older
    else:
        kept = [p for p in older if is_model_folder(p)][-(keep_last - 1):] if keep_last > 1 else []
    for folder in older:
        if folder not in kept:
            remove(folder)
    for folder in kept:
        reduce(folder, dtype)


def reduce(folder: str, dtype: torch.dtype = torch.float32):
    """A full checkpoint down to its policy's model folder, crash-safely: its training parts are renamed into a new
    .trash-* folder, rank 0's trainer state first, then deleted; then its weights are cast to dtype (weightcast). A
    kill at any point leaves a folder that is no longer a resume's candidate (no trainer_state.pt) and still a whole
    model folder; what it still holds beyond that goes at the next save (prune reduces again), and the .trash-*
    folder at the next save or resume."""
    parts = training_parts(folder)
    if parts:
        trash = runfolder.fresh_folder(os.path.dirname(folder), ".trash-")
        for index, path in enumerate(parts):
            runfolder.replace(path, os.path.join(trash, f"{index}-{os.path.basename(path)}"))
        _delete(trash)
    models.cast_folder(folder, dtype)


def remove(path: str):
    """Delete a checkpoint crash-safely: first renamed to a new .trash-* folder (one atomic step), so a kill in the
    middle of the delete leaves a .trash- folder, which the next save or resume deletes (clear_leftovers), never a
    checkpoint-STEP that has lost its trainer state and that nothing would prune again. A link is just unlinked."""
    if os.path.islink(path):
        runfolder.remove(path)
        return
    trash = runfolder.fresh_folder(os.path.dirname(path), ".trash-")
    runfolder.replace(path, trash)  # onto the empty folder just made
    _delete(trash)


def _delete(path: str):
    try:
        runfolder.remove(path, missing_ok=True)
    except OSError as error:  # the run goes on; the next save or resume tries again
        say(f"cannot delete {path} ({error.strerror}); delete it by hand", stream=sys.stderr)


def clear_leftovers(out: str):
    """What a killed save or prune left (.tmp-checkpoint-*, .trash-*): no save is running while --out is locked."""
    for path in glob.glob(os.path.join(out, ".tmp-checkpoint-*")) + glob.glob(os.path.join(out, ".trash-*")):
        _delete(path)


class FlatSettings(ValueError):
    """A trainer state written before the method's settings and the run's were saved apart (FLAT_SETTINGS)."""


def read(folder: str, defaults: dict | None = None) -> tuple[dict, dict]:
    """This rank's trainer state and optimizer shard from a checkpoint, each checked against what save() writes
    and every model folder against its config (what is checked is what a resumed run uses): a resume that gets
    them runs. Raises ValueError (safeload.Refused for a file that would run code) naming the file."""
    if os.path.islink(folder):
        raise ValueError(f"{folder} is a symbolic link, not one of the run's own checkpoints")
    safeload.check_special_files(folder)
    path, rank = state_file(folder, dist.rank()), dist.rank()
    state = safeload.read_pt(path)
    if isinstance(state, dict) and state.get("format") == FLAT_SETTINGS:
        raise FlatSettings(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is from another version of remix (format "
                         f"{state.get('format', 1) if isinstance(state, dict) else '?'}, this reads {FORMAT})")
    args = flags.from_saved(state.get("args"))
    if args is None:
        raise ValueError(f"{path} is not a trainer state this remix can resume: its 'args' are not the method's and "
                         f"the run's settings ({{'method': {{...}}, 'run': {{...}}}})")
    state = {**state, "args": args}  # one dict of every field, as the settings object has them
    params, vocab = {}, None
    for name, model_folder in (("policy", folder), ("critic", os.path.join(folder, "critic")),
                               ("reference", os.path.join(folder, "reference"))):
        if os.path.isdir(model_folder):
            safeload.check_no_code(model_folder)
            params[name], size, known = safeload.model_parameters(model_folder, critic=name == "critic")
            vocab = size if name == "policy" else vocab
            safeload.check_weights(model_folder, params[name], known)
    safeload.check_state(state, path, step_of(folder), defaults, vocab)
    trained = ("policy", "critic") if state["args"]["algo"] == "ppo" else ("policy",)
    if any(name not in params for name in trained):
        raise ValueError(f"{folder} lacks the model folder of its {' or '.join(trained)}")
    if state["world_size"] != dist.world():
        return state, {}
    path = optim_file(folder, rank)
    shard = safeload.read_pt(path)
    shapes = {name: [safeload.local_shape(shape, rank, dist.world()) for shape in params[name].values()]
              for name in trained}
    safeload.check_optimizer(shard, path, shapes)
    return state, shard


def latest(out: str, defaults: dict | None = None) -> tuple[str, dict, dict]:
    """For --resume: the newest checkpoint every rank can read, with this rank's trainer state and optimizer shard.
    A damaged, tampered, misnamed or linked newest checkpoint is named in one line and the previous full one is
    used, saying so (a file the safe loader refuses stops the resume instead: it may be tampered with); where there
    is none (the older ones are model folders), one line says what can be done, and nothing is deleted. defaults:
    the arguments' defaults (check_state). What a killed save or prune left is deleted."""
    if not os.path.isdir(out):
        fail(f"--resume {out!r}: no such run folder")
    if dist.rank() == 0:
        clear_leftovers(out)  # the folder is locked: no save of another job is under way
    found = [p for p in named(out) if os.path.islink(p) or os.path.lexists(state_file(p, 0))]  # read() checks them
    if not found:
        fail(f"--resume {out!r}: the folder holds no complete checkpoint-STEP/ with a trainer_state.pt")
    saved_ranks = max(sum(os.path.lexists(state_file(f, r)) for r in range(dist.world())) for f in found)
    if saved_ranks < dist.world():  # rank R >= that has no state of its own in any checkpoint of the run
        fail(f"--resume {out!r}: the run was trained by {saved_ranks} processes, this is {dist.world()}; resume "
             f"it with torchrun --nproc-per-node {saved_ranks} (or python for 1)")
    for folder in reversed(found):
        try:
            state, optim, problem = *read(folder, defaults), None
        except FlatSettings:  # every checkpoint of the run is as old: none to fall back to
            fail(flat_settings_line(out, folder))
        except safeload.Refused as error:
            state, optim, problem = None, None, ("refused", str(error))
        except ValueError as error:
            state, optim, problem = None, None, ("damaged", str(error))
        problems = [p for p in dist.all_gather(problem) if p]
        refused = [text for kind, text in problems if kind == "refused"]
        earlier = [f for f in found if step_of(f) < step_of(folder)]
        if problems and not earlier and folder == found[-1]:  # the run's only training state: never deleted
            fail(only_state_line(out, folder, (refused or [problems[0][1]])[0]))
        if refused and earlier:
            fail(f"--resume {out!r}: {refused[0]}. If this folder is yours, remove {folder} to resume from the "
                 f"checkpoint before it")
        if not problems:
            if state["world_size"] != dist.world():
                fail(f"--resume {out!r}: the run was trained by {state['world_size']} processes, this is "
                     f"{dist.world()}; resume it with torchrun --nproc-per-node {state['world_size']} (or python "
                     f"for 1)")
            return folder, state, optim
        say(f"--resume: {(refused or [problems[0][1]])[0]}; " + (f"resuming from {earlier[-1]} instead" if earlier
                                                                  else "no earlier checkpoint to fall back to"))
    fail(f"--resume {out!r}: no checkpoint can be read (see above); start a new run with another --out")


def flat_settings_line(out: str, folder: str) -> str:
    """The line that refuses a run written before the method's settings and the run's parted: what can be done."""
    return (f"--resume {out!r}: the run was written by a remix from before the method's settings and the run's "
            f"were saved apart (trainer state format {FLAT_SETTINGS}, this remix reads {FORMAT}): finish it with the "
            f"remix that wrote it, or continue from its policy as a new run (--model {folder} and another --out), "
            f"which starts without its optimizer state, replay deque and place in the data")


def only_state_line(out: str, folder: str, problem: str) -> str:
    """The line for the newest checkpoint when it cannot be resumed and no earlier one holds a training state (the
    older ones were reduced to model folders): nothing is deleted, since it may hold the run's only optimizer state;
    the line says what can be done, and what a new run from an older model folder starts without."""
    models = [p for p in named(out) if step_of(p) < step_of(folder) and is_model_folder(p)]
    held = ("the optimizers' moments, " + ("the critic, " if os.path.isdir(os.path.join(folder, "critic")) else "")
            + "the replay deque, the RNG states, the step and the place in the data")
    restore = ("put the run's own checkpoint back" if os.path.islink(folder) else "restore the file from a copy")
    instead = (f"or continue from the policy saved at step {step_of(models[-1])} as a new run (--model {models[-1]} "
               f"and another --out), which starts without them and with that policy as its KL reference" if models
               else "or start a new run with another --out")
    return (f"--resume {out!r}: {problem}; no earlier checkpoint holds a training state ({held}), so {folder} is left "
            f"as it is: {restore} and resume again, {instead}")


def typed_flags(argv: list[str] | None = None) -> set[str]:
    """The fields whose flags the command line names (--name, --name=VALUE, --no-name for a switch)."""
    names = set()
    for arg in sys.argv[1:] if argv is None else argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            names |= {name, name.removeprefix("no_")}
    return names


def resume_args(args, saved: dict, done: int):
    """The run's saved arguments; only --steps may change (to extend a run), and --model, --dataset and
    --eval-data-dir may give the new place of what the run read (machinery.paths checks it is the same). Other
    flags given are named, those typed at their default value too."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(args)}
    saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in fields}
    defaults, given, typed = type(args)(), dataclasses.asdict(args), typed_flags()
    changed = [k for k, v in given.items() if (k in typed or v != getattr(defaults, k))
               and k not in ("resume", "steps", "resume_other_method", "resume_changed_data") and v != saved.get(k)]
    moved = {k: given[k] for k in changed if k in paths.MOVABLE}  # what the run read, whose place may have moved
    changed = [k for k in changed if k not in moved]
    steps_given = args.steps != defaults.steps or "steps" in typed
    steps = args.steps if steps_given else saved["steps"]  # --steps 350 typed out extends a run too
    if steps < done:
        fail(f"--resume {args.resume}: the run has finished {done} steps, more than --steps {steps}")
    if changed:
        say("--resume continues with the run's saved arguments; ignored: "
            + ", ".join(f"--{k.replace('_', '-')}" for k in changed))
    return type(args)(**{**saved, **moved, "resume": args.resume, "out": args.resume, "steps": steps})


def check_writer(args, state: dict, mine: dict):
    """--resume by the method that wrote the run, and with every argument it saved known: a run written by another
    method file (or another version of this one) is refused in one line naming both, unless --resume-other-method;
    a saved argument this method's Args lacks (a fork's own flag) is refused in one line, never dropped. A run from
    before runs recorded their method is said so, and resumed. mine: runner.Method.record() of the resuming method."""
    import dataclasses

    theirs, fields = state.get("method"), {f.name for f in dataclasses.fields(args)}
    if theirs is None:
        say(f"--resume {args.resume}: the run does not record which method wrote it (it predates the record); "
            f"resuming it with {mine['file']}")
    elif not (isinstance(theirs, dict) and isinstance(theirs.get("file"), str)):
        fail(f"--resume {args.resume}: the run's record of the method that wrote it is damaged ({theirs!r:.80})")
    elif (theirs["file"], theirs.get("sha256")) != (mine["file"], mine["sha256"]) \
            and not getattr(args, "resume_other_method", False):
        def named(record):
            return f"{record['file']} (sha256 {str(record.get('sha256'))[:12]})"

        how = (f"this {named(mine)} is another version of it" if theirs["file"] == mine["file"] else
               f"not by {named(mine)}: resume it with {theirs['file']}")
        fail(f"--resume {args.resume}: the run was written by {named(theirs)}, {how}; or pass --resume-other-method "
             f"to continue it with {mine['file']}")
    unknown = [f"--{key.replace('_', '-')} = {value!r}" for key, value in state["args"].items() if key not in fields]
    if unknown:
        fail(f"--resume {args.resume}: the run's saved argument {', '.join(unknown)} is no flag of {mine['file']}: "
             f"resume the run with the method file that wrote it ({(theirs or {}).get('file', 'a fork')})")
