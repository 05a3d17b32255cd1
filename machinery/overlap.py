"""--overlap's sampler: a process of its own drawing step k+1's batch with pi_k while the trainer trains step k.

The process is a grader.Worker (a fresh interpreter, ended by the kernel with the trainer) holding a vLLM engine and a
copy of the policy in the compute dtype; with --overlap-gpus N, N such processes share one tensor-parallel engine,
each with a copy, and split the work of mu. The trainer's weights reach it with each batch it is asked to draw, so at
a batch boundary only, by one broadcast a tensor from trainer rank 0 to all its processes (engines.weights_group: gloo
on CPUs, NCCL on GPUs) into their copies, from which their engine loads them; it returns each response with mu, the
method's log pi on the copy of the policy that drew it (Decision 22: the trainer's code on the sampler's weights, what
a synchronous step stores). At most one batch is in flight: a save, an evaluation or the next draw waits for it, and a
checkpoint holds it (its policy is gone). Under torchrun rank 0 starts and feeds the sampler, and every rank gets the
whole batch drawn and takes its share.
"""

import contextlib
import threading
import time
from multiprocessing import connection

from machinery import console, engines, grader

_served: dict = {}  # in the sampler process: its engine, its copy of the policy and the method's log pi

def _start(settings: dict, max_model_len: int, logp: tuple, pad: int):
    """In the sampler process: the engine and the copy (engines.serve), the method's log pi found by its reference."""
    _served.update(engines.serve(settings, max_model_len), logp=grader.resolve(logp), pad=pad)

def _join(timeout_minutes: float) -> list:
    """In the sampler process: the group with trainer rank 0 that the weights arrive by; the copy's entries (name,
    shape, dtype), which the trainer checks its own against and sends in."""
    _served["group"] = engines.weights_group(timeout_minutes)
    return [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in _served["copy"].state_dict().items()]

def _draw(prompts: list[list[int]], n: int, seeds: list[int], sampling: tuple, with_mu: bool):
    """In the sampler process: the trainer's weights in, then n responses to each prompt (and their mu)."""
    return engines.serve_draw(_served, prompts, n, seeds, sampling, with_mu)

