"""What a user points at (a model, a checkpoint, a run), read without running anything it holds, and checked.

Files from such a folder: .pt files by torch's weights-only loader, safetensors by their header, a config.json by
building its model on the meta device; an entry that is not a regular file (a FIFO would block a read for good) is
named first. A checkpoint's trainer state and optimizer shards are checked before a resume uses them: fields, types
and shapes against what checkpoints.save writes. The weights-only loader accepts any tensors and plain values, so a
hand-edited or foreign file could otherwise crash a later step. A reader of the method may skip this module.
"""

import glob
import os
import random
import re

import numpy as np
import torch

from machinery import dist


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


def special_files(folder: str, recursive: bool = True) -> list[str]:
    """The entries of a folder (and, recursive, of its subfolders) that are not regular files once links are
    followed: a FIFO, a socket, a device, a broken link; and, recursive, a linked folder, whose files would go
    unchecked. Opening a FIFO blocks until something writes to it, deaf to SIGINT and SIGTERM, so a program reads
    nothing from a folder that holds one. Only names and types are looked at; nothing is opened."""
    odd = []
    for root, dirs, files in os.walk(folder):
        odd += [os.path.join(root, name) for name in files if not os.path.isfile(os.path.join(root, name))]
        if not recursive:
            break
        odd += [os.path.join(root, name) for name in dirs if os.path.islink(os.path.join(root, name))]
    return odd


def check_special_files(folder: str, recursive: bool = True):
    odd = special_files(folder, recursive)
    if odd:
        raise ValueError(f"{odd[0]} is not a regular file (a FIFO, socket, device or link that cannot be read "
                         f"safely); remove it")


