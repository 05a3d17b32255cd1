"""Several processes (torchrun) and one: the process group, reductions, FSDP2 sharding, mini- and micro-batches.

Several processes (torchrun) and one: the process group, reductions, FSDP2 sharding, and the mini- and
micro-batches every rank must cut alike. A reader of the method may skip this module: in one process every
reduction is the identity and every split is the one a single process would make.
"""

import collections
import contextlib
import datetime
import glob
import os
import re
import sys

import torch
import torch.distributed as torch_dist

_device: list[torch.device] = []
# The torch releases whose FSDP2 the private calls below (state._auto_reshard_after_forward, the parameter groups,
# their post_forward_mesh_info) and as_forward's forward hooks were read against: 2.11 (the lent H200 machine's), 2.13
# (the CPU pin) and 2.14 (the GPU pin, vLLM 0.33's)
TORCH_RANGE = ((2, 11), (2, 14))
_warned: list[str] = []


def init(timeout_minutes: float = 60.0, offload: bool = False, prog: str = "remix") -> torch.device:
    """Join the process group (NCCL on GPUs, gloo on CPUs) and pick this rank's GPU. Under torchrun it is
    torchrun's; `python remix.py` makes a group of one, so that one process shards, casts and reduces through
    the same FSDP2 code as many. No collective waits longer than timeout_minutes: the other ranks wait in one
    while rank 0 writes the whole model folders of a checkpoint (NCCL's own default is 10 minutes). With offload
    (--offload) a GPU's group also has gloo for tensors on the host: the gradient-norm clip reduces the offloaded
    gradients' norms there (NCCL takes GPU tensors only)."""
    cuda = torch.cuda.is_available()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = launch_numbers(cuda, prog) if torchrun else 0
    if cuda:  # one process is GPU 0, as vLLM's own executor takes it (CUDA_VISIBLE_DEVICES picks another)
        torch.cuda.set_device(local_rank)
    if not torch_dist.is_initialized():
        backend = ("cuda:nccl,cpu:gloo" if offload else "nccl") if cuda else "gloo"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if torchrun:
            torch_dist.init_process_group(backend, timeout=timeout)
        else:
            torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    check_torch(torch.__version__, prog)  # once the group is there: its line comes from the first process only
    _device[:] = [torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")]
    return _device[0]


def check_torch(version: str, prog: str = "remix"):
    """torch older than TORCH_RANGE is refused in one line (its FSDP2 differs where remix reaches into it); a newer one
    is warned about once, and the program goes on."""
    from machinery import console

    release = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    (oldest, newest), named = TORCH_RANGE, lambda r: ".".join(map(str, r))  # noqa: E731
    if release < oldest:
        console.fail(f"torch {version} is older than {named(oldest)}: remix runs on torch {named(oldest)} to "
                     f"{named(newest)}, whose FSDP2 it was checked against (requirements-gpu.txt pins the GPU's, "
                     f"requirements-cpu.txt the CPU's)", prog)
    if release > newest and version not in _warned:
        _warned.append(version)
        console.say(f"warning: torch {version} is newer than {named(newest)}, the last release whose FSDP2 remix was "
                    f"checked against (machinery/dist.py reaches into it); the run goes on", prog)


def launch_numbers(cuda: bool, prog: str = "remix") -> int:
    """torchrun's numbers, each checked as a flag is (flags.env_number) before the process group reads them: the
    world and this rank in it, the node's processes and this one's place among them (a GPU of this node), the
    rendezvous port. Returns LOCAL_RANK."""
    from machinery.flags import env_number

    world_size = env_number("WORLD_SIZE", 1, "in [1, 1048576]", int, prog)
    env_number("RANK", 0, f"in [0, {world_size - 1}]", int, prog)
    local = env_number("LOCAL_WORLD_SIZE", world_size, f"in [1, {world_size}]", int, prog)
    gpus = min(local, torch.cuda.device_count()) if cuda else local
    env_number("MASTER_PORT", 29500, "in [1, 65535]", int, prog)
    return env_number("LOCAL_RANK", 0, f"in [0, {max(gpus, 1) - 1}]", int, prog)


def local_world(prog: str = "remix") -> int:
    """The processes on this node: torchrun's LOCAL_WORLD_SIZE (checked, at most the world), or the world."""
    from machinery.flags import env_number

    return env_number("LOCAL_WORLD_SIZE", world(), f"in [1, {world()}]", int, prog)


def device() -> torch.device:
    """This rank's device (init's choice; the CPU before init)."""
    return _device[0] if _device else torch.device("cpu")


def rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


def world() -> int:
    return torch_dist.get_world_size() if torch_dist.is_initialized() else 1


def barrier():
    if torch_dist.is_initialized():
        torch_dist.barrier()


def clear_cpu_shm():
    """vLLM's CPU tensor-parallel channel is a shared-memory file whose name is the same for every job under
    torchrun (external_launcher), so a file left by a killed job makes the next engine fail (errno 17):
    rank 0 removes them before an engine starts and after the job. One such CPU job at a time per machine."""
    if rank() == 0:
        for path in glob.glob("/dev/shm/*-cpushm*"):
            with contextlib.suppress(OSError):
                os.remove(path)
    barrier()


def finish(llm=None):
    """The end of a run that finished: the engine and the process group shut down, then the process exits.
    Under torchrun every rank has finished and leaves without the group's teardown, which can abort at exit
    (and vLLM's destroys groups a second time)."""
    if world() > 1:
        clear_cpu_shm()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if llm is not None:
        with contextlib.suppress(Exception):  # the engine's own shutdown; nothing is lost if it fails at exit
            llm.llm_engine.engine_core.shutdown()
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def per_rank(n: int) -> int:
    """Each rank's part of a global count (flags.check_args checks that it divides)."""
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
    """Every rank's object, in rank order, on every rank."""
    if world() == 1:
        return [obj]
    gathered = [None] * world()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


def broadcast(obj):
    """Rank 0's object on every rank."""
    if world() == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------------------------
# FSDP2: sharding, forwards that use the root's weights, whole weights for a while
# ----------------------------------------------------------------------------------------------
def host_collectives() -> bool:
    """Whether collectives can take tensors on the host: gloo's group, or a GPU group made with offload (init)."""
    return not torch_dist.is_initialized() or "gloo" in str(torch_dist.get_backend())


def shard(model, device, compute_dtype: torch.dtype, offload: bool = False):
    """The model sharded with FSDP2 over the ranks (a group of one in one process): each decoder layer, then the
    whole model, so parameters, gradients and optimizer state are split. Each call moves that layer's states to
    the device, so no device ever holds a whole fp32 model. A model whose weights are stored in another dtype
    than compute_dtype (fp32 masters under --precision bf16) computes with weights cast to compute_dtype, the
    embeddings and residual stream included, and reduces gradients in fp32: a bf16 reference computes exactly
    as the policy does before its first update. offload (--offload, trained models only): FSDP2's CPU offload keeps
    the shards, gradients and so the optimizer's state and step on the host, copying each layer's weights to the
    device for its pass; the host memory is pinned on a GPU."""
    import warnings

    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # none is changed in place
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if next(model.parameters()).dtype != compute_dtype else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=precision, offload_policy=policy)
    model = fully_shard(model, mp_policy=precision, offload_policy=policy)
    return model if offload else model.to(device)  # .to: buffers that no call moved (it would move offloaded shards)


