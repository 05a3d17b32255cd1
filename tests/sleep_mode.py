"""vLLM's GPU sleep mode, modelled around the real CPU engine (the CPU build has none), so that every sequence of
sleep, wake, push and generate that remix.py and eval.py make runs in the tests as it would on a GPU.

What it models, as read in vLLM 0.33.0's sources (the same from 0.24 to main):
- `LLM.sleep(level)` (entrypoints/llm.py -> v1/engine/core.py `EngineCore.sleep`): the scheduler is paused and the
  prefix cache cleared (level >= 1); the executor (v1/executor/abstract.py) marks both tags, 'weights' and
  'kv_cache', asleep ("Executor is already sleeping" and nothing else, if weights sleep already). The worker's
  cumem allocator (device_allocator/sleep_mode_backend.py, cumem.py) keeps only the 'runtime' and 'cudagraph'
  allocations at level 2, and the weights too at level 1, copied to host memory: at level 2 the weights are gone.
- `LLM.wake_up(tags)` (`EngineCore.wake_up`): the executor wakes the given tags, or warns and does nothing when it
  is not sleeping or a tag is not asleep; woken level-1 weights come back from the host copy, level-2 weights are
  memory with no meaning until a load; the scheduler resumes only once no tag sleeps (`fully_awake`).
- `LLM.generate` on a paused scheduler: the requests are queued and never scheduled, and the loop spins forever. Here
  it raises at once (`WouldHang`), and so does a generate on level-2 weights that no load has filled since (on a
  GPU: garbage tokens; here the weights are really overwritten with noise too, for anything that looks past it).
- `collective_rpc("reload_weights")` while the weights sleep: a write into unmapped device memory (on a GPU, an
  illegal memory access); here it raises.

`install()` makes `vllm.LLM` build this around the CPU engine whenever sleep mode is asked for, and makes the
platform say it has sleep mode (as CUDA does), so `engines.start` takes its GPU path. Run as a script, it installs
itself and then runs another script: `python tests/sleep_mode.py remix.py --model ...` (also under torchrun).
"""

import logging
import runpy
import sys
from pathlib import Path

import torch

log = logging.getLogger("sleep_mode")
TAGS = frozenset(("weights", "kv_cache"))


class WouldHang(RuntimeError):
    """What vLLM on a GPU does not raise: it loops, or computes garbage, or faults."""


class SleepModeLLM:
    """A real vLLM `LLM` with GPU sleep mode around it. `calls` records what was asked of it, in order."""

    def __init__(self, llm):
        self._llm = llm
        self.llm_engine = _Engine(llm.llm_engine, self)
        self.sleeping_tags: set[str] = set()  # the executor's
        self.paused = False  # the engine core's scheduler
        self.host_copy = None  # level 1's weights in host memory
        self.weights_lost = False  # level 2: weights awake again only once a load has filled them
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def sleep(self, level: int = 1, mode: str = "abort"):
        self.calls.append(("sleep", level))
        self.paused = True
        if level < 1:
            return
        self._llm.reset_prefix_cache()
        if "weights" in self.sleeping_tags:
            log.warning("Executor is already sleeping.")
            return
        if level == 1:
            self.host_copy = self._llm.apply_model(lambda m: {n: p.detach().clone() for n, p in m.named_parameters()})
        else:
            self._llm.apply_model(_overwrite_with_noise)
            self.weights_lost = True
        self.sleeping_tags |= TAGS

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))
        tags = None if tags is None else [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            if not self.sleeping_tags:
                log.warning("Executor is not sleeping.")
            elif tags and any(t not in self.sleeping_tags for t in tags):
                log.warning("Tag %s is not in sleeping tags %s", tags, self.sleeping_tags)
            else:
                woken = set(tags) if tags else set(self.sleeping_tags)
                if "weights" in woken and self.host_copy is not None:
                    copies = self.host_copy
                    self._llm.apply_model(lambda m: _copy_in(m, copies[0]))
                    self.host_copy = None
                self.sleeping_tags -= woken
        if not self.sleeping_tags:
            self.paused = False
        return not self.sleeping_tags

    def generate(self, *args, **kwargs):
        self.calls.append(("generate",))
        if self.paused:
            raise WouldHang(f"LLM.generate on a sleeping engine (asleep: {sorted(self.sleeping_tags) or 'scheduling'}):"
                            " vLLM queues the requests and never schedules them")
        if self.weights_lost:
            raise WouldHang("LLM.generate after a level-2 sleep with no weight load since: garbage weights")
        return self._llm.generate(*args, **kwargs)

    def collective_rpc(self, method, *args, **kwargs):
        if method == "reload_weights":
            self.calls.append(("reload_weights",))
            if "weights" in self.sleeping_tags:
                raise WouldHang("reload_weights while the weights sleep: a write into unmapped device memory")
            result = self._llm.collective_rpc(method, *args, **kwargs)
            self.weights_lost = False
            return result
        return self._llm.collective_rpc(method, *args, **kwargs)


class _Engine:
    """`llm.llm_engine` with the sleep state: `is_sleeping()` as `EngineCore.is_sleeping` (paused, or a tag asleep)."""

    def __init__(self, engine, owner: SleepModeLLM):
        self._engine, self._owner = engine, owner

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def is_sleeping(self) -> bool:
        return self._owner.paused or bool(self._owner.sleeping_tags)


@torch.no_grad()
def _overwrite_with_noise(model):
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator).to(p.dtype))


@torch.no_grad()
def _copy_in(model, saved: dict):
    for n, p in model.named_parameters():
        p.copy_(saved[n])


def install(patch=setattr):
    """`vllm.LLM(..., enable_sleep_mode=True)` builds the real CPU engine wrapped in SleepModeLLM (its config says
    sleep mode, as a GPU engine's does); the platform reports sleep mode. Returns the engines built, in order.
    patch(obj, name, value) sets the two attributes (pytest's monkeypatch.setattr undoes them after a test)."""
    import vllm
    from vllm.platforms import current_platform

    real, built = vllm.LLM, []

    def llm(*args, enable_sleep_mode: bool = False, **kwargs):
        engine = real(*args, **kwargs)
        if not enable_sleep_mode:
            return engine
        engine.llm_engine.model_config.enable_sleep_mode = True  # read only at the start, by the GPU allocator
        built.append(SleepModeLLM(engine))
        return built[-1]

    patch(vllm, "LLM", llm)
    patch(current_platform, "is_sleep_mode_available", lambda: True)
    return built


if __name__ == "__main__":  # python tests/sleep_mode.py SCRIPT ARGS...: SCRIPT run as __main__ with the stand-in
    script = str(Path(sys.argv[1]).resolve())
    sys.path[0] = str(Path(script).parent)
    sys.argv = [script, *sys.argv[2:]]
    install()
    runpy.run_path(script, run_name="__main__")
