"""Checkpoints: written atomically with a manifest of digests, rotated, and read back for a resume.

Every rank writes into .tmp-checkpoint-STEP; rank 0 adds manifest.json (each file's size and SHA-256), syncs, renames it
into place. A resume takes the newest whose files are exactly its manifest's; older ones are reduced (docs/running.md).
"""

import contextlib
import dataclasses
import glob
import json
import os
import random
import re
import sys
import typing

import numpy as np
import torch

from machinery import console, data, dist, models, runfolder
from machinery.console import fail, say

FORMAT = 4  # 3: no manifest, per-field checks; 2: the settings as one dict; 1: torch.distributed.checkpoint's
MANIFEST = "manifest.json"

def state_file(folder: str, r: int) -> str:
    return os.path.join(folder, "trainer_state.pt" if r == 0 else f"trainer_state-rank{r}.pt")

def optim_file(folder: str, r: int) -> str:
    return os.path.join(folder, "optim", f"rank-{r}.pt")

def saved_settings(args) -> dict:
    """The settings as a checkpoint saves them, the method's and the run's apart: {"method": {...}, "run": {...}}."""
    run, values = {f.name for f in dataclasses.fields(console.RunArgs)}, console.fields_of(args)
    return {"method": {k: v for k, v in values.items() if k not in run},
            "run": {k: v for k, v in values.items() if k in run}}

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

def optimizer_shard(optim) -> dict:
    """This rank's part of an optimizer's state: each DTensor (FSDP2) as its local shard."""
    state = optim.state_dict()
    return {"state": {index: {key: (value.to_local() if hasattr(value, "to_local") else value).detach().cpu()
                              if torch.is_tensor(value) else value for key, value in entry.items()}
                      for index, entry in state["state"].items()}, "param_groups": state["param_groups"]}

def load_optimizer_shard(optim, shard: dict):
    """The inverse of optimizer_shard: each local shard back into a DTensor placed like its parameter."""
    from torch.distributed.tensor import DTensor
    params, state = [p for group in optim.param_groups for p in group["params"]], {}
    for index, entry in shard["state"].items():
        param = params[index]
        state[index] = {key: DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape, stride=param.stride())
                        if torch.is_tensor(value) and hasattr(param, "device_mesh") and key != "step" else value
                        for key, value in entry.items()}
    optim.load_state_dict({"state": state, "param_groups": shard["param_groups"]})

