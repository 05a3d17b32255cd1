"""Checkpoints: written atomically by every rank, rotated, holding everything a resumed run needs, and read back
without executing anything from the folder. A reader of the method may skip this module.

    checkpoint-STEP/             the policy and tokenizer: a plain transformers / vLLM model folder (safetensors)
        critic/, reference/      the critic (PPO) and, once reincarnated, the reference, likewise
        optim/rank-R.pt          each rank's shard of both optimizers' state: tensors and numbers only
        trainer_state.pt         rank 0's progress, arguments, replay deque and RNG states; -rankR.pt for rank R

Every .pt file holds only tensors, numbers, strings, lists, tuples and dicts, and is read with torch's
weights-only loader, which refuses anything else (a pickled object that could run code); model weights are
safetensors. A damaged or tampered file is named in one line, and --resume falls back to the previous checkpoint.
"""

import glob
import os
import random
import re
import shutil
import sys

import numpy as np
import torch

from machinery import dist, run

FORMAT = 2  # 1: optimizers in torch.distributed.checkpoint's format, trainer state pickled (no longer read)


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
    """OUT/checkpoint-STEP (the layout above). Every rank writes into a temporary folder, renamed only once all have
    written; a failed write (a full disk, a read-only folder), whatever the writer raises, removes it, keeps the
    previous checkpoints and stops the run with one line."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    final, tmp = os.path.join(out, f"checkpoint-{step}"), os.path.join(out, f".tmp-checkpoint-{step}")
    if dist.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    error = None
    try:
        for name, model in models.items():
            if model is None:
                continue
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if dist.rank() == 0:
                folder = tmp if name == "policy" else os.path.join(tmp, name)
                model.save_pretrained(folder, state_dict=full)
                if name == "policy":
                    tokenizer.save_pretrained(folder)
        os.makedirs(os.path.join(tmp, "optim"), exist_ok=True)
        torch.save({name: optimizer_shard(models[name], optim) for name, optim in optimizers.items()
                    if optim is not None}, optim_file(tmp, dist.rank()))
        torch.save({**trainer_state, "rng": rng_state(), "world_size": dist.world(), "format": FORMAT},
                   state_file(tmp, dist.rank()))
    except Exception as caught:  # OSError, safetensors' SafetensorError, torch's RuntimeError: the same line
        error = f"{getattr(caught, 'strerror', None) or str(caught).splitlines()[0] or type(caught).__name__}"
    errors = [e for e in dist.all_gather(error) if e]
    if errors:
        if dist.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        run.fail(f"cannot write checkpoint {final}: {errors[0]}; the previous checkpoints are intact")
    dist.barrier()
    if dist.rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_last > 0:
            for old in complete(out)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def complete(out: str) -> list[str]:
    """The complete checkpoints of a run folder (renamed into place, so every rank wrote them), oldest first."""
    found = [p for p in glob.glob(os.path.join(out, "checkpoint-*")) if re.fullmatch(r"checkpoint-\d+", os.path.basename(p))
             and os.path.isfile(state_file(p, 0))]
    return sorted(found, key=lambda p: int(p.rsplit("-", 1)[1]))


class Refused(ValueError):
    """A checkpoint file holds what a safe loader refuses: it was not written by remix, or it was changed."""


def read_pt(path: str):
    """A .pt file of this format, by torch's weights-only loader: it builds tensors and plain values and refuses
    anything else, so a file that would run code is refused, never run. Raises Refused for such a file and
    ValueError for a missing or damaged one, each naming the file."""
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except pickle.UnpicklingError as error:  # a global outside the weights-only allowlist: never run
        why = next((line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line), "")
        raise Refused(f"{path} holds objects the safe loader refuses ({why.strip()[:160] or 'not plain data'}); "
                      f"nothing of it was run") from None
    except Exception as error:  # a truncated zip or a damaged record
        raise ValueError(f"{path} cannot be read safely ({type(error).__name__}: "
                         f"{str(error).strip().splitlines()[0][:200] if str(error).strip() else 'damaged'})") from None


def check_weights(folder: str):
    """Every safetensors file of a model folder opens and its header matches the file's size (a truncated write
    does not). Raises ValueError naming the file."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder} holds no model.safetensors")
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    f.get_slice(key)
        except Exception as error:
            raise ValueError(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None


def read(folder: str) -> tuple[dict, dict]:
    """This rank's trainer state and optimizer shard from a checkpoint, every model folder checked first."""
    state = read_pt(state_file(folder, dist.rank()))
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{state_file(folder, dist.rank())} is from another version of remix (format "
                         f"{state.get('format', 1) if isinstance(state, dict) else '?'}, this reads {FORMAT})")
    for model_folder in [folder] + [os.path.join(folder, sub) for sub in ("critic", "reference")]:
        if os.path.isdir(model_folder):
            check_weights(model_folder)
    if state["world_size"] == dist.world():
        return state, read_pt(optim_file(folder, dist.rank()))
    return state, {}


def latest(out: str) -> tuple[str, dict, dict]:
    """For --resume: the newest checkpoint every rank can read, with this rank's trainer state and optimizer shard.
    A damaged or tampered newest checkpoint is named in one line and the previous one is used, saying so."""
    if not os.path.isdir(out):
        run.fail(f"--resume {out!r}: no such run folder")
    found = complete(out)
    if not found:
        run.fail(f"--resume {out!r}: the folder holds no complete checkpoint-STEP/ with a trainer_state.pt")
    for folder in reversed(found):
        try:
            state, optim, problem = *read(folder), None
        except Refused as error:
            state, optim, problem = None, None, ("refused", str(error))
        except ValueError as error:
            state, optim, problem = None, None, ("damaged", str(error))
        problems = [p for p in dist.all_gather(problem) if p]
        refused = [text for kind, text in problems if kind == "refused"]
        if refused:
            run.fail(f"--resume {out!r}: {refused[0]}. If this folder is yours, remove {folder} to resume from the "
                     f"checkpoint before it")
        if not problems:
            if state["world_size"] != dist.world():
                run.fail(f"--resume {out!r}: the run was trained by {state['world_size']} processes, this is "
                         f"{dist.world()}; resume it with torchrun --nproc-per-node {state['world_size']} (or python "
                         f"for 1)")
            return folder, state, optim
        earlier = [f for f in found if int(f.rsplit("-", 1)[1]) < int(folder.rsplit("-", 1)[1])]
        run.say(f"--resume: {problems[0][1]}; " + (f"resuming from {earlier[-1]} instead" if earlier else
                                                    "no earlier checkpoint to fall back to"))
    run.fail(f"--resume {out!r}: no checkpoint can be read (see above); start a new run with another --out")


def resume_args(args, saved: dict, done: int):
    """The run's saved arguments; only --steps may change (to extend a run). Other flags given are named."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(args)}
    saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in fields}
    defaults, given = type(args)(), dataclasses.asdict(args)
    changed = [k for k, v in given.items() if v != getattr(defaults, k) and k not in ("resume", "steps")
               and v != saved.get(k)]
    steps_given = args.steps != defaults.steps or any(a == "--steps" or a.startswith("--steps=") for a in sys.argv[1:])
    steps = args.steps if steps_given else saved["steps"]  # --steps 350 typed out extends a run too
    if steps < done:
        run.fail(f"--resume {args.resume}: the run has finished {done} steps, more than --steps {steps}")
    if changed:
        run.say("--resume continues with the run's saved arguments; ignored: "
                + ", ".join(f"--{k.replace('_', '-')}" for k in changed))
    return type(args)(**{**saved, "resume": args.resume, "out": args.resume, "steps": steps})
