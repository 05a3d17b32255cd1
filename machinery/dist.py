"""Several processes (torchrun) and one: the process group, reductions, FSDP2 sharding, mini- and micro-batches."""

import collections
import contextlib
import datetime
import glob
import os
import re
import sys
import warnings

import torch
import torch.distributed as torch_dist

from machinery import console

_device: list[torch.device] = []
TORCH_RANGE = ((2, 11), (2, 14))  # releases whose FSDP2 internals unsharded and as_forward use: 2.11, 2.13, 2.14
_warned: list[str] = []

def init(timeout_minutes: float = 60.0, offload: bool = False) -> torch.device:
    """Join torchrun's process group or one of one (NCCL, gloo on CPUs and with offload); returns this rank's device."""
    cuda = torch.cuda.is_available()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = 0
    if torchrun:  # torchrun's numbers, each checked as a flag is before the process group reads them
        world_size = console.env_number("WORLD_SIZE", 1, "in [1, 1048576]")
        console.env_number("RANK", 0, f"in [0, {world_size - 1}]")
        local = console.env_number("LOCAL_WORLD_SIZE", world_size, f"in [1, {world_size}]")
        gpus = min(local, torch.cuda.device_count()) if cuda else local
        console.env_number("MASTER_PORT", 29500, "in [1, 65535]")
        local_rank = console.env_number("LOCAL_RANK", 0, f"in [0, {max(gpus, 1) - 1}]")
    if cuda:  # one process is GPU 0, as vLLM's own executor takes it (CUDA_VISIBLE_DEVICES picks another)
        torch.cuda.set_device(local_rank)
    if not torch_dist.is_initialized():
        backend = ("cuda:nccl,cpu:gloo" if offload else "nccl") if cuda else "gloo"
        alone = {} if torchrun else {"store": torch_dist.HashStore(), "rank": 0, "world_size": 1}
        torch_dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes), **alone)
    console.set_rank(rank())
    check_torch(torch.__version__)  # once the group is there: its line comes from the first process only
    _device[:] = [torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")]
    return _device[0]

def side_group(port: int, rank: int, size: int, timeout_minutes: float):
    """A process group of size processes beside this process's default one (which stays as it is), met at port on
    this machine (rank 0 hosts the rendezvous): the backend torch's init_process_group builds for the device, made the
    way it makes it (distributed_c10d, torch 2.11-2.14): gloo on CPUs, NCCL on GPUs, each with the timeout."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = torch_dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout, wait_for_workers=False)
    if not torch.cuda.is_available():
        return torch_dist.ProcessGroupGloo(store, rank, size, timeout)
    options = torch_dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return torch_dist.ProcessGroupNCCL(store, rank, size, options)

def check_torch(version: str):
    """torch older than TORCH_RANGE is refused in one line; a newer one is warned about once, and the run goes on."""
    release = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    (oldest, newest), named = TORCH_RANGE, lambda r: ".".join(map(str, r))  # noqa: E731
    if release < oldest:
        console.fail(f"torch {version} is older than {named(oldest)}: remix runs on torch {named(oldest)} to "
                     f"{named(newest)}, whose FSDP2 it was checked against (requirements-gpu.txt pins the GPU's, "
                     f"requirements-cpu.txt the CPU's)")
    if release > newest and version not in _warned:
        _warned.append(version)
        console.say(f"warning: torch {version} is newer than {named(newest)}, the last release whose FSDP2 remix was "
                    f"checked against (machinery/dist.py reaches into it); the run goes on")

def local_world() -> int:
    """The processes on this node: torchrun's LOCAL_WORLD_SIZE (checked, at most the world), or the world."""
    return console.env_number("LOCAL_WORLD_SIZE", world(), f"in [1, {world()}]")

def device() -> torch.device:
    return _device[0] if _device else torch.device("cpu")

def rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0

def world() -> int:
    return torch_dist.get_world_size() if torch_dist.is_initialized() else 1

def barrier():
    if torch_dist.is_initialized():
        torch_dist.barrier()

def clear_cpu_shm():
    """Rank 0 removes vLLM's CPU shared-memory files (fixed names: a killed job's fail the next); one job at a time."""
    if rank() == 0:
        for path in glob.glob("/dev/shm/*-cpushm*"):
            with contextlib.suppress(OSError):
                os.remove(path)
    barrier()

def finish():
    """A finished run's end: under torchrun every rank os._exits (vLLM's teardown can abort), one process tears down."""
    if world() > 1:
        clear_cpu_shm()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()

def per_rank(n: int) -> int:
    """Each rank's part of a global count (console.check_args checks that it divides)."""
    return n // world()

def prompt_shares(prompts: list, vllm_tp: int) -> tuple[list, list, int, int]:
    """(this rank's prompts, its engine's prompts, the step index of the engine's first prompt, where this
    rank's prompts start among the engine's). The ranks of one --vllm-tp engine generate its prompts together."""
    share = per_rank(len(prompts))
    first = rank() // vllm_tp * vllm_tp * share
    return prompts[rank() * share :][:share], prompts[first : first + vllm_tp * share], first, rank() * share - first

def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) over ranks, in place; the identity in one process. NCCL reduces on the GPU."""
    if torch_dist.is_initialized() and world() > 1:
        work = tensor.cuda() if torch_dist.get_backend() == "nccl" else tensor
        torch_dist.all_reduce(work, op=torch_dist.ReduceOp.MAX if op == "max" else torch_dist.ReduceOp.SUM)
        tensor.copy_(work)
    return tensor

def all_gather(obj) -> list:
    if world() == 1:
        return [obj]
    gathered = [None] * world()
    torch_dist.all_gather_object(gathered, obj)
    return gathered

def broadcast(obj):
    if world() == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]

def host_collectives() -> bool:
    """Whether collectives can take tensors on the host: gloo's group, or a GPU group made with offload (init)."""
    return not torch_dist.is_initialized() or "gloo" in str(torch_dist.get_backend())