def save(out: str, step: int, nets: dict, tokenizer, optimizers: dict, trainer_state: dict, keep_last: int):
    """OUT/checkpoint-STEP, then --keep-last's pruning; a failed write keeps the older ones and stops every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    final, tmp = os.path.join(out, f"checkpoint-{step}"), os.path.join(out, f".tmp-checkpoint-{step}")
    runfolder.writes_into(out)
    stuck = failure(runfolder.remove, tmp) if dist.rank() == 0 and os.path.lexists(tmp) else None  # an earlier save's
    if dist.rank() == 0 and not stuck:
        clear_leftovers(out)
    if stuck := dist.broadcast(stuck):  # never written into: write_model makes the folder new and empty
        fail(f"cannot write checkpoint {final}: {tmp}, left by an earlier save, cannot be deleted ({stuck}); delete "
             f"it by hand (the previous checkpoints are intact)")
    error = None
    for name, model in [(name, model) for name, model in nets.items() if model is not None]:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.rank() == 0:
            error = failure(write_model, tmp, name, model, full, tokenizer)
        del full  # before the next model's is gathered: one whole fp32 model on the host at a time
        if error := dist.broadcast(error):
            break
    error = error or failure(write_rank_files, tmp, optimizers, trainer_state)
    error = next((e for e in dist.all_gather(error) if e), None)
    if not error:  # every rank has written: rank 0 puts the checkpoint in place
        error = dist.broadcast(failure(put_in_place, out, tmp, final, step) if dist.rank() == 0 else None)
    if error:
        if dist.rank() == 0:
            _delete(tmp)
        fail(f"cannot write checkpoint {final}: {error}; the previous checkpoints are intact")
    if dist.rank() == 0:
        prune(out, step, keep_last, base_dtype(trainer_state.get("args", {}).get("run", {}).get("model")))
    dist.barrier()

def failure(write, *args) -> str | None:
    """None when write(*args) succeeds, else what went wrong in a few words (an OSError's reason, a first line)."""
    try:
        write(*args)
    except Exception as caught:
        return getattr(caught, "strerror", None) or (str(caught).splitlines() or [""])[0] or type(caught).__name__
    return None

def write_model(tmp: str, name: str, model, full: dict, tokenizer):
    folder = tmp if name == "policy" else os.path.join(tmp, name)
    runfolder.new_folder(folder)  # anything left there fails it: nothing in the folder is a link
    model.save_pretrained(folder, state_dict=full)
    if name == "policy":
        tokenizer.save_pretrained(folder)

# trainer_state.pt as a save writes it, each field's type (a dict: its fields'): write_rank_files holds it to this
STATE = {"args": {"method": dict[str, typing.Any], "run": dict[str, typing.Any]},
         "method": {"file": str, "sha256": str | None}, "inputs": dict[str, typing.Any],
         "replay": list[list[list[dict[str, typing.Any]]]],  # batches of groups of samples
         "progress": dict.fromkeys(("step", "rollouts", "tokens", "data_position", "bad_updates"), int),
         "rng": dict[str, typing.Any], "world_size": int, "format": int,
         "in_flight": dict[str, typing.Any] | None}  # --overlap: the next step's batch, drawn (overlap.Sampler.state)
IN_FLIGHT = {"step": int, "version": int, "prompts": list[tuple[typing.Any, ...]],
             "drawn": list[list[tuple[typing.Any, ...]]]}

def write_rank_files(tmp: str, optimizers: dict, trainer_state: dict):
    state = {**trainer_state, "rng": rng_state(), "world_size": dist.world(), "format": FORMAT}
    if problem := console.unlike(state, STATE, "state"):
        raise ValueError(f"the trainer state to save is not what checkpoints.STATE says ({problem})")
    runfolder.makedirs(os.path.join(tmp, "optim"))
    with runfolder.open_file(optim_file(tmp, dist.rank()), "wb") as f:
        torch.save({name: optimizer_shard(optim) for name, optim in optimizers.items() if optim is not None}, f)
    with runfolder.open_file(state_file(tmp, dist.rank()), "wb") as f:
        torch.save(state, f)

def put_in_place(out: str, tmp: str, final: str, step: int):
    """Rank 0, once every rank has written: the manifest, everything on the disk, then the rename."""
    files = {path: {"size": os.path.getsize(os.path.join(tmp, path)),
                    "sha256": data.file_digest(os.path.join(tmp, path))} for path in listed(tmp)}
    runfolder.replace_file(os.path.join(tmp, MANIFEST), [json.dumps({"format": FORMAT, "step": step, "files": files},
                                                                    indent=1)])
    runfolder.sync_tree(tmp)
    if os.path.islink(final):
        say(f"{final} was a symbolic link: replaced by this run's checkpoint (what it pointed to is untouched)")
    if os.path.lexists(final):  # this step saved before (a resume from an earlier checkpoint): the new one wins
        remove(final)
    runfolder.replace(tmp, final)
    runfolder.sync_folder(out)

def listed(folder: str) -> list[str]:
    """Every entry under folder but the manifest and folders that hold any, relative to it, sorted."""
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, dirs, files in os.walk(folder)
                  for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))
                                       or not os.listdir(os.path.join(root, d))]
                  if os.path.join(root, name) != os.path.join(folder, MANIFEST))

def step_of(folder: str) -> int:
    return int(folder.rsplit("-", 1)[1])

def named(out: str) -> list[str]:
    """Every OUT/checkpoint-STEP entry (folders, links, leftovers), oldest name first."""
    return sorted((p for p in glob.glob(os.path.join(out, "checkpoint-*"))
                   if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))), key=step_of)

