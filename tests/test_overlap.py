"""Asynchronous ReMix (--overlap): the sampler process draws step k+1's batch with pi_k while step k trains.

Each test reads what the run's wiring must give against the policy that really drew a batch: versions and staleness,
mu from the sampler's copy of that policy, pi_k from the trainer's; a kill -9 of either process loses nothing; a run
whose sampler never runs ahead is the synchronous run. Real vLLM (CPU build) in a real second process.

    pytest -q -m "" tests/test_overlap.py
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import remix  # noqa: E402
from machinery import console, models  # noqa: E402
from tests.common import ROOT, plain_copy, read_metrics, tiny_args  # noqa: E402



def overlapped_args(model, data, out, **overrides):
    return tiny_args(model, data, out, **{"sampler": "vllm", "overlap": True, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=pytest.mark.long)])
def test_each_fresh_batch_carries_the_version_and_mu_of_the_policy_that_drew_it(gpus, tiny_model, train_file,
                                                                                 tmp_path):
    """Steps 1-4, T = 3: step 1 drawn by pi_1 (nothing ran ahead), steps 2 and 3 by pi_1 and pi_2 while steps 1 and
    2 trained, step 4 by pi_4 (drained at T). mu is the drawing policy's log pi, pi_k the trainer's at the step; the
    engine's own log-probs agree with mu, so every shard of a tensor-parallel sampler (--overlap-gpus 2: two
    processes) drew with that policy's weights."""
    policies, seen = {}, []  # policies[k]: a plain copy of pi_k, the policy at the start of step k

    def on_step(step, record, policy, tokenizer, batch):
        fresh = [s for s in batch if not s["historical"]]
        versions = {s["version"] for s in fresh}
        assert len(versions) == 1
        version = versions.pop()
        logp = remix.logp_of(args)
        mu = models.per_token(logp, policies[version], fresh, 1 << 20)
        prox = models.per_token(logp, policies[step], fresh, 1 << 20)
        assert record["mismatch/abs_log_ratio_mean"] < 1e-5  # fp32: 1.6e-7; a shard left with older weights: 1e-2
        seen.append((step, version, record["batch/staleness"],
                     max((a - s["behaviour_logp"]).abs().max().item() for a, s in zip(mu, fresh)),
                     max((a - s["prox_logp"]).abs().max().item() for a, s in zip(prox, fresh)),
                     max((s["prox_logp"] - s["behaviour_logp"]).abs().max().item() for s in fresh)))
        policies[step + 1] = plain_copy(policy)

    args = overlapped_args(tiny_model, train_file, tmp_path / "run", steps=4, reincarnate_step=3,
                           kl_convex_start=0, precision="fp32", overlap_gpus=gpus)
    from transformers import AutoModelForCausalLM
    policies[1] = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, trust_remote_code=False).eval()
    remix.train(args, on_step=on_step)
    assert [(step, version, staleness) for step, version, staleness, *_ in seen] == \
        [(1, 1, 0.0), (2, 1, 1.0), (3, 2, 1.0), (4, 4, 0.0)]
    for step, version, _, mu_gap, prox_gap, stale in seen:
        assert mu_gap < 1e-5 and prox_gap < 1e-5, (step, mu_gap, prox_gap)  # the policies they name, exactly
        assert (stale > 1e-3) == (version < step), (step, stale)  # one step of staleness is there to correct


def cli(model, data, out) -> list[str]:
    return [sys.executable, str(ROOT / "remix.py"), "--model", model, "--dataset", data, "--out", str(out),
            "--sampler", "vllm", "--overlap", "--algo", "ppo", "--steps", "6", "--prompts-per-step", "10",
            "--max-response-tokens", "24", "--mini-batch-prompts", "4", "--save-every", "2", "--seed", "5",
            "--eval-every", "0", "--reincarnate-step", "5", "--kl-convex-start", "0"]


