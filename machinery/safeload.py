"""Files from a folder a user points at (a model, a checkpoint, a run), read without running anything they hold:
.pt files by torch's weights-only loader, safetensors by their header, a config.json by building its model on the
meta device; an entry that is not a regular file (a FIFO would block a read for good) is named first. A reader of
the method may skip this module."""

import glob
import os
import re

import torch


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
    """What a library made of a signal it caught is the signal (signals.from_signal), never a bad file."""
    from machinery import signals

    if signals.from_signal(error):
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