def is_full(folder: str) -> bool:
    """A checkpoint a run resumes from: renamed into place whole, with its manifest and trainer state."""
    return not os.path.islink(folder) and all(os.path.isfile(p) for p in (os.path.join(folder, MANIFEST),
                                                                           state_file(folder, 0)))

def is_model_folder(folder: str) -> bool:
    return not os.path.islink(folder) and os.path.isfile(os.path.join(folder, "config.json"))

def complete(out: str) -> list[str]:
    """The full checkpoints of a run folder, oldest first; a symbolic link is none of the run's own."""
    return [p for p in named(out) if is_full(p)]

def training_parts(folder: str) -> list[str]:
    """What a full checkpoint holds beyond its policy's model folder, the manifest and rank 0's trainer state first."""
    ranks = sorted(glob.glob(os.path.join(folder, "trainer_state-rank*.pt")))
    return [p for p in [os.path.join(folder, MANIFEST), state_file(folder, 0), *ranks,
                        *(os.path.join(folder, n) for n in ("critic", "reference", "optim"))] if os.path.lexists(p)]

def prune(out: str, step: int, keep_last: int, dtype: torch.dtype = torch.float32):
    """--keep-last (0: all): the keep_last - 1 newest before STEP reduced to dtype, older deleted; links left alone."""
    older = [p for p in named(out) if step_of(p) < step and not os.path.islink(p)]
    kept = older if keep_last <= 0 else [p for p in older if is_model_folder(p)][-(keep_last - 1):] \
        if keep_last > 1 else []
    for folder in [p for p in older if p not in kept]:
        remove(folder)
    for folder in kept:
        reduce(folder, dtype)

def reduce(folder: str, dtype: torch.dtype = torch.float32):
    """A checkpoint cut to its model folder in dtype, its training parts (manifest first) moved to .trash-*, deleted."""
    if parts := training_parts(folder):
        trash = runfolder.fresh_folder(os.path.dirname(folder), ".trash-")
        for index, path in enumerate(parts):
            runfolder.replace(path, os.path.join(trash, f"{index}-{os.path.basename(path)}"))
        _delete(trash)
    cast_folder(folder, dtype)

def remove(path: str):
    """Delete a checkpoint (renamed to a .trash-* folder first: a kill never leaves half of one) or unlink a link."""
    if os.path.islink(path):
        return runfolder.remove(path)
    trash = runfolder.fresh_folder(os.path.dirname(path), ".trash-")
    runfolder.replace(path, trash)
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

def base_dtype(source: str | None) -> torch.dtype:
    """The dtype older checkpoints keep: the base model's as its config states it (bf16 or fp16), else fp32."""
    from transformers import AutoConfig
    try:
        return models.weights_dtype(AutoConfig.from_pretrained(source, trust_remote_code=False)) if source \
            else torch.float32
    except (OSError, ValueError, KeyError, TypeError) as error:
        say(f"cannot read the base model's config ({source}: {(str(error).splitlines() or [''])[0][:160]}); older "
            f"checkpoints keep their fp32 weights")
        return torch.float32

def cast_folder(folder: str, dtype: torch.dtype):
    """A folder's fp32 safetensors, then config.json, cast to dtype, each renamed over: safe to rerun after a kill."""
    from safetensors import safe_open
    if dtype not in models.SAFETENSORS_DTYPES:
        return
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in files:
        with safe_open(path, "pt") as weights:
            if {weights.get_slice(k).get_dtype() for k in weights.keys()} != {"F32"}:
                continue  # cast already, or not the fp32 weights a save writes
            trash = runfolder.fresh_folder(os.path.dirname(folder), ".trash-")
            cast = os.path.join(trash, os.path.basename(path))  # in a new folder: no link
            with runfolder.open_file(cast, "xb") as f:
                models.write_cast(weights, f, dtype)
        runfolder.sync_tree(trash)
        runfolder.replace(cast, path)
        runfolder.sync_folder(folder)
        _delete(trash)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    keys, name = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"], str(dtype).split(".")[-1]
    if files and any(config.get(key) != name for key in keys):
        runfolder.replace_file(os.path.join(folder, "config.json"), [json.dumps(
            {**config, **{key: name for key in keys}}, indent=2, sort_keys=True) + "\n"])