class Sampler:
    """The trainer's handle on the sampler process: draw() starts a step's batch with the policy's weights as they are
    now, take() returns it once drawn. A sampler that fails, dies or outlives --dist-timeout stops the run in one line
    that names the checkpoint to resume from; nothing is waited for without a deadline."""

    def __init__(self, args, max_model_len: int, policy, logp, tokenizer, request: tuple):
        """logp(model, batch, temperature)[0]: the method's log pi [n, l] of each response token (mu, on the copy);
        tokenizer: its pad token stands for an empty response, as in the trainer's samples; request: (n responses a
        prompt, temperature, top_p, max tokens), each prompt seeded by its index in the step as the method seeds."""
        self.args, self.policy, self.n, self.sampling = args, policy, request[0], request[1:]
        self.in_flight, self.ready, self.kept = None, None, contextlib.ExitStack()
        self.kept.enter_context(engines.kept_threads())  # on a CPU the trainer's share of the cores, until close()
        envs = engines.sampler_envs(args)
        self.workers = [grader.Worker(env) for env in envs]  # none on ranks but 0
        settings = {name: getattr(args, name) for name in engines.SERVED_SETTINGS}
        self.send(_start, settings, max_model_len, grader.reference(logp), tokenizer.pad_token_id)
        self.answer("starting its engine")
        self.send(_join, args.dist_timeout)  # started: answer() watches it (a death, a failure) while the group forms
        joined = []
        joining = threading.Thread(target=lambda: joined.append(engines.weights_group(args.dist_timeout, envs)),
                                   daemon=True)
        joining.start()
        entries = self.answer("joining the group the weights go by")
        joining.join()
        self.group = joined[0]  # None on ranks but 0
        engines.check_entries(policy, entries)
        self.dtypes = [dtype for _, _, dtype in entries]  # each tensor's in the copy

    def draw(self, step: int, prompts: list, version: int):
        """Step's batch, drawn from these prompts by the policy as it is now: pi_version, the trainer's at its step."""
        if self.in_flight is not None or self.ready is not None:
            raise RuntimeError(f"--overlap: step {(self.in_flight or self.ready[0])[0]}'s batch is not taken yet")
        seeds = [engines.request_seed(self.args.seed, step, i, self.n) for i in range(len(prompts))]
        self.send(_draw, [p.ids for p in prompts], self.n, seeds, self.sampling, True)
        self.push()
        self.in_flight = (step, prompts, version)

    def holds(self, step: int) -> bool:
        """Whether step's batch is drawn or being drawn (ahead, or saved with the checkpoint a run resumed from)."""
        pending = self.in_flight or (self.ready[0] if self.ready else None)
        return pending is not None and pending[0] == step

    def take(self, step: int) -> tuple[list, tuple]:
        """(prompts, (version, groups)) of step's batch, waiting for it while it is being drawn; groups: for each
        prompt, its responses as engines.vllm_generate gives them, each with its mu [L] last."""
        self.wait()
        (drawn_for, prompts, version), groups = self.ready
        if drawn_for != step:
            raise RuntimeError(f"--overlap: the batch in flight is step {drawn_for}'s, not step {step}'s")
        self.ready = None
        return prompts, (version, groups)

    def wait(self):
        """The batch in flight, drawn, on every rank: kept as ready (a save or an evaluation waits for it)."""
        if self.in_flight is not None:
            drawn = self.answer(f"drawing step {self.in_flight[0]}'s batch")
            self.in_flight, self.ready = None, (self.in_flight, drawn)

    def state(self) -> dict | None:
        """What a checkpoint keeps: the next step's batch, drawn by a policy the trainer no longer holds."""
        self.wait()
        if self.ready is None:
            return None
        (step, prompts, version), drawn = self.ready
        return {"step": step, "version": version, "prompts": [tuple(p) for p in prompts], "drawn": drawn}

    def restore(self, saved: dict | None):
        """A resumed run's batch in flight, as state() returned it at the save (its prompts as the caller's again)."""
        self.ready = None if saved is None else ((saved["step"], saved["prompts"], saved["version"]), saved["drawn"])

    def vllm_generate(self, prompts: list[list[int]], n: int, seeds: list[int], temperature: float, top_p: float,
                      max_tokens: int, logprobs: bool = False, use_tqdm=False):
        """engines.vllm_generate's answer from the sampler's engine with the policy's weights now (an evaluation),
        after the batch in flight (engines.generate hands every rank all the prompts, as ranks of one engine)."""
        self.wait()
        self.send(_draw, prompts, n, seeds, (temperature, top_p, max_tokens), False)
        self.push()
        return self.answer("generating an evaluation's responses")

    def push(self):
        """The policy's weights as they are now to every sampler process, by one broadcast a tensor from rank 0 (every
        rank joins the gathers), once the task that receives them has started; a sampler process that dies or fails
        under it (anything on its pipe but the task's answer, which only the weights let come) ends the sending, and
        answer() says what happened."""
        self.answer("starting to draw", started=True)
        engines.send_weights(self.group, self.policy, self.dtypes,
                             lambda: not any(worker.answers.poll() for worker in self.workers))

    def send(self, task, *args):
        for worker in self.workers:
            try:
                worker.tasks.send((grader.reference(task), args))
            except OSError:  # its pipe is closed: it died, and answer() says how
                pass

    def answer(self, what: str, started: bool = False):
        """The sampler's answer to its one task (its first process's; started: that each process has begun it), on
        every rank, within --dist-timeout; a failure, a death or a hang of any of its processes: one line, from rank
        0."""
        deadline, pending = time.monotonic() + self.args.dist_timeout * 60, list(self.workers)
        answers, failure = {}, None
        while pending and failure is None:
            ready = connection.wait([w.answers for w in pending], max(deadline - time.monotonic(), 0.0))
            if not ready:
                failure = f"did not answer in --dist-timeout {self.args.dist_timeout:g} minutes while {what}"
            for worker in [w for w in pending if w.answers in ready]:
                try:
                    message = worker.answers.recv()
                except EOFError:
                    code = worker.proc.wait()
                    failure = f"died ({f'killed by signal {-code}' if code < 0 else f'exit code {code}'}) while {what}"
                    break
                if message[0] == "error":  # a refusal it printed (SystemExit) stands above
                    failure = f"failed while {what}: {(message[1].strip().splitlines() or [''])[0][:300]}"
                elif started or message != "go":  # "go": it has started the task
                    answers[worker] = None if started else message[1]
                    pending = [w for w in pending if w is not worker]
        said = engines.shared(failure or answers.get(self.workers[0]) if self.workers else None)
        if isinstance(said, str):  # every rank stops: rank 0 says the line
            self.close()
            console.fail(f"the sampler process (--overlap) {said}; {console.stopped_at()}")
        return said

    def close(self):
        for worker in self.workers:
            worker.kill()
        self.kept.close()
