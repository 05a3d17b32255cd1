"""Older checkpoints' weights in the base model's dtype: which dtype that is, and a safetensors file written in it one
tensor at a time (machinery.checkpoints casts an older checkpoint's fp32 weights with it when it reduces one to a
model folder; the newest keeps the fp32 master weights, so a resume is exact). A reader of the method may skip this
module."""

import contextlib
import functools
import glob
import json
import math
import os
import struct

import torch

from machinery import runfolder
from machinery.messages import say

SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16"}  # the dtypes an older checkpoint is cast to


def weights_dtype(config) -> torch.dtype:
    """The dtype an older checkpoint's weights are kept in: the base model's, as its config states it (bf16 or fp16;
    fp32 for anything else, or nothing stated). The newest checkpoint's are the fp32 master weights, for an exact
    resume."""
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if dtype in SAFETENSORS_DTYPES else torch.float32


@functools.cache
def base_dtype(source: str | None) -> torch.dtype:
    """weights_dtype of the base model (a folder or a hub id), read once; fp32 where its config cannot be read."""
    if not source:
        return torch.float32
    from transformers import AutoConfig

    try:
        return weights_dtype(AutoConfig.from_pretrained(source, trust_remote_code=False))
    except (OSError, ValueError, KeyError, TypeError) as error:
        say(f"cannot read the base model's config ({source}: {(str(error).splitlines() or [''])[0][:160]}); older "
            f"checkpoints keep their fp32 weights")
        return torch.float32


def cast_folder(folder: str, dtype: torch.dtype):
    """A model folder's fp32 weights in dtype: each safetensors file holding only fp32 tensors is written anew, cast,
    into a new .trash-* folder beside the checkpoints, flushed to the disk and renamed over the old one, so a kill
    leaves the fp32 file or the cast one whole (and a .trash-* folder the next save or resume deletes); then
    config.json states the dtype. One tensor is in memory at a time. What is cast already is left alone, so a prune
    that runs again after a kill finishes the job."""
    from safetensors import safe_open

    if dtype not in SAFETENSORS_DTYPES:
        return
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in files:
        if dtypes_in(path) != {"F32"}:
            continue  # cast already, or not the fp32 weights a save writes
        trash = runfolder.fresh_folder(os.path.dirname(folder), ".trash-")
        aside = os.path.join(trash, os.path.basename(path))
        with safe_open(path, "pt") as weights:
            write_cast(weights, aside, dtype)
        runfolder.replace(aside, path)
        runfolder.sync_folder(folder)
        with contextlib.suppress(OSError):  # else the next save or resume deletes it (clear_leftovers)
            runfolder.remove(trash, missing_ok=True)
    if files and all(dtypes_in(path) == {SAFETENSORS_DTYPES[dtype]} for path in files):
        state_dtype(os.path.join(folder, "config.json"), dtype)


def dtypes_in(path: str) -> set[str]:
    """The safetensors dtypes ("F32", "BF16", ...) of a file's tensors, read from its header."""
    from safetensors import safe_open

    with safe_open(path, "pt") as weights:
        return {weights.get_slice(name).get_dtype() for name in weights.keys()}


def state_dtype(config_path: str, dtype: torch.dtype):
    """config.json says the weights' dtype (under the key it uses: dtype, or torch_dtype before transformers 5), as
    the base model's does: a loader that takes the config's dtype (vLLM's "auto") computes in it."""
    with open(config_path) as f:
        config = json.load(f)
    keys, name = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"], str(dtype).split(".")[-1]
    if any(config.get(key) != name for key in keys):
        runfolder.replace_file(config_path, [json.dumps({**config, **{key: name for key in keys}}, indent=2,
                                                        sort_keys=True) + "\n"])


def write_cast(weights, path: str, dtype: torch.dtype):
    """A safetensors file at path holding weights' tensors (an open safe_open of fp32 ones) cast to dtype, written
    one tensor at a time and flushed to the disk: the format's 8-byte little-endian header length, its JSON header
    (each tensor's dtype, shape and byte range in the data; padded with spaces to 8 bytes), then the data."""
    names, header, offset = list(weights.keys()), {}, 0
    for name in names:
        shape = weights.get_slice(name).get_shape()
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if weights.metadata():
        header["__metadata__"] = weights.metadata()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with runfolder.open_file(path, "xb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            tensor = weights.get_tensor(name).to(dtype).contiguous()  # one tensor at a time
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