def sampler_of(pid: int) -> int:
    """The pid of a trainer process's sampler process: its child that has vLLM loaded (grader workers do not)."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if "vllm" in Path(f"/proc/{child}/maps").read_text():
            return int(child)
    raise AssertionError("the run has no sampler process")


def into_step_after(proc, out, checkpoint: int):
    deadline = time.time() + 300
    while not (out / f"checkpoint-{checkpoint}" / "trainer_state.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before the checkpoint"
        time.sleep(0.05)
    time.sleep(0.5)


@pytest.mark.slow
def test_a_kill_of_the_sampler_or_the_trainer_loses_nothing(tiny_model, train_file, tmp_path):
    """A run whose sampler is killed (-9) in step 3 stops in one line naming the checkpoint to resume from; resumed, its
    trainer is killed (-9) in step 5, and the sampler ends with it; resumed again, it ends as the uninterrupted run:
    each checkpoint held the batch drawn ahead by a policy the resumed run no longer has."""
    from tests.test_runs import comparable

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(cli(tiny_model, train_file, tmp_path / "straight"), check=True, env=env, capture_output=True,
                   timeout=600)
    out = tmp_path / "killed"
    proc = subprocess.Popen(cli(tiny_model, train_file, out), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    into_step_after(proc, out, 2)
    os.kill(sampler_of(proc.pid), signal.SIGKILL)
    err = [line for line in proc.communicate(timeout=300)[1].strip().splitlines()
           if "NUMA" not in line]  # on CPU torch prints one NUMA line when vLLM binds memory
    assert proc.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("remix: error: the sampler process (--overlap) died (killed by signal 9) while "), err
    assert err[0].endswith(f"the last checkpoint is {out / 'checkpoint-2'}; continue with --resume {out}"), err

    proc = subprocess.Popen([sys.executable, str(ROOT / "remix.py"), "--resume", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    into_step_after(proc, out, 4)
    sampler = sampler_of(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while os.path.exists(f"/proc/{sampler}") and "zombie" not in Path(f"/proc/{sampler}/status").read_text():
        assert time.time() < deadline, "the sampler outlived its trainer"
        time.sleep(0.1)
    assert not (out / "checkpoint-6").exists(), "the run finished before it was killed"

    done = subprocess.run([sys.executable, str(ROOT / "remix.py"), "--resume", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, straight = read_metrics(out), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["batch/staleness"] for r in resumed] == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # drained at T = 5
    assert [comparable(r) for r in straight] == [{k: v for k, v in r.items() if not k.startswith("perf/")}
                                                 for r in resumed]


@pytest.mark.slow
def test_a_sampler_that_never_runs_ahead_is_the_synchronous_run(tiny_model, train_file, tmp_path):
    """T = 0 drains from the start: every batch is drawn at its own step, by the sampler process's engine, with mu
    from its copy; the run, its evaluations included, is the one vLLM in the trainer's process gives."""
    runs = {}
    for overlap in (False, True):
        out = tmp_path / f"overlap-{overlap}"
        remix.train(tiny_args(tiny_model, train_file, out, sampler="vllm", overlap=overlap, reincarnate_step=0,
                              eval_every=2, eval_limit=2, eval_benchmarks=("math500", "amc23")))
        runs[overlap] = read_metrics(out)
    assert [r["step"] for r in runs[True]] == [0, 1, 2, 3] and runs[True][1]["batch/staleness"] == 0.0
    same_run(runs[False], runs[True])  # the engine's own log-probs: on the sampler's one thread


def same_run(sync: list[dict], overlapped: list[dict]):
    """Row by row, the metrics (but wall-clock) to comparable()'s tolerance, and the engine's own log-probs against
    mu (mismatch/*) to 1e-6."""
    from tests.test_runs import comparable

    assert len(sync) == len(overlapped)
    for want, got in zip(sync, overlapped):
        want, got = ({k: v for k, v in row.items() if not k.startswith("perf/")} for row in (want, got))
        for key in [k for k in want if k.startswith("mismatch/")]:
            assert got.pop(key) == pytest.approx(want.pop(key), abs=1e-6), key
        assert comparable(want) == got


@pytest.mark.long
@pytest.mark.slow
def test_under_torchrun_a_sampler_that_never_runs_ahead_is_the_synchronous_run(tiny_model, train_file, tmp_path):
    """Two trainer processes, T = 0: rank 0 feeds the sampler process every rank's prompts and every rank trains on its
    own share of the batch, evaluations included; the run is the synchronous one, where each rank's engine drew its
    share and mu came from the sharded policy: each rank's prompts and responses, token for token (the tiny model's
    near-uniform log-probs hardly tell one pairing from another), and the floats to comparable()'s tolerance (the
    sharded forward and the copy's sum in another order; vLLM's own log-probs against mu, mismatch/*, to 1e-6)."""
    from tests.test_runs import torchrun

    runs, batches = {}, {}
    for overlap in (False, True):
        out = tmp_path / f"run{int(overlap)}"
        flags = [f for f in cli(tiny_model, train_file, out)[2:] if overlap or f != "--overlap"]
        flags += ["--steps", "3", "--reincarnate-step", "0", "--eval-every", "2", "--eval-limit", "3",
                  "--eval-benchmarks", "math500", "amc23"]
        done = torchrun(str(ROOT / "tests" / "test_runs.py"), "batches", str(tmp_path), *flags)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[overlap] = read_metrics(out)
        batches[overlap] = [torch.load(tmp_path / f"batches-rank{r}.pt") for r in (0, 1)]
    assert [r["step"] for r in runs[True]] == [0, 1, 2, 3] and runs[True][1]["batch/fresh"] == 10
    assert batches[False] == batches[True] and batches[True][0] != batches[True][1]  # each rank its own share
    same_run(runs[False], runs[True])