def check_weights(folder: str, params: dict | None = None, known: set | None = None):
    """Every safetensors file of a model folder opens and its header matches the file's size (a truncated write
    does not); with params ({name: shape}, model_parameters), the weights hold each with that shape (a config.json
    edited to another vocabulary or width does not), and with known (the other names a file of the model may hold,
    model_parameters) no weight the model does not have: a weight left out would start at random, one too many is
    a model of another kind. Without known (a model whose weights transformers renames as it loads them) only the
    names found are checked. Raises ValueError naming the file."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"{folder} holds no model.safetensors")
    shapes = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
        except Exception as error:
            raise ValueError(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
    for name, shape in (params or {}).items():
        if shapes.get(name) != shape and (name in shapes or known is not None):
            raise ValueError(f"{folder}/config.json makes {name} {list(shape)}, its weights hold "
                             f"{list(shapes[name]) if name in shapes else 'none'}: the config and weights disagree"
                             + ("" if name in shapes else " (a weight left out would start at random)"))
    extra = sorted(set(shapes) - set(params or {}) - (known or set())) if known is not None else []
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ValueError(f"{folder}'s weights hold {extra[0]}{more}, "
                         f"which the model its config.json describes does not have: the config and weights disagree")


PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")  # weights only torch's unpickler reads: never loaded


def check_model_folder(folder: str) -> tuple[dict, int]:
    """A local model a program is about to load, checked before anything is written: nothing in it can block a
    read, no file of it asks for its own code to run (check_no_code), its weights are safetensors (a pickle is
    never loaded), whole, and exactly the weights its config describes. Returns model_parameters' (params, vocab).
    Raises ValueError (Refused for code) naming the file."""
    check_special_files(folder, recursive=False)
    check_no_code(folder)
    pickles = sorted(os.path.basename(p) for pattern in PICKLES for p in glob.glob(os.path.join(folder, pattern)))
    if pickles and not glob.glob(os.path.join(folder, "*.safetensors")):
        raise ValueError(f"{folder} holds its weights as {pickles[0]}, a pickle (loading one can run code), and no "
                         f"*.safetensors: remix never unpickles a model; convert it to safetensors where you trust "
                         f"its source (transformers' from_pretrained, then save_pretrained, writes model.safetensors)")
    params, vocab, known = model_parameters(folder)
    check_weights(folder, params, known)
    return params, vocab


def check_no_code(folder: str):
    """No config of a model folder makes transformers or vLLM run code: an auto_map in any *config*.json (the
    model's, the tokenizer's, a processor's) names a .py file there to import, and a model_type or tokenizer_class
    transformers does not know can only be loaded by such code. Every loader is also called with
    trust_remote_code=False; this names the folder in one line before it is touched. Raises Refused."""
    import json

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    for path in sorted(glob.glob(os.path.join(folder, "*config*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
        except (OSError, ValueError) as error:
            raise ValueError(f"{path} is not valid JSON ({str(error).splitlines()[0][:160]})") from None
        code = sorted({ref.split("--")[-1].rsplit(".", 1)[0] + ".py" for ref in auto_map_refs(content)})
        if code:
            raise Refused(f"{path} has an auto_map asking to run code from the folder ({', '.join(code)}); remix never "
                          f"runs a model folder's code: use a model transformers supports without it")
        content = content if isinstance(content, dict) else {}
        model_type, tokenizer_class = content.get("model_type"), content.get("tokenizer_class")
        if os.path.basename(path) == "config.json" and model_type is not None \
                and model_type not in CONFIG_MAPPING_NAMES:
            raise Refused(f"{path} has model_type {model_type!r}, which transformers does not know (a model that needs "
                          f"its own code, which remix never runs)")
        if isinstance(tokenizer_class, str) and tokenizer_class_from_name(tokenizer_class) is None:
            raise Refused(f"{path} names tokenizer_class {tokenizer_class!r}, which transformers does not have (a "
                          f"tokenizer that needs its own code, which remix never runs)")


def auto_map_refs(content) -> list[str]:
    """Every module reference of every auto_map in a JSON value, nested configs included."""
    refs = []
    if isinstance(content, dict):
        for key, value in content.items():
            if key == "auto_map" and isinstance(value, dict):
                for ref in value.values():
                    refs += [r for r in (ref if isinstance(ref, list) else [ref]) if isinstance(r, str)]
            else:
                refs += auto_map_refs(value)
    elif isinstance(content, list):
        for value in content:
            refs += auto_map_refs(value)
    return refs


def read_tokenizer(source: str) -> tuple:
    """(tokenizer, the embedding's rows) of a model folder or hub id, by transformers without code from the folder,
    checked to fit (check_tokenizer). Whatever transformers raises on them is a ValueError naming the file
    (tokenizer_file, or config.json); an OSError where there is no model (a missing folder, a hub id out of reach)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        tokenizer("1 + 1 = 2", add_special_tokens=False)  # a value of its config that breaks encoding breaks here
    except OSError:
        raise
    except Exception as error:
        _reraise_a_signal(error)
        raise ValueError(f"{tokenizer_file(source)} cannot be read as the model's tokenizer "
                         f"({reason(error)})") from None
    try:
        rows = AutoConfig.from_pretrained(source, trust_remote_code=False).get_text_config().vocab_size
    except OSError:
        raise
    except Exception as error:
        _reraise_a_signal(error)
        raise ValueError(f"{os.path.join(source, 'config.json')} does not describe a model ({reason(error)})") from None
    check_tokenizer(tokenizer, source, rows)
    return tokenizer, rows


def tokenizer_file(source: str) -> str:
    """The file to name when transformers cannot read a folder's tokenizer: tokenizer.json where the tokenizers
    library cannot read it alone, else tokenizer_config.json (the values transformers adds to it), else the folder."""
    from tokenizers import Tokenizer

    path = os.path.join(source, "tokenizer.json")
    if os.path.isfile(path):
        try:
            Tokenizer.from_file(path)
        except Exception:
            return path
    config = os.path.join(source, "tokenizer_config.json")
    return config if os.path.isfile(config) else f"{source}'s tokenizer"


def _reraise_a_signal(error: BaseException):
    """What a library made of a signal it caught is the signal (console.from_signal), never a bad file."""
    from machinery import console

    if console.from_signal(error):
        raise error


def check_tokenizer(tokenizer, source: str, rows: int | None):
    """A tokenizer that can run the model: it turns text into tokens (a folder whose tokenizer files are gone
    loads as an empty one, and every prompt would be []), and no token id is past the embedding's last row
    (fewer tokens than rows is fine: vocabularies are padded). Raises ValueError."""
    if not tokenizer("1 + 1 = 2", add_special_tokens=False).input_ids:
        raise ValueError(f"{source} holds no usable tokenizer (it turns text into no tokens; are its tokenizer.json "
                         f"and tokenizer_config.json missing?): copy them from where the model came from")
    largest = max(tokenizer.get_vocab().values(), default=-1) + 1
    if rows is not None and max(largest, len(tokenizer)) > rows:
        raise ValueError(f"{source}'s tokenizer has {max(largest, len(tokenizer))} tokens and the model's embedding "
                         f"{rows} rows (vocab_size in config.json): the tokenizer is not this model's")


def meta_model(source: str, critic: bool = False) -> tuple:
    """(config, model) of a model folder, hub id or config.json, the model built on the meta device (no memory, no
    weight read, never code from the folder): the policy, or the critic (one label per token). Raises ValueError
    with transformers' reason when the config cannot be used."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False, **({"num_labels": 1} if critic else {}))
        with torch.device("meta"):
            model = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(
                config, trust_remote_code=False)
    except Exception as error:  # a config transformers cannot use raises anything: its validators, torch, arithmetic
        _reraise_a_signal(error)
        raise ValueError(reason(error)) from None
    return config, model


def reason(error: BaseException) -> str:
    """What transformers (or a library under it) raised, as a short clause: the innermost cause (a validation error
    wraps the one that says what is wrong), its type and its first line."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def model_parameters(folder: str, critic: bool = False) -> tuple[dict, int, set | None]:
    """The parameters of the model a folder's config.json describes, {name: shape} in the order the optimizer
    numbers them (tied weights once), its vocabulary size, and every other name a weight file of it may hold (a
    tied copy, a buffer, one transformers ignores), or None where transformers renames weights as it loads them
    (then only the names that match are checked): the model is built on the meta device, so no memory is used,
    no weight is read and no code from the folder is run."""
    try:
        config, model = meta_model(folder, critic)
    except ValueError as why:
        raise ValueError(f"{folder}/config.json does not describe a model ({why})") from None
    from transformers.conversion_mapping import get_model_conversion_mapping

    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    ignored = [re.compile(pattern) for pattern in model._keys_to_ignore_on_load_unexpected or []]
    known = None if get_model_conversion_mapping(model, add_legacy=False) else \
        {name for name in model.state_dict() if name not in params} | {
            name for name in _saved_names(folder) if any(pattern.search(name) for pattern in ignored)}
    return params, config.get_text_config().vocab_size, known


def _saved_names(folder: str) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        try:
            with safe_open(path, "pt") as f:
                names += list(f.keys())
        except Exception:  # check_weights names a damaged file
            pass
    return names


# ----------------------------------------------------------------------------------------------
# A checkpoint's trainer state and optimizer shards, checked before a resume uses them
# ----------------------------------------------------------------------------------------------
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