class Refused(ValueError):
    """A file holds what the weights-only loader refuses: it was not written by remix, or it was changed."""

def read_pt(path: str):
    """A .pt file by torch's weights-only loader: tensors and plain values, anything else refused, never run."""
    import pickle
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except Exception as error:  # a global off the allowlist (never run), a truncated zip, a damaged record
        why = next((line for line in str(error).splitlines() if "GLOBAL" in line), None)
        if isinstance(error, pickle.UnpicklingError) and why:
            raise Refused(f"{path} holds objects the safe loader refuses ({why.strip()[:160]}); nothing of it was run")
        raise ValueError(f"{path} cannot be read safely ({console.reason(error)})") from None

def verify(folder: str) -> str | None:
    """How a checkpoint differs from its manifest (a file missing, added, changed or not regular; its step), or None."""
    path = os.path.join(folder, MANIFEST)
    if os.path.islink(folder):
        return f"{folder} is a symbolic link, not one of the run's own checkpoints"
    try:
        manifest = json.loads(open(path, encoding="utf-8").read()) if os.path.isfile(path) else None
        files = manifest["files"] if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and all(
            isinstance(entry, dict) for entry in manifest["files"].values()) else None
    except (OSError, ValueError, RecursionError):
        files = None
    if files is None:
        return f"{path} is missing or damaged"
    if manifest.get("step") != step_of(folder):
        return f"{folder} holds step {manifest.get('step')} (a copy or a rename); the step is what its manifest says"
    present = listed(folder)  # a name of the manifest's that is none of these ('../x', '/x') is never opened
    for name in sorted(files) + sorted(set(present) - set(files)):  # a deleted file named, not its emptied folder
        full, entry = os.path.join(folder, name), files.get(name)
        if entry is None:
            return f"{full} is not one of the files the checkpoint was saved with"
        if name not in present or not os.path.isfile(full) or os.path.islink(full):
            return f"{full} is missing or not a regular file" if name not in present or os.path.isfile(full) \
                else f"{full} is not a regular file (a FIFO, socket, device or link that cannot be read safely)"
        if os.path.getsize(full) != entry.get("size") or data.file_digest(full) != entry.get("sha256"):
            return f"{full} differs from what was saved (its size or SHA-256 against {MANIFEST}): damaged or edited"
    return None

def read(folder: str, settings: type | None = None) -> tuple[dict, dict]:
    """This rank's trainer state and optimizer shard of a checkpoint matching its manifest, or ValueError (Refused)."""
    if problem := dist.broadcast(verify(folder) if dist.rank() == 0 else None):
        for path in (state_file(folder, dist.rank()), optim_file(folder, dist.rank())):
            try:  # an object planted there stops the resume (Refused), edited digest or not
                read_pt(path) if path in problem and os.path.isfile(path) and not os.path.islink(path) else None
            except Refused:
                raise
            except ValueError:  # garbled: the digest's line says it
                pass
        raise ValueError(problem)
    state = check_state(read_pt(state_file(folder, dist.rank())), state_file(folder, dist.rank()), step_of(folder),
                        settings)
    return state, read_pt(optim_file(folder, dist.rank())) if state["world_size"] == dist.world() else {}