def as_forward(model, fn, *inputs):
    """fn(*inputs), run as the model's own forward as far as FSDP2 is concerned: the root's weights (embeddings,
    final norm, output layer) are gathered before it, and after a backward through its output their gradients are
    reduced; the inputs are a forward's (moved to the model's device, floating ones cast to its compute dtype). fn is
    any function (remix.policy_forward's trunk and output layer), run through torch's public
    register_fsdp_forward_method as a method of the model that takes fn and its inputs. FSDP2 so always receives the
    real inputs: torch 2.11's root pre-forward on a GPU indexes the inputs it moved without checking that there were
    any (an empty call raised IndexError there). A model that is not sharded just runs fn."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return fn(*inputs)
    if "run_as_forward" not in model.__dict__:  # once per model: the method FSDP2 wraps with its forward hooks
        model.run_as_forward = lambda fn, *inputs: fn(*inputs)
        register_fsdp_forward_method(model, "run_as_forward")
    return model.run_as_forward(fn, *inputs)


def reshard(model):
    """Free the whole copy of the root's weights that FSDP2 keeps after a forward for the backward to come. A
    no-grad pass has no backward, so without this a frozen reference would hold its embeddings and output layer
    whole for the whole run (about 0.9 GB per GPU at 1.5B): every no-grad pass ends with it."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


