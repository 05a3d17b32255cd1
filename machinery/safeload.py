"""Files from a folder a user points at (a model, a checkpoint, a run), read without running anything they hold:
.pt files by torch's weights-only loader, safetensors by their header, a config.json by building its model on the
meta device; an entry that is not a regular file (a FIFO would block a read for good) is named first. A reader of
the method may skip this module."""

import glob
import os

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


def check_weights(folder: str, params: dict | None = None):
    """Every safetensors file of a model folder opens and its header matches the file's size (a truncated write
    does not); with params ({name: shape}, model_parameters), the weights hold each with that shape (a config.json
    edited to another vocabulary does not). Raises ValueError naming the file."""
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
        if shapes.get(name) != shape:
            raise ValueError(f"{folder}/config.json makes {name} {list(shape)}, its weights hold "
                             f"{list(shapes[name]) if name in shapes else 'none'}: the config and weights disagree")


def check_model_folder(folder: str):
    """A local model a program is about to load: nothing in it can block a read, and its safetensors are whole."""
    check_special_files(folder, recursive=False)
    if glob.glob(os.path.join(folder, "*.safetensors")):  # a model of .bin files is transformers' to refuse
        check_weights(folder)


def model_parameters(folder: str, critic: bool = False) -> tuple[dict, int]:
    """The parameters of the model a folder's config.json describes, {name: shape} in the order the optimizer
    numbers them (tied weights once), and its vocabulary size: the model is built on the meta device, so no
    memory is used, no weight is read and no code from the folder is run."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    try:
        config = AutoConfig.from_pretrained(folder, **({"num_labels": 1} if critic else {}))
        with torch.device("meta"):
            model = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as error:  # what transformers raises for a config it cannot use
        why = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise ValueError(f"{folder}/config.json does not describe a model ({why})") from None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}, config.get_text_config().vocab_size
