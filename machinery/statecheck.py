"""What a checkpoint's trainer state and optimizer shards must hold before a resume uses them: fields, types and
shapes against what checkpoints.save writes. The weights-only loader accepts any tensors and plain values, so a
hand-edited or foreign file could otherwise crash a later step. A reader of the method may skip this module."""

import random

import numpy as np
import torch

from machinery import dist


def local_shape(shape: tuple, rank: int, world: int) -> tuple:
    """This rank's part of a parameter FSDP2 shards along its first dimension: chunks of ceil(rows / world) rows,
    the last ones shorter or empty."""
    rows = -(-shape[0] // world)
    return (max(0, min(rows, shape[0] - rank * rows)), *shape[1:])


# What a stored (replayable) sample holds, as remix.py's table of sample fields says, with the types a step uses.
SAMPLE_FIELDS = {"prompt_ids": list, "response_ids": list, "answer": str, "version": int, "group": int,
                 "truncated": bool, "reward": (int, float), "reward_parts": dict, "status": str, "reflects": bool}
PER_TOKEN = ("behaviour_logp", "ref_logp", "sampler_weight", "sampler_logp")  # [L] each, where present


def check_state(state: dict, path: str, step: int, defaults: dict | None = None, vocab: int | None = None):
    """A trainer state holds what save() wrote, with the types restore() and the steps use: the safe loader
    accepts any tensors and plain values, so a hand-edited or foreign file could crash a later step. The step is
    what the state says: a folder named otherwise (a copy, a rename) is refused. Raises ValueError naming the file
    and the first field that is wrong. defaults: the arguments' defaults, whose types saved arguments must have."""
    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"{path} is not a trainer state this remix can resume: {what}")

    for key, kind in (("args", dict), ("progress", dict), ("replay", list), ("rng", dict), ("world_size", int)):
        need(isinstance(state.get(key), kind), f"its {key!r} is missing or not a {kind.__name__}")
    progress, args = state["progress"], state["args"]
    counts = ("step", "rollouts", "tokens", "data_position") + (("bad_updates",) if "bad_updates" in progress else ())
    for key in counts:
        need(type(progress.get(key)) is int and progress[key] >= 0, f"progress {key!r} is missing or not a count")
    if progress["step"] != step:
        raise ValueError(f"{path} holds step {progress['step']}, but its folder is named checkpoint-{step} (a copy "
                         f"or a rename); the step a checkpoint holds is what its state says")
    need(state["world_size"] >= 1 and type(args.get("steps")) is int and args.get("algo") in ("ppo", "grpo"),
         "its world size or its --steps or --algo is missing or wrong")
    for key, default in (defaults or {}).items():
        value = args.get(key, default)
        need(default is None or type(value) is type(default) or (type(default) is float and type(value) is int)
             or (isinstance(default, tuple) and isinstance(value, list)),
             f"its --{key.replace('_', '-')} is {value!r}, not a {type(default).__name__}")
    check_rng(state["rng"], need)
    check_replay(state["replay"], args, step, vocab, need)


def check_rng(rng: dict, need):
    """The saved RNG states restore: each is set into a new generator of its kind (the process's own are untouched)."""
    try:
        random.Random().setstate(rng["python"])
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
        torch.Generator().set_state(rng["torch"])
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as error:
        need(False, f"its RNG state cannot be restored ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
    if "cuda" in rng and torch.cuda.is_available():
        need(torch.is_tensor(rng["cuda"]) and rng["cuda"].dtype == torch.uint8
             and rng["cuda"].shape == torch.cuda.get_rng_state(dist.device()).shape, "its CUDA RNG state is malformed")


def check_replay(replay: list, args: dict, step: int, vocab: int | None, need):
    """Every stored sample has the fields a replayed one is used with, each [L] vector one value per response token,
    each token id in the vocabulary, and a policy version before this step: a junk entry is named now, not by
    the step that draws it."""
    required = [key for key, on in (("behaviour_logp", True), ("ref_logp", bool(args.get("kl_beta", 0))),
                                    ("sampler_weight", args.get("sampler_is_cap") is not None)) if on]
    for b, batch in enumerate(replay):
        need(isinstance(batch, list) and all(isinstance(group, list) and group for group in batch),
             f"replay batch {b} is not a list of groups")
        for sample in (s for group in batch for s in group):
            where = f"a sample of replay batch {b}"
            need(isinstance(sample, dict), f"{where} is not a dict")
            need(all(isinstance(sample.get(key), kind) for key, kind in SAMPLE_FIELDS.items()),
                 f"{where} lacks a field or has one of another type ({', '.join(SAMPLE_FIELDS)})")
            need(all(sample[key] and all(type(t) is int and 0 <= t < (vocab or 2**62) for t in sample[key])
                     for key in ("prompt_ids", "response_ids")), f"{where} has a token id outside the vocabulary")
            need(sample["version"] <= step, f"{where} was sampled at step {sample['version']}, after this checkpoint")
            length = len(sample["response_ids"])
            need(all(sample.get(key) is not None for key in required) and all(
                torch.is_tensor(value) and value.is_floating_point() and tuple(value.shape) == (length,)
                for value in (sample.get(key) for key in PER_TOKEN) if value is not None),
                f"{where} lacks one of {', '.join(required)} or has one that is not a vector of its {length} tokens")


def check_optimizer(shard: dict, path: str, shapes: dict):
    """An optimizer shard holds, for each model trained, AdamW's state over exactly its parameters, each moment
    shaped like this rank's shard of its parameter (shapes: {model: [shape, ...]}): a wrong one is named now,
    not by the first optimizer step."""
    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"{path} is not an optimizer state this remix can resume: {what}")

    need(isinstance(shard, dict), "it is not a dict")
    for name, expected in shapes.items():
        entry = shard.get(name)
        need(isinstance(entry, dict) and isinstance(entry.get("state"), dict)
             and isinstance(entry.get("param_groups"), list), f"it holds no {name} optimizer")
        groups = entry["param_groups"]
        need(all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
             and [i for g in groups for i in g["params"]] == list(range(len(expected))),
             f"the {name} optimizer's groups do not number the model's {len(expected)} parameters")
        need(all(type(g.get(key)) in (int, float) for g in groups for key in ("lr", "eps", "weight_decay")),
             f"the {name} optimizer's lr, eps or weight decay is not a number")
        for index, moments in entry["state"].items():
            need(type(index) is int and 0 <= index < len(expected) and isinstance(moments, dict),
                 f"the {name} optimizer has state for a parameter {index!r} the model does not have")
            for key, value in moments.items():
                shape = () if key == "step" else expected[index]
                need(torch.is_tensor(value) and value.is_floating_point() and tuple(value.shape) == shape,
                     f"the {name} optimizer's {key} of parameter {index} is not a float tensor of shape {list(shape)}")