@contextlib.contextmanager
def unsharded(model):
    """Whole weights on every rank for a while (transformers' generate runs a different number of forward
    passes on each rank, so the sharded model's per-pass gathers would not line up). Each module's own
    reshard-after-forward setting comes back afterwards: FSDP2 keeps the root unsharded after forward on
    purpose (backward needs its embeddings and output layer at once), and resetting it to True would make
    every later backward gather them again. The setting is private state, so it is saved as it is."""
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
    """An FSDP2 state's parameter groups: torch 2.13 and 2.14 keep a list (`_fsdp_param_groups`), 2.11 one group or
    None (`_fsdp_param_group`); `_auto_reshard_after_forward` and `post_forward_mesh_info` are in all three (read
    in each version's fsdp/_fully_shard sources)."""
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


# ----------------------------------------------------------------------------------------------
# Mini- and micro-batches: the same cut on every rank, stand-ins where a rank has nothing
# ----------------------------------------------------------------------------------------------
# What an empty rank runs so that it joins the other ranks' FSDP gathers and reductions, in their order: a
# one-token sample whose response mask is empty (collate), so every loss term and its gradient are 0. Any
# per-token field the method reads of it (a fork's too) is one zero: the stand-in never lists the fields.
class StandIn(dict):
    def __missing__(self, key):
        return torch.zeros(1)


STAND_IN = StandIn(prompt_ids=[0], response_ids=[0], stand_in=True, reward=0.0, group=-1, version=0)
MAX_PADDING = 0.1  # a micro-batch is at most 10% wider than its shortest sample: padding costs its full share
padding = collections.Counter()  # token slots and real tokens of every micro-batch since the last step's record


def mini_batches(batch: list[dict], size: int, seed: int, step: int, epoch: int) -> list[list[dict]]:
    """One update pass's mini-batches of `size` responses, as one process would cut them: a random order of the
    global batch, the same on every rank (seeded by the run's seed, the step and the pass), cut into pieces of
    `size`, a trailing partial one included (Decision 13). Each rank gets the rows it holds of each piece."""
    sizes = all_gather(len(batch))
    offset, total = sum(sizes[: rank()]), sum(sizes)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch)
    order = torch.randperm(total, generator=generator).tolist()
    return [[batch[i - offset] for i in order[start : start + size] if offset <= i < offset + len(batch)]
            for start in range(0, total, size)]


def micro_batches(samples: list[dict], max_tokens: int) -> list[list[dict]]:
    """Samples of similar length grouped into micro-batches of at most max_tokens padded tokens (rows x
    (longest prompt + longest response)), each at most MAX_PADDING wider than its shortest sample, so padding
    stays small; a longer sample runs alone. Every rank gets the same number (FSDP gathers weights in every
    pass): a rank with fewer runs STAND_IN micro-batches."""
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
        padding["slots"] += len(plan) * (max(len(s["prompt_ids"]) for s in plan) + max(len(s["response_ids"]) for s in plan))
        padding["tokens"] += sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in plan)
    return plans + [[STAND_IN]] * (int(all_reduce(torch.tensor(len(plans)), "max")) - len(plans))