def check_state(state, path: str, step: int, settings: type | None = None) -> dict:
    """A trainer state as a save writes it, its settings as one dict; else Refused naming the first thing that is not:
    STATE's fields and types, each setting of its settings class's field type (a fork's own flag is check_writer's),
    RNG states that restore, replayed samples that share fields and types, the step of its folder and its manifest, a
    batch in flight's fields and step (the next one)."""
    if isinstance(state, dict):  # saved before --overlap was: nothing in flight
        state.setdefault("in_flight", None)
    problems = [console.unlike(state, STATE, "state")]
    if not problems[0]:
        saved, hints = {**state["args"]["method"], **state["args"]["run"]}, typing.get_type_hints(settings or object)
        samples = [sample for batch in state["replay"] for group in batch for sample in group]
        kinds = {k: {type(s.get(k)) for s in samples} - {type(None)} for k in samples[0]} if samples else {}
        odd = [k for s in samples for k in s.keys() ^ samples[0].keys()] + [k for k, t in kinds.items() if len(t) > 1]
        rng = failure(set_rng_state, state["rng"])  # start() sets them again, after every rank reseeds
        problems += [console.unlike({k: v for k, v in saved.items() if k in hints}, hints, "state.args"),
                     odd and f"state.replay's samples differ in their field {odd[0]!r} (one lacks it, or types differ)",
                     rng and f"state.rng cannot be restored ({rng})",
                     state["progress"]["step"] != step and f"state.progress.step is {state['progress']['step']}, its "
                                                           f"folder's and manifest's step {step}"]
        if (ahead := state["in_flight"]) is not None:  # --overlap's batch drawn for the next step
            problems.append(console.unlike(ahead, IN_FLIGHT, "state.in_flight") or ahead["step"] != step + 1 and
                            f"state.in_flight.step is {ahead['step']}, not the step after its folder's, {step + 1}")
    if problem := next(filter(None, problems), None):
        raise Refused(f"{path} is not a trainer state as this remix saves it: {problem}")
    return {**state, "args": saved}

def latest(out: str, settings: type | None = None) -> tuple[str, dict, dict]:
    """--resume's newest checkpoint all ranks read (settings: the run's settings class, whose field types its saved
    settings must have), this rank's state and shard; a bad newer one named, not deleted."""
    if not os.path.isdir(out):
        fail(f"--resume {out!r}: no such run folder")
    found = [p for p in named(out) if os.path.islink(p) or any(os.path.lexists(os.path.join(p, name)) for name in (
        "trainer_state.pt", MANIFEST))]  # a full one, or one that lost its state: verify names what it lacks
    if not found:
        fail(f"--resume {out!r}: the folder holds no complete checkpoint-STEP/ with a trainer_state.pt")
    if dist.rank() == 0:
        clear_leftovers(out)  # a run's folder, locked: no save of another job is under way
    version = FORMAT  # a checkpoint without a manifest: another remix wrote it, its trainer state says which
    if not os.path.lexists(os.path.join(found[-1], MANIFEST)) and os.path.isfile(state_file(found[-1], 0)):
        with contextlib.suppress(ValueError):
            old = read_pt(state_file(found[-1], 0))
            version = old.get("format", 1) if isinstance(old, dict) else FORMAT
    if version != FORMAT:
        fail(f"--resume {out!r}: the run was written by another version of remix (trainer state format {version}, "
             f"this remix reads {FORMAT}): finish it with the remix that wrote it, or continue from its policy as a "
             f"new run (--model {found[-1]} and another --out), which starts without its optimizer state, replay "
             f"deque and place in the data")
    def check_world(ranks: int):
        if ranks != dist.world():
            fail(f"--resume {out!r}: the run was trained by {ranks} processes, this is {dist.world()}; resume it with "
                 f"torchrun --nproc-per-node {ranks} (or python for 1)")
    # fewer ranks' trainer states than processes:
    check_world(max(sum(os.path.lexists(state_file(f, r)) for r in range(dist.world())) for f in found))
    for folder in reversed(found):
        try:
            state, optim, problem = *read(folder, settings), None
        except ValueError as error:
            state, optim, problem = None, None, (isinstance(error, Refused), str(error))
        gathered = sorted((p for p in dist.all_gather(problem) if p), reverse=True)  # a refusal first
        problems = [text for _, text in gathered]
        earlier = [f for f in found if step_of(f) < step_of(folder)]
        if problems and not earlier and folder == found[-1]:  # the run's only training state: never deleted
            fail(only_state_line(out, folder, problems[0]))
        if gathered and gathered[0][0]:  # a planted object: the folder may be tampered with
            fail(f"--resume {out!r}: {problems[0]}. If this folder is yours, remove {folder} to resume from the "
                 f"checkpoint before it")
        if not problems:
            check_world(state["world_size"])
            return folder, state, optim
        say(f"--resume: {problems[0]}; " + (f"resuming from {earlier[-1]} instead" if earlier else
                                            "no earlier checkpoint to fall back to"))
    fail(f"--resume {out!r}: no checkpoint can be read (see above); start a new run with another --out")