@pytest.mark.long
@pytest.mark.slow
def test_under_torchrun_a_kill_of_the_sampler_or_a_rank_loses_nothing(tiny_model, train_file, tmp_path):
    """Two trainer processes and the sampler (rank 0's child): a kill -9 of the sampler in step 3 stops every rank with
    one line, rank 0's, naming the checkpoint; resumed, a kill -9 of rank 1 in step 5 ends the job and the sampler with
    it; resumed again, the run ends as the uninterrupted one, drawn ahead from step 2 on."""
    from tests.test_runs import comparable, torchrun, worker_pids

    def started(*argv):
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(29500 + os.getpid() % 1000), *argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))

    straight = torchrun(*cli(tiny_model, train_file, tmp_path / "straight")[1:])
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    proc = started(*cli(tiny_model, train_file, out)[1:])
    into_step_after(proc, out, 2)
    os.kill(sampler_of(worker_pids(proc.pid)[0]), signal.SIGKILL)
    errors = [line for line in proc.communicate(timeout=300)[1].splitlines() if line.startswith("remix: error")]
    assert proc.returncode != 0 and len(errors) == 1, errors  # rank 0's; rank 1 is stopped before it says its own
    assert errors[0].startswith("remix: error: the sampler process (--overlap) died (killed by signal 9) while "), errors
    assert errors[0].endswith(f"the last checkpoint is {out / 'checkpoint-2'}; continue with --resume {out}"), errors

    proc = started(str(ROOT / "remix.py"), "--resume", str(out))
    into_step_after(proc, out, 4)
    ranks = worker_pids(proc.pid)
    sampler = sampler_of(ranks[0])
    os.kill(ranks[1], signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0 and not (out / "checkpoint-6").exists()
    deadline = time.time() + 30
    while os.path.exists(f"/proc/{sampler}") and "zombie" not in Path(f"/proc/{sampler}/status").read_text():
        assert time.time() < deadline, "the sampler outlived its trainers"
        time.sleep(0.1)
    done = torchrun(str(ROOT / "remix.py"), "--resume", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, expected = read_metrics(out), read_metrics(tmp_path / "straight")
    assert [r["batch/staleness"] for r in resumed] == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # drained at T = 5
    assert [comparable(r) for r in expected] == [{k: v for k, v in r.items() if not k.startswith("perf/")}
                                                 for r in resumed]


@pytest.mark.parametrize("overrides, line", [
    (dict(sampler="hf"), "--overlap needs --sampler vllm (the sampler process's engine)"),
    (dict(vllm_tp=2), "--vllm-tp is the trainers' engines': under --overlap the engine is the sampler's, its tensor "
                      "parallelism --overlap-gpus"),
    (dict(overlap=False, overlap_gpus=2), "--overlap-gpus sets --overlap's sampler: add --overlap")])
def test_an_overlap_that_cannot_run_is_one_line(overrides, line, tiny_model, train_file, tmp_path, capsys):
    args = remix.finalize_args(overlapped_args(tiny_model, train_file, tmp_path / "run", **overrides))
    with pytest.raises(SystemExit) as stopped:
        console.check_args(args, 2)
    assert stopped.value.code == 2 and capsys.readouterr().err == f"remix: error: {line}\n"


def test_the_sampler_takes_the_gpus_after_the_trainers_and_never_one_of_theirs(monkeypatch, capsys):
    """GPU only (its branch run here with torch.cuda's answers set): the trainers have the node's first GPUs, the
    sampler's --overlap-gpus processes the next ones, each its own rank of a rendezvous of their own on this machine;
    a machine with no GPU to spare is refused in one line, the two would share one."""
    from types import SimpleNamespace

    from machinery import engines

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("RANK", "0")  # a trainer's torchrun variables, which the sampler's must replace
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    envs = engines.sampler_envs(SimpleNamespace(overlap_gpus=1))
    assert len(envs) == 1 and envs[0]["CUDA_VISIBLE_DEVICES"] == "1"  # one trainer process on GPU 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(engines.dist, "world", lambda: 2)
    envs = engines.sampler_envs(SimpleNamespace(overlap_gpus=2))
    assert [(e["CUDA_VISIBLE_DEVICES"], e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs] \
        == [("2,3", "0", "0", "2", "127.0.0.1"), ("2,3", "1", "1", "2", "127.0.0.1")]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] != "29500"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in engines.sampler_envs(SimpleNamespace(overlap_gpus=1))] == ["6"]
    with pytest.raises(SystemExit):
        engines.sampler_envs(SimpleNamespace(overlap_gpus=2))
    assert capsys.readouterr().err.startswith("remix: error: --overlap needs 2 GPU(s) for the sampler beside the "
                                              "trainers' 2, and this machine shows 3: the two would share one")


RECEIVER = """import os, signal, sys
from machinery import dist, models
copy = models.pretrained(sys.argv[2], models.compute_dtype("bf16"))
group = dist.side_group(int(sys.argv[1]), 1, 2, 0.5)
for tensor in list(copy.state_dict().values())[:2]:  # two received, as a sampler process receives them
    group.broadcast(tensor, 0).wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("nccl", [False, True])
def test_a_sampler_process_dying_under_the_weights_broadcast_ends_the_sending(nccl, tiny_model):
    """Trainer rank 0 broadcasts the weights a tensor at a time over the group it shares with the sampler's processes;
    one killed after two tensors ends the sending (the run's line is then the sampler's answer's), the trainer waiting
    on no broadcast. On CPUs gloo's broadcast to the dead process fails; NCCL's (GPU only, modelled here on the real
    gloo group: ProcessGroupNCCL's work to a peer gone raises nothing and never completes, its watchdog's timeout
    aside) would be waited on for --dist-timeout without the process's death checked beside it. On gloo the check
    is left out (always alive): gloo's own error must end the sending."""
    import socket
    import threading

    from machinery import dist, engines

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), tiny_model], cwd=ROOT)
    group, sent = dist.side_group(port, 0, 2, 0.5), []

    class Work:  # NCCL's: done when the GPU is, and never for a peer gone
        def __init__(self, work):
            self.work = work

        def is_completed(self):
            return self.work.is_completed() and (not nccl or receiver.poll() is None)

        def wait(self):
            if nccl and receiver.poll() is not None:
                threading.Event().wait()  # forever
            return self.work.wait()

    class Counted:
        def broadcast(self, tensor, root):
            sent.append(tensor.shape)
            return Work(group.broadcast(tensor, root))

    policy, returned = models.pretrained(tiny_model, torch.float32), []
    sending = threading.Thread(daemon=True, target=lambda: returned.append(
        engines.send_weights(Counted(), policy, [torch.bfloat16] * len(policy.state_dict()),
                             (lambda: receiver.poll() is None) if nccl else (lambda: True))))  # gloo: its error
    sending.start()
    sending.join(60)
    assert receiver.wait(60) == -signal.SIGKILL
    assert not sending.is_alive(), "the trainer still waits on a broadcast to a process that is gone"
    assert returned == [None], "the sending raised (its traceback above) instead of ending"
    assert 2 < len(sent) < len(policy.state_dict()), (len(sent), len(policy.state_dict()))


def test_a_sampler_copy_whose_entries_differ_from_the_policy_is_refused_in_one_line(tiny_model, capsys):
    """The broadcast matches the policy's state dict entries with the copy's by place: a copy that orders them
    otherwise, or lacks one, would load wrong weights silently; the check at the sampler's start says where."""
    from machinery import engines

    policy = models.pretrained(tiny_model, torch.float32)
    entries = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in policy.state_dict().items()]
    engines.check_entries(policy, entries)  # the same: nothing said
    assert capsys.readouterr().err == ""
    for copy, at, its in [([entries[1], entries[0], *entries[2:]], 0, str([entries[1][:2]])),
                          (entries[:-1], len(entries) - 1, "end")]:
        with pytest.raises(SystemExit):
            engines.check_entries(policy, copy)
        assert capsys.readouterr().err == (
            f"remix: error: the sampler's copy of the policy differs from the trainer's at state dict entry {at} (its "
            f"{its}, the trainer's {[entries[at][:2]]}): the weights' broadcast matches the entries by place; run "
            "without --overlap\n")