def shard(model, device, compute_dtype: torch.dtype, offload: bool = False):
    """The model sharded with FSDP2, each decoder layer then the whole; weights in another dtype (fp32 masters) compute
    in compute_dtype (as the bf16 reference does), reduce in fp32. offload keeps shards and AdamW state on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # none changed in place
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if next(model.parameters()).dtype != compute_dtype else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=precision, offload_policy=policy)
    model = fully_shard(model, mp_policy=precision, offload_policy=policy)
    return model if offload else model.to(device)  # .to: buffers that no call moved (it would move offloaded shards)

def as_forward(model, fn, *inputs):
    """fn(*inputs) as the model's FSDP2 forward: root weights gathered, gradients reduced (torch 2.11 needs inputs)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    if not isinstance(model, FSDPModule):
        return fn(*inputs)
    if "run_as_forward" not in model.__dict__:  # once per model: the method FSDP2 wraps with its forward hooks
        model.run_as_forward = lambda fn, *inputs: fn(*inputs)
        register_fsdp_forward_method(model, "run_as_forward")
    return model.run_as_forward(fn, *inputs)

def reshard(model):
    """Free the root's whole weights FSDP2 keeps for a backward: every no-grad pass ends so (0.9 GB per GPU at 1.5B)."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule):
        model.reshard()

@contextlib.contextmanager
def unsharded(model):
    """Whole weights on every rank for a while (generate runs a different number of passes per rank). The private
    reshard-after-forward state is restored as it was: set to True, every later backward would gather the root again."""
    from torch.distributed.fsdp import FSDPModule
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = [(m._get_fsdp_state()._auto_reshard_after_forward,
              [g.post_forward_mesh_info for g in _param_groups(m._get_fsdp_state())]) for m in modules]
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m, (auto, infos) in zip(modules, saved):
            m.reshard()
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for group, info in zip(_param_groups(state), infos):
                group.post_forward_mesh_info = info

def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: `_fsdp_param_groups` in torch 2.13 and 2.14, `_fsdp_param_group` in 2.11."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [group] if (group := state._fsdp_param_group) is not None else []

def full_tensors(model):
    """(name, full tensor) for each entry of the state dict, gathered from the shards one at a time."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "device_mesh") and tensor.device.type != tensor.device_mesh.device_type:
            tensor = tensor.to(tensor.device_mesh.device_type)  # an offloaded shard is gathered on the device
        yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()

def clip_grad_norm(model, max_norm: float) -> float:
    """Clip the model's gradients to max_norm over all ranks' shards; returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2

class StandIn(dict):
    """What an empty rank runs to join the others' FSDP gathers: an empty response mask, so loss and gradient 0."""

    def __missing__(self, key):
        return torch.zeros(1)  # any per-token field the method (or a fork) reads

STAND_IN = StandIn(prompt_ids=[0], response_ids=[0], stand_in=True, reward=0.0, group=-1, version=0)
MAX_PADDING = 0.1  # a micro-batch is at most 10% wider than its shortest sample: padding costs its full share
padding = collections.Counter()  # token slots and real tokens of every micro-batch since the last step's record

def mini_batches(batch: list[dict], size: int, seed: int, step: int, epoch: int) -> list[list[dict]]:
    """One pass's mini-batches of `size` responses, cut as one process would: a seeded random order of the global
    batch, a trailing partial piece included (Decision 13). Each rank gets the rows it holds of each piece."""
    sizes = all_gather(len(batch))
    offset, total = sum(sizes[: rank()]), sum(sizes)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch))
    return [[batch[i - offset] for i in order[start : start + size].tolist() if offset <= i < offset + len(batch)]
            for start in range(0, total, size)]

def micro_batches(samples: list[dict], max_tokens: int) -> list[list[dict]]:
    """Samples of similar length in micro-batches of at most max_tokens padded tokens, each at most MAX_PADDING wider
    than its shortest sample (a longer one runs alone); every rank gets as many, filled out with STAND_IN ones."""
    plans, current, widths = [], [], (0, 0)
    for s in sorted(samples, key=lambda s: len(s["prompt_ids"]) + len(s["response_ids"])):
        grown = (max(widths[0], len(s["prompt_ids"])), max(widths[1], len(s["response_ids"])))
        shortest = len(current[0]["prompt_ids"]) + len(current[0]["response_ids"]) if current else 0
        if current and ((len(current) + 1) * sum(grown) > max_tokens or sum(grown) > (1 + MAX_PADDING) * shortest):
            plans.append(current)
            current, grown = [], (len(s["prompt_ids"]), len(s["response_ids"]))
        current, widths = current + [s], grown
    plans += [current] if current else []
    for plan in plans:  # perf/padding: the share of the trainer's token slots that are padding
        widest = max(len(s["prompt_ids"]) for s in plan) + max(len(s["response_ids"]) for s in plan)
        padding["slots"] += len(plan) * widest
        padding["tokens"] += sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in plan)
    return plans + [[STAND_IN]] * (int(all_reduce(torch.tensor(len(plans)), "max")) - len(plans))