def only_state_line(out: str, folder: str, problem: str) -> str:
    """The line for an unreadable newest checkpoint with no earlier training state: what can be done instead."""
    kept = [p for p in named(out) if step_of(p) < step_of(folder) and is_model_folder(p)]
    held = ("the optimizers' moments, " + ("the critic, " if os.path.isdir(os.path.join(folder, "critic")) else "")
            + "the replay deque, the RNG states, the step and the place in the data")
    restore = "put the run's own checkpoint back" if os.path.islink(folder) else "restore the file from a copy"
    instead = (f"or continue from the policy saved at step {step_of(kept[-1])} as a new run (--model {kept[-1]} and "
               f"another --out), which starts without them and with that policy as its KL reference" if kept
               else "or start a new run with another --out")
    return (f"--resume {out!r}: {problem}; no earlier checkpoint holds a training state ({held}), so {folder} is left "
            f"as it is: {restore} and resume again, {instead}")

def resume_args(args, saved: dict, done: int):
    """The run's saved settings; only --steps may change (to extend it), and --model, --dataset and --eval-data-dir
    may give a new place of what the run read. Other flags given, even at their default value, are named as ignored."""
    names = [a[2:].split("=", 1)[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")]  # --x=V, --no-x
    typed = {*names, *(name.removeprefix("no_") for name in names)}
    defaults, given = type(args)(), console.fields_of(args)
    saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in given}
    changed = [k for k, v in given.items() if (k in typed or v != getattr(defaults, k))
               and k not in ("resume", "steps", "resume_other_method", "resume_changed_data") and v != saved.get(k)]
    moved = {k: given[k] for k in changed if k in data.MOVABLE}
    changed = [k for k in changed if k not in moved]
    steps = args.steps if args.steps != defaults.steps or "steps" in typed else saved["steps"]
    if steps < done:
        fail(f"--resume {args.resume}: the run has finished {done} steps, more than --steps {steps}")
    if changed:
        say("--resume continues with the run's saved arguments; ignored: "
            + ", ".join(f"--{k.replace('_', '-')}" for k in changed))
    return type(args)(**{**saved, **moved, "resume": args.resume, "out": args.resume, "steps": steps})

def check_writer(args, state: dict, mine: dict):
    """--resume by the method that wrote the run (mine: runner.Method.record()), or one line naming both unless
    --resume-other-method; a saved setting this method's Args lacks (a fork's own flag) is refused, never dropped."""
    theirs, fields = state.get("method"), {f.name for f in dataclasses.fields(args)}
    if (theirs["file"], theirs.get("sha256")) != (mine["file"], mine["sha256"]) and not args.resume_other_method:
        by_mine, by_theirs = (f"{r['file']} (sha256 {str(r.get('sha256'))[:12]})" for r in (mine, theirs))
        how = (f"this {by_mine} is another version of it" if theirs["file"] == mine["file"] else
               f"not by {by_mine}: resume it with {theirs['file']}")
        fail(f"--resume {args.resume}: the run was written by {by_theirs}, {how}; or pass --resume-other-method "
             f"to continue it with {mine['file']}")
    unknown = [f"--{key.replace('_', '-')} = {value!r}" for key, value in state["args"].items() if key not in fields]
    if unknown:
        fail(f"--resume {args.resume}: the run's saved argument {', '.join(unknown)} is no flag of {mine['file']}: "
             f"resume the run with the method file that wrote it ({theirs['file']})")
