"""Model, tokenizer and checkpoint folders a user points at: none can make remix.py or eval.py run its code, whatever
stdin holds (every loader is found in the source and must pass trust_remote_code=False); a folder whose weights,
config and tokenizer do not fit together is one line and exit 2 before anything is written; a resume whose base
model or dataset moved takes the new place (checked to be the same) and continues exactly.

    pytest -q tests/test_model_folders.py
"""

import ast
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from torch._inductor.exc import InductorError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import remix  # noqa: E402
from machinery import checkpoints, console, data, engines, models  # noqa: E402
from tests.common import (ROOT, one_error_line, read_metrics, refused_in_one_line, run_remix, tiny_cli,  # noqa: E402
                          unlock)


# ----------------------------------------------------------------------------------------------
# Every loader, found in the source, passes trust_remote_code=False (and loads no pickle)
# ----------------------------------------------------------------------------------------------
SOURCES = ["remix.py", "eval.py", "deepscaler.py",
           *sorted(f"machinery/{p.name}" for p in (ROOT / "machinery").glob("*.py")),
           *sorted(f"toy/{p.name}" for p in (ROOT / "toy").glob("*.py")),
           *sorted(f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py"))]
USER_FACING = ("remix.py", "eval.py", "deepscaler.py", "machinery/")  # load what a user points at: safetensors only
LOADERS = ("from_pretrained", "from_config", "LLM")  # and every name starting Auto


def loader_calls(path: str):
    """(line, what, keywords) of every call that loads a model, config or tokenizer: X.from_pretrained(...),
    X.from_config(...), AutoAnything(...) and vLLM's LLM(...); what is 'X.from_pretrained' (or the called name).
    keywords maps each keyword to its constant value; a **NAME spread is that dict of machinery.models (NO_CODE)."""
    def name_of(node):
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")

    for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
        if not isinstance(node, ast.Call):
            continue
        name = name_of(node.func)
        if name in LOADERS or name.startswith("Auto"):
            keywords = {}
            for kw in node.keywords:
                if kw.arg is None:  # **spread
                    keywords.update(getattr(models, name_of(kw.value), {}))
                elif isinstance(kw.value, ast.Constant):
                    keywords[kw.arg] = kw.value.value
            yield node.lineno, f"{name_of(node.func.value)}.{name}" if name.startswith("from_") else name, keywords


def loader_tokens(path: str) -> list[int]:
    """The lines of every loader name written right before '(' in the code itself (comments and strings, the
    docstrings too, are no code): what loader_calls must find, counted by the tokenizer instead of the parser."""
    import io
    import tokenize

    tokens = [t for t in tokenize.generate_tokens(io.StringIO((ROOT / path).read_text()).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    return sorted(t.start[0] for before, t, after in zip([None, *tokens], tokens, tokens[1:])
                  if t.type == tokenize.NAME and after.string == "(" and (t.string in LOADERS or t.string.startswith(
                      "Auto")) and getattr(before, "string", None) not in ("def", "class"))


def test_every_model_config_and_tokenizer_load_refuses_a_folders_code():
    calls = [(path, *call) for path in SOURCES for call in loader_calls(path)]
    for path in SOURCES:  # the finder finds every call the source holds
        assert sorted(line for p, line, _, _ in calls if p == path) == loader_tokens(path), path
    found = {(path, what) for path, _, what, _ in calls}
    assert {("machinery/models.py", "cls.from_pretrained"), ("machinery/data.py", "AutoTokenizer.from_pretrained"),
            ("machinery/data.py", "AutoConfig.from_pretrained"), ("machinery/engines.py", "LLM"),
            ("machinery/models.py", "AutoConfig.from_pretrained")} <= found, found  # models.meta_model, load_tokenizer
    assert models.NO_CODE == {"trust_remote_code": False, "use_safetensors": True}
    for path, line, what, keywords in calls:
        assert keywords.get("trust_remote_code") is False, f"{path}:{line} {what} lacks trust_remote_code=False"
        if path.startswith(USER_FACING) and what == "LLM":
            assert keywords.get("load_format") == "safetensors", f"{path}:{line} vLLM may load a pickled .bin"
        elif path.startswith(USER_FACING) and what.endswith(".from_pretrained") and \
                not what.startswith(("AutoConfig.", "AutoTokenizer.")):  # weights (models.pretrained's cls.)
            assert keywords.get("use_safetensors") is True, f"{path}:{line} {what} may load a pickled .bin"


# ----------------------------------------------------------------------------------------------
# A folder whose config asks for its own code: never run, whatever stdin says
# ----------------------------------------------------------------------------------------------
PROMPT = "Do you wish to run the custom code"
CUSTOM_CODE = "contains custom code which must be executed"  # transformers, where only the folder's code would load it


def plant_code(folder: Path, where: str, marker: Path, kind: str = "unknown"):
    """evil.py beside the model, which writes marker when imported, and an auto_map naming it in config.json or in
    tokenizer_config.json: what transformers imports where it may run a folder's code. unknown: with a model_type
    transformers does not know (config.json) or a tokenizer_class it has not (tokenizer_config.json), so that only
    the folder's code could load it; known: the folder's own type kept, which transformers' own class loads."""
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import PretrainedConfig, PreTrainedModel\n"
                                    "from transformers import PreTrainedTokenizerFast\n"
                                    "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
                                    "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
                                    "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    path = folder / where
    content = json.loads(path.read_text())
    if where.endswith("tokenizer_config.json"):
        content.update(auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
        if kind == "unknown":
            content.update(tokenizer_class="EvilTokenizer")
    else:
        content.update(auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                                 "AutoModelForTokenClassification": "evil.EvilModel"})
        if kind == "unknown":
            content.update(model_type="evil")
    path.write_text(json.dumps(content))


def run_saying_yes(argv, tmp_path, program):
    """The program with 'y' on every line of stdin, transformers' module cache inside tmp_path."""
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, str(ROOT / program), *argv], input="y\n" * 100, capture_output=True,
                          text=True, timeout=300, env=env)


def never_ran(done, marker: Path, tmp_path: Path):
    """The folder's module was never imported, never asked about, never even copied where transformers imports a
    folder's code from."""
    assert not marker.exists(), "the folder's code ran"
    assert PROMPT not in done.stdout + done.stderr
    assert not list((tmp_path / "modules").rglob("evil*")), list((tmp_path / "modules").rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("program", ["remix.py", pytest.param("eval.py", marks=pytest.mark.long)])
@pytest.mark.parametrize("where", ["config.json", pytest.param("tokenizer_config.json", marks=pytest.mark.long)])
@pytest.mark.parametrize("kind", ["unknown", "known"])
def test_a_model_folder_asking_to_run_its_code_never_runs_it_whatever_stdin_says(kind, where, program, tiny_model,
                                                                                 train_file, tmp_path):
    """Only where the model's type is one transformers has no class for is the folder refused (transformers' own
    word, in one line, nothing written); otherwise transformers' own class loads it, and the program does its work."""
    model, out, marker = tmp_path / "model", tmp_path / "out", tmp_path / "RAN"
    shutil.copytree(tiny_model, model)
    plant_code(model, where, marker, kind)
    argv = tiny_cli(str(model), train_file, out, "--steps", "1") if program == "remix.py" else \
        ["--model", str(model), "--out", str(out), "--limit", "1", "--sampler", "hf", "--benchmarks", "aime24",
         "--max-tokens", "8"]
    done = run_saying_yes(argv, tmp_path, program)
    never_ran(done, marker, tmp_path)
    if kind == "unknown" and where == "config.json":
        line = one_error_line(done, CUSTOM_CODE, prog=program.removesuffix(".py"))
        assert f"cannot load model {str(model)!r}" in line, line
        assert not out.exists()
    elif program == "remix.py":
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in read_metrics(out)] == [1]
    else:
        assert done.returncode == 0, done.stderr[-3000:]
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert [s["benchmark"] for s in samples] == ["aime24"]


@pytest.fixture(scope="module")
def two_steps(tiny_model, train_file, tmp_path_factory):
    """A two-step PPO run with a checkpoint after each (a policy, a critic, a tokenizer in each)."""
    from tests.common import two_step_ppo_run

    return two_step_ppo_run(tiny_model, train_file, tmp_path_factory.mktemp("two"), keep_last=2)


def rewrite_manifest(folder: Path):
    """The checkpoint's manifest.json rewritten to match the folder as it is now, as whoever edited it could."""
    import hashlib

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"] = {str(p.relative_to(folder)): {"size": p.stat().st_size,
                                                      "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in sorted(folder.rglob("*")) if p.is_file() and p != path}
    path.write_text(json.dumps(manifest))


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("manifest", ["as-saved", "rewritten-to-match"])
@pytest.mark.parametrize("where", ["checkpoint-2/config.json", "checkpoint-2/tokenizer_config.json",
                                   "checkpoint-2/critic/config.json"])
def test_a_checkpoint_edited_to_run_its_code_never_runs_it_on_resume(where, manifest, two_steps, tiny_model,
                                                                     tmp_path):
    """Its manifest's digests name the edit, and the run is left as it was (no earlier checkpoint holds a training
    state). With the manifest rewritten to match, the code is still never run: a type only the code could load, in
    the policy's config.json (the base model given the same edit and its new place, so that the two configs agree)
    or the critic's, is the loader's refusal (transformers' word, one line, nothing written); a tokenizer class it
    has not is loaded by its own."""
    out, marker, base = tmp_path / "run", tmp_path / "RAN", tmp_path / "base"
    shutil.copytree(two_steps, out)
    checkpoint, folder = out / "checkpoint-2", (out / where).parent
    plant_code(folder, Path(where).name, marker)
    argv = ["--resume", str(out), "--steps", "3"]
    if manifest == "rewritten-to-match":
        rewrite_manifest(checkpoint)
        assert checkpoints.verify(str(checkpoint)) is None
    if manifest == "rewritten-to-match" and where == "checkpoint-2/config.json":
        shutil.copytree(tiny_model, base)
        plant_code(base, "config.json", marker)
        argv += ["--model", str(base)]
    before = snapshot(out)
    done = run_saying_yes(argv, tmp_path, "remix.py")
    never_ran(done, marker, tmp_path)
    edit = f"{out / where} differs from what was saved (its size or SHA-256 against manifest.json): damaged or edited"
    if manifest == "as-saved":
        line = one_error_line(done, "no earlier checkpoint holds a training state")
        assert edit in line or f"{folder / 'evil.py'} is not one of the files the checkpoint was saved with" in line
        assert snapshot(out) == before
        (folder / "evil.py").unlink()  # the edit alone: named by its digest
        assert checkpoints.verify(str(checkpoint)) == edit
    elif where.endswith("tokenizer_config.json"):
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    else:
        line = one_error_line(done, CUSTOM_CODE)
        assert f"cannot load model {str(folder)!r}" in line, line
        assert snapshot(out) == before


# ----------------------------------------------------------------------------------------------
# Weights, config and tokenizer that do not fit: one line before anything is written
# ----------------------------------------------------------------------------------------------
def edit_json(path: Path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder: Path, change):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


class Payload:
    """A pickle that writes a file when unpickled: a .bin is never unpickled, so it never does."""
    marker = None

    def __reduce__(self):
        return open, (self.marker, "w")


def pickled_only(folder: Path):
    from safetensors.torch import load_file

    Payload.marker = str(folder / "UNPICKLED")
    torch.save({**load_file(folder / "model.safetensors"), "x": Payload()}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def pickled_by_an_index(folder: Path):
    """The weights a pickle that an index names, beside a stray safetensors file: transformers would load the pickle,
    safetensors asked for or not."""
    pickled_only(folder)
    (folder / "unused.safetensors").write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "lm_head.weight": "pytorch_model.bin"}}))


def more_tokens_than_rows(folder: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    tokenizer.add_tokens([f"<extra{i}>" for i in range(5)])  # 264 tokens, 259 rows
    tokenizer.save_pretrained(folder)


DISAGREE = ": the config and weights disagree"
TOKENIZER = "its tokenizer cannot be read (tokenizer.json, tokenizer_config.json) ("
BAD_FOLDERS = {  # what models.check_weights (the safetensors headers) or data.load_tokenizer says
    "intermediate-size": (lambda f: edit_json(f / "config.json", intermediate_size=300),
                          "config.json makes model.layers.0.mlp.down_proj.weight [128, 300], its weights hold "
                          "[128, 256] (and 5 more)" + DISAGREE),  # gate, up and down in each of 2 layers
    "weight-left-out": (lambda f: edit_weights(f, lambda w: w.pop("model.norm.weight")),
                        "its weights lack model.norm.weight (it would start at random)" + DISAGREE),
    "weight-too-many": (lambda f: edit_weights(f, lambda w: w.update({"model.extra.weight": torch.zeros(2)})),
                        "its weights hold model.extra.weight, which the model its config.json describes does not "
                        "have" + DISAGREE),
    "pickle-only": (pickled_only, "holds its weights as pytorch_model.bin, a pickle (loading one can run code), and no "
                                  "*.safetensors: remix never unpickles a model; convert it to safetensors"),
    "pickle-named-by-an-index": (pickled_by_an_index, "its model.safetensors.index.json names pytorch_model.bin, "
                                                      "not a safetensors file; remix reads weights from safetensors"),
    "no-tokenizer": (lambda f: [(f / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json",
                                                                  "chat_template.jinja")],
                     "holds no usable tokenizer (it turns text into no tokens"),
    "more-tokens-than-rows": (more_tokens_than_rows, "tokenizer has 264 tokens and the model's embedding 259 rows"),
    # what transformers itself raises on a folder (a traceback before): one line with its reason
    "one-layer-more-than-the-weights": (lambda f: edit_json(f / "config.json", num_hidden_layers=3),
                                        "(ValueError: `num_hidden_layers` (3) must be equal to the number of "
                                        "`layer_types` (2))"),
    "a-size-of-another-type": (lambda f: edit_json(f / "config.json", hidden_size="128"),
                               "(TypeError: Field 'hidden_size' expected int, got str (value: '128'))"),
    "a-negative-size": (lambda f: edit_json(f / "config.json", intermediate_size=-1),
                        "RuntimeError: Trying to create tensor with negative dimension -1: [-1, 128]"),
    "no-key-value-heads": (lambda f: edit_json(f / "config.json", num_key_value_heads=0),
                           "ZeroDivisionError: integer division or modulo by zero"),
    "tokenizer-json-not-json": (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", '),
                                TOKENIZER + "JSONDecodeError: Expecting property name enclosed in double quotes"),
    "tokenizer-json-of-an-unknown-model": (lambda f: edit_json(f / "tokenizer.json", model={"type": "Nope"}),
                                           TOKENIZER + "Exception: data did not match any variant of untagged enum "
                                                       "ModelUntagged"),
    "a-tokenizer-length-of-another-type": (lambda f: edit_json(f / "tokenizer_config.json", model_max_length="lots"),
                                           TOKENIZER + "TypeError: '>' not supported between instances of 'int' and "
                                                       "'str')"),
    "a-truncated-safetensors-header": (lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:40]),
        "SafetensorError: Error while deserializing header: invalid header length"),
}


@pytest.mark.parametrize("program", ["remix", "eval"])
@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_model_folder_transformers_would_refuse_or_patch_is_one_line_before_anything_is_written(
        case, program, tiny_model, train_file, tmp_path, capsys):
    spoil, message = BAD_FOLDERS[case]
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny_model, model)
    spoil(model)
    line = refused_in_one_line(program, model, train_file, out, capsys)  # no settings.json, no samples.jsonl, no lock
    assert message in line and str(model) in line, line
    assert not (model / "UNPICKLED").exists()


def spoiled(tiny_model, folder: Path, sharded: bool, name: str, shape: list[int] | None) -> Path:
    """A copy of the tiny model (sharded: in several files named by model.safetensors.index.json, as transformers
    saves a large one) whose file holding `name` is rewritten without it (shape None) or with zeros of `shape`."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model, folder)
    if sharded:
        (folder / "model.safetensors").unlink()
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).save_pretrained(folder,
                                                                                              max_shard_size="300KB")
        assert len(list(folder.glob("*.safetensors"))) > 2 and (folder / "model.safetensors.index.json").exists()
    path = next(p for p in folder.glob("*.safetensors") if name in load_file(p))
    weights = load_file(path)
    if shape is None:
        del weights[name]
    else:
        weights[name] = torch.zeros(shape)
    save_file(weights, path, metadata={"format": "pt"})
    return folder


SPOILS = {  # the weight changed, its new shape (None: left out), what transformers' own loading report says of it
    "left-out": ("model.layers.1.mlp.down_proj.weight", None, "missing_keys",
                 "its weights lack model.layers.1.mlp.down_proj.weight (it would start at random)"),
    "another-shape": ("model.norm.weight", [64], "mismatched_keys",
                      "config.json makes model.norm.weight [128], its weights hold [64]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("spoil", list(SPOILS))
def test_eval_with_vllm_refuses_a_model_whose_weights_do_not_fit_its_config_before_writing(spoil, sharded, tiny_model,
                                                                                           tmp_path, capsys,
                                                                                           monkeypatch):
    """vLLM's loader leaves a weight the files lack unset, silently: eval.py's default sampler reads every name and
    shape from the safetensors headers first (models.check_weights), and stops in one line, exit 2, nothing written.
    The weight it names is the one transformers' own loading report names."""
    import eval as eval_cli
    from transformers import AutoModelForCausalLM

    name, shape, report, message = SPOILS[spoil]
    model, out = spoiled(tiny_model, tmp_path / "model", sharded, name, shape), tmp_path / "out"
    with console.quiet(__import__("transformers")):
        info = AutoModelForCausalLM.from_pretrained(model, output_loading_info=True, ignore_mismatched_sizes=True)[1]
    assert [k if isinstance(k, str) else k[0] for k in info[report]] == [name]
    capsys.readouterr()
    monkeypatch.setitem(console._state, "prog", "eval")  # what eval.py's one_line_interrupts("eval") sets
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(eval_cli.EvalArgs(model=str(model), out=str(out), limit=1, max_tokens=8))  # sampler: vllm
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [
        f"eval: error: cannot load model {str(model)!r}: {message}{DISAGREE}; restore config.json and the "
        f"*.safetensors files as they were saved together"], err
    assert not out.exists()


def test_the_weight_check_takes_a_sharded_model_and_a_critic_as_transformers_loads_them(tiny_model, tmp_path, capsys):
    """A model in several files passes whole, its tied output layer absent as transformers saves it; a critic on the
    base model may lack its new head (score.*), a checkpoint's critic may not."""
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).save_pretrained(model, max_shard_size="300KB")
    assert len(list(model.glob("*.safetensors"))) > 2
    capsys.readouterr()
    models.check_weights(str(model))
    models.check_weights(str(model), critic=True, new_head=True)
    with pytest.raises(SystemExit):
        models.check_weights(str(model), critic=True)
    assert capsys.readouterr().err.strip() == (
        f"remix: error: cannot load model {str(model)!r}: its weights lack score.bias (it would start at random) "
        f"(and 1 more){DISAGREE}; restore config.json and the *.safetensors files as they were saved together")


# ----------------------------------------------------------------------------------------------
# An engine that fails to start says what failed, in one line with its fix
# ----------------------------------------------------------------------------------------------
def raised(error: Exception, cause: Exception | None = None) -> Exception:
    """error as vLLM raises it: `raise error from cause`."""
    error.__cause__ = cause
    return error


MEMORY = "less free GPU memory than its share: lower --vllm-gpu-memory-utilization or free the GPU"
KV_CACHE = "no KV cache for one sequence: raise --vllm-gpu-memory-utilization (CPU: VLLM_CPU_KVCACHE_SPACE) or " \
           "lower the lengths"
OOM = "out of memory: lower --vllm-gpu-memory-utilization or the lengths"
COMPILE = "torch.compile failed: check the CUDA toolkit and triton here"
NCCL = "NCCL failed: check the NCCL_* variables (NCCL_DEBUG=INFO says why) and each rank's GPU"
HF = ", or use --sampler hf"
FREE = ("Free memory on device cuda:0 (20.5/79.1 GiB) on startup is less than desired GPU memory utilization (0.35, "
        "27.68 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
GPU_FAILURES = {  # what vLLM 0.33's start raises on a GPU (its messages, copied from its sources) -> what remix says
    "free-memory": (raised(ValueError(FREE)), f"{MEMORY}{HF} (ValueError: {FREE})"),
    "no-cache-blocks": (raised(ValueError(
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
        "engine (this flag also controls CPU memory reservation on the CPU backend, despite its name).")),
        f"{KV_CACHE}{HF} (ValueError: No available memory for the cache blocks. Try increasing "
        f"`gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory reservation on the "
        f"CPU backend, despite its name).)"),
    "oom-loading": (raised(torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total capacity of 79.10 GiB of which 512.00 MiB "
        "is free.")), f"{OOM}{HF} (OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total "
        f"capacity of 79.10 GiB of which 512.00 MiB is free.)"),
    "oom-warming-up-the-sampler": (raised(RuntimeError(
        "CUDA out of memory occurred when warming up sampler with 256 dummy requests. Please try lowering "
        "`max_num_seqs` or `gpu_memory_utilization` when initializing the engine."), RuntimeError(
        "CUDA error: out of memory")), f"{OOM}{HF} (RuntimeError: CUDA error: out of memory)"),
    "inductor": (raised(InductorError(RuntimeError("C++ compile error"), None)),
                 f"{COMPILE}{HF} (InductorError: RuntimeError: C++ compile error)"),
    "pynccl": (raised(RuntimeError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)")),
               f"{NCCL}{HF} (RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details))"),
    "torch-nccl": (raised(torch.distributed.DistBackendError(
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled system error")),
        f"{NCCL}{HF} (DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, unhandled "
        f"system error)"),
}


def engine_start_line(model: Path, max_model_len: int, capsys, **changes) -> str:
    """The one line engines.start stops with on the model (its config.json changed, if changes are given)."""
    if changes:
        edit_json(model / "config.json", **changes)
    args = console.settings(remix.Args, model=str(model), dataset="unused", out=str(model.parent / "out"),
                            precision="fp32")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        engines.start(args, max_model_len=max_model_len)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GPU_FAILURES))
def test_an_engine_that_fails_to_start_on_a_gpu_says_what_failed_and_the_fix(case, tiny_model, tmp_path, monkeypatch,
                                                                           capsys):
    """vLLM's LLM stood in for by one that raises what it raises on a GPU only (the tiny model's check passes)."""
    error, said = GPU_FAILURES[case]

    def gpu_engine(**settings):
        raise error
    monkeypatch.setattr(engines, "vllm_llm_class", lambda: gpu_engine)
    assert engine_start_line(Path(tiny_model), 64, capsys) == f"remix: error: the vLLM engine could not start: {said}"


@pytest.mark.slow
def test_an_engine_that_fails_to_start_on_the_cpu_says_what_failed_in_one_line(tiny_model, tmp_path, capsys):
    """vLLM's real failures: a KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB) too small for one sequence of 2^21 tokens
    (fp32, 2 layers, 2 KV heads of 32: 1 KiB a token, 2 GiB) is memory; a config whose architecture vLLM has no class
    for (transformers builds it by its model_type) is still the model."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    assert engine_start_line(model, 2**21, capsys, max_position_embeddings=2**21).startswith(
        f"remix: error: the vLLM engine could not start: {KV_CACHE}{HF} (ValueError: To serve at least one request "
        f"with the model's max seq len (2097152), (2.0 GiB KV cache is needed, which is larger than the available KV "
        f"cache memory (1.0 GiB).")
    assert engine_start_line(model, 64, capsys, architectures=["NoSuchForCausalLM"]) == (
        f"remix: error: cannot load model {str(model)!r}: ValidationError: 1 validation error for ModelConfig")


def cached_hub_model(tiny_model, cache: Path, repo: str) -> Path:
    """The tiny model as the hub's client caches a download of `repo` (models--ORG--NAME/refs/main naming a snapshot
    folder), its weights a pickle only."""
    revision = "0" * 40
    folder = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(tiny_model, folder / "snapshots" / revision)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    pickled_only(folder / "snapshots" / revision)
    return folder / "snapshots" / revision


@pytest.mark.parametrize("program", ["remix", "eval"])
@pytest.mark.parametrize("hub", ["offline-cache", "online"])
def test_a_hub_model_with_pickled_weights_only_is_one_line_before_anything_is_written(
        hub, program, tiny_model, train_file, tmp_path, capsys, monkeypatch):
    """A hub id whose weights are pytorch_model.bin alone: under HF_HUB_OFFLINE=1 from the local cache a load would
    read (eval.py ended in vLLM's "Cannot find any model weights" traceback, or transformers' with --sampler hf), and
    online from the hub's listing of the model's files (a local server answering the hub client's model-info
    request, as the hub does)."""
    import http.server
    import threading

    import huggingface_hub

    repo = "someorg/pickles-only"
    snapshot = cached_hub_model(tiny_model, tmp_path / "hub", repo)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    if hub == "online":
        listing = json.dumps({"id": repo, "siblings": [{"rfilename": p.name} for p in snapshot.iterdir()]}).encode()

        class Hub(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                found = self.path.split("?")[0] == f"/api/models/{repo}"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(listing if found else b"{}")

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    try:
        line = refused_in_one_line(program, repo, train_file, tmp_path / "out", capsys)
    finally:
        if hub == "online":
            server.shutdown()
    assert f"hub model {repo!r} holds its weights as pytorch_model.bin, a pickle" in line, line
    assert not (snapshot / "UNPICKLED").exists()


def test_a_vocabulary_padded_past_the_tokenizer_loads(tiny_model, tmp_path):
    """Fewer tokens than embedding rows, as Qwen pads its vocabulary to a multiple of 64: the tokenizer and the
    weights are accepted as they are (data.load_tokenizer and models.pretrained, as remix.py and eval.py load them;
    the padded rows kept)."""
    from safetensors import safe_open
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = Qwen2Config.from_pretrained(model)
    config.vocab_size = 320
    Qwen2ForCausalLM(config).save_pretrained(model)
    with safe_open(str(model / "model.safetensors"), "pt") as f:  # what the folder holds, read by safetensors itself
        rows = f.get_slice("model.embed_tokens.weight").get_shape()
    assert rows == [320, 128]
    tokenizer = data.load_tokenizer(str(model))
    assert len(tokenizer) == 259
    loaded = models.pretrained(str(model), torch.float32)
    assert list(loaded.get_input_embeddings().weight.shape) == rows and loaded.config.vocab_size == 320


# ----------------------------------------------------------------------------------------------
# A resume whose base model and dataset moved
# ----------------------------------------------------------------------------------------------
def snapshot(out: Path) -> dict:
    """Every file of a run folder and its bytes, but the lock (which names the job that last held it)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
            and p.name != ".remix.lock"}


def resume_refused(capsys, out: Path, message: str, **given):
    before = snapshot(out)
    try:
        with pytest.raises(SystemExit) as exit_info:
            remix.train(console.settings(remix.Args, resume=str(out), **given))
    finally:
        unlock()  # the folder is locked by this process until it ends; the resume after is another
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert snapshot(out) == before
    return err[0]


@pytest.mark.long
@pytest.mark.slow
def test_a_resume_takes_the_new_place_of_a_moved_model_and_dataset_and_continues_exactly(tiny_model, train_file,
                                                                                        tmp_path, capsys):
    from tests.test_runs import comparable

    base, data = tmp_path / "base", tmp_path / "train.jsonl"
    shutil.copytree(tiny_model, base)
    shutil.copy(train_file, data)
    straight, out = tmp_path / "straight", tmp_path / "run"
    for folder, steps in ((straight, "4"), (out, "2")):  # GRPO with a KL term: the reference is the base model
        done = run_remix(*tiny_cli(str(base), str(data), folder, "--steps", steps, "--save-every", "2"))
        assert done.returncode == 0, done.stderr[-3000:]
    moved_base, moved_data = tmp_path / "moved" / "base", tmp_path / "moved" / "train.jsonl"
    moved_base.parent.mkdir()
    base.rename(moved_base)
    data.rename(moved_data)
    line = resume_refused(capsys, out, f"the run's model {base} is no longer there; give its new place: "
                                       f"--resume {out} --model NEW_PLACE", steps=4)
    assert "pass an existing local folder" not in line
    resume_refused(capsys, out, f"the run's dataset {data} is no longer there; give its new place: --resume {out} "
                                f"--dataset NEW_PLACE", steps=4, model=str(moved_base))
    other = tmp_path / "other.jsonl"  # the same rows but one
    other.write_text("".join(moved_data.read_text().splitlines(keepends=True)[1:]))
    resume_refused(capsys, out, f"--dataset {other} is not where the run's dataset {data} moved to (its content "
                                f"differs", steps=4, model=str(moved_base), dataset=str(other))
    wider = tmp_path / "wider"  # another model of the same kind
    from tests.tiny_model import build_tiny_model

    build_tiny_model(str(wider), hidden_size=64)
    capsys.readouterr()  # its save's progress bar
    resume_refused(capsys, out, f"--model {wider} is not where the run's model {base} moved to (its config.json differs "
                                f"from checkpoint-2's in hidden_size); give the new place of the same one", steps=4, model=str(wider),
                   dataset=str(moved_data))
    done = run_remix("--resume", str(out), "--steps", "4", "--model", str(moved_base), "--dataset", str(moved_data))
    assert done.returncode == 0 and "ignored" not in done.stdout + done.stderr, done.stderr[-3000:]
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [comparable(r) for r in read_metrics(straight)] == \
        [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in resumed]
    saved = checkpoints.read_pt(str(out / "checkpoint-4" / "trainer_state.pt"))["args"]["run"]
    assert (saved["model"], saved["dataset"]) == (str(moved_base), str(moved_data))  # the next resume needs no flag


def test_a_flag_typed_at_its_default_value_on_a_resume_is_named_as_ignored(tmp_path, monkeypatch, capsys):
    saved = dataclasses.asdict(console.settings(remix.Args, steps=2, kl_beta=0.01, out=str(tmp_path)))
    monkeypatch.setattr(sys, "argv", ["remix.py", "--resume", str(tmp_path), "--kl-beta", str(remix.Args.kl_beta),
                                      "--no-reincarnation"])
    resumed = checkpoints.resume_args(console.settings(remix.Args, resume=str(tmp_path), reincarnation=False), saved, 2)
    assert resumed.kl_beta == 0.01 and resumed.reincarnation is True
    out = capsys.readouterr().out
    assert "ignored: --reincarnation, --kl-beta" in out, out
    monkeypatch.setattr(sys, "argv", ["remix.py", "--resume", str(tmp_path), "--kl-beta", "0.01"])  # the saved value
    checkpoints.resume_args(console.settings(remix.Args, resume=str(tmp_path), kl_beta=0.01), saved, 2)
    assert "ignored" not in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# A resume's inputs against what the run recorded: the dataset's and benchmark files' bytes, the base model's weights
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tiny_model, train_file, tmp_path_factory):
    """A one-step GRPO run (its reference: the base model) with a checkpoint and evaluations, its inputs in places of
    its own: the base model, the dataset, a benchmark folder holding aime24.jsonl."""
    from tests.common import BENCH, tiny_args

    root = tmp_path_factory.mktemp("recorded")
    base, data, bench = root / "base", root / "train.jsonl", root / "bench"
    shutil.copytree(tiny_model, base)
    shutil.copy(train_file, data)
    bench.mkdir()
    shutil.copy(BENCH / "aime24.jsonl", bench)
    out = root / "run"
    try:
        remix.train(tiny_args(str(base), str(data), out, steps=1, save_every=1, eval_every=1, eval_limit=1,
                              eval_benchmarks=("aime24",), eval_data_dir=str(bench), algo="grpo", group_size=2,
                              prompts_per_step=4, max_response_tokens=8))
    finally:
        unlock()
    return types.SimpleNamespace(base=base, data=data, bench=bench, out=out)


@contextlib.contextmanager
def edited(path: Path, edit):
    """path's bytes changed by edit(bytes) -> bytes for the block, then put back."""
    original = path.read_bytes()
    try:
        path.write_bytes(edit(original))
        yield
    finally:
        path.write_bytes(original)


def first_answer_changed(raw: bytes) -> bytes:
    """A .jsonl file's first row with another answer: the same rows, one of them other data."""
    lines = raw.decode().splitlines(keepends=True)
    row = json.loads(lines[0])
    return "".join([json.dumps({**row, "answer": f"{row['answer']}0"}) + "\n", *lines[1:]]).encode()


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_a_dataset_edited_in_place_is_named_on_resume_and_goes_on_only_when_asked(recorded, tmp_path, capsys):
    import hashlib

    out = copy_of(recorded.out, tmp_path)
    with edited(recorded.data, first_answer_changed):
        resume_refused(capsys, out, f"--resume {out}: the run's dataset {recorded.data} has changed since it began "
                                    f"(another SHA-256 than it recorded); put back (or give the place of) the data the "
                                    f"run began with, or pass --resume-changed-data", steps=2)
        try:
            remix.train(console.settings(remix.Args, resume=str(out), steps=2, resume_changed_data=True))
        finally:
            unlock()
        assert "going on with it as it is now (--resume-changed-data)" in capsys.readouterr().out
        state = checkpoints.read_pt(str(out / "checkpoint-2" / "trainer_state.pt"))
        assert state["inputs"]["dataset"] == hashlib.sha256(recorded.data.read_bytes()).hexdigest()  # from now on


def test_a_benchmark_file_edited_in_place_is_named_on_resume(recorded, tmp_path, capsys):
    out = copy_of(recorded.out, tmp_path)
    with edited(recorded.bench / "aime24.jsonl", first_answer_changed):
        resume_refused(capsys, out, f"the benchmark file aime24.jsonl in {recorded.bench} has changed since the run "
                                    f"began", steps=2)


def test_the_dataset_is_read_once_and_its_digest_is_of_the_bytes_parsed(tiny_model, train_file, tmp_path, monkeypatch):
    """No window between hashing the dataset and reading it: one open, whose bytes are both hashed and parsed."""
    import builtins
    import hashlib

    from machinery import runner
    from tests.common import tiny_args

    opened, real_open = [], builtins.open

    def spy(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and os.path.abspath(file) == os.path.abspath(train_file):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    try:
        session = runner.Session(tiny_args(tiny_model, train_file, tmp_path / "out"), remix.METHOD)
    finally:
        unlock()
    assert len(opened) == 1, opened
    assert session.inputs["dataset"] == hashlib.sha256(Path(train_file).read_bytes()).hexdigest()


def with_weight_changed(source: Path, folder: Path) -> Path:
    """A copy of a model folder whose final norm's weights are each 1 more: the same config and shapes, other
    weights."""
    shutil.copytree(source, folder)
    edit_weights(folder, lambda w: w["model.norm.weight"].add_(1.0))
    return folder


def test_a_moved_model_with_other_weights_is_refused_on_resume_naming_the_file(recorded, tmp_path, capsys):
    """Checked by config and shapes only, another model of the same shapes, even the run's own checkpoint, was
    accepted as the base model moved."""
    out = copy_of(recorded.out, tmp_path)
    other = with_weight_changed(recorded.base, tmp_path / "other")
    resume_refused(capsys, out, f"--model {other} is not where the run's model {recorded.base} moved to (its "
                                f"model.safetensors differs (another SHA-256))", steps=2, model=str(other))
    own = tmp_path / "own"
    shutil.copytree(out / "checkpoint-1", own, ignore=shutil.ignore_patterns("optim", "trainer_state*.pt"))
    resume_refused(capsys, out, f"--model {own} is not where the run's model {recorded.base} moved to (its "
                                f"model.safetensors differs (another SHA-256))", steps=2, model=str(own))


def test_the_base_model_is_checked_by_its_recorded_digests_moved_or_in_place(recorded, tmp_path, capsys):
    """The same weights moved pass (hashed, since they moved); weights changed in place are refused; a file touched
    but not changed passes (hashed again, since its time changed)."""
    out = copy_of(recorded.out, tmp_path)
    state = checkpoints.read_pt(str(out / "checkpoint-1" / "trainer_state.pt"))
    weights = state["inputs"]["model"]
    assert set(weights["files"]) == {"model.safetensors"} and weights["revision"] is None
    moved = tmp_path / "moved"
    shutil.copytree(recorded.base, moved)
    saved = {**state["args"]["method"], **state["args"]["run"]}
    args = console.settings(remix.Args, **{**saved, "model": str(moved), "resume": str(out)})
    data.check_resumed(args, saved, state["inputs"], str(out / "checkpoint-1"))  # no SystemExit
    weights_file = recorded.base / "model.safetensors"
    os.utime(weights_file)
    assert data.model_changed(str(recorded.base), weights, str(out / "checkpoint-1")) is None
    with edited(weights_file, lambda raw: raw[:-4] + bytes(4)):  # the last weight's last value zeroed
        resume_refused(capsys, out, f"the run's model {recorded.base} is not what the run began with (its "
                                    f"model.safetensors differs (another SHA-256))", steps=2)
    config = recorded.base / "config.json"  # the same weights under another config: the KL reference would differ
    with edited(config, lambda raw: raw.replace(b'"rms_norm_eps": 1e-06', b'"rms_norm_eps": 0.5')):
        assert b'"rms_norm_eps": 0.5' in config.read_bytes()
        resume_refused(capsys, out, f"the run's model {recorded.base} is not what the run began with (its "
                                    f"config.json differs from checkpoint-1's in rms_norm_eps)", steps=2)


def fake_hub_model(cache: Path, repo: str, source: Path, commit: str) -> Path:
    """A hub model in a local cache laid out as huggingface_hub lays it out: each file a link from the snapshot of
    a commit to its blob, named by its SHA-256 (the hub's name for a large file's blob)."""
    import hashlib

    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for path in source.iterdir():
        blob = folder / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_model_is_recorded_by_its_cached_revision_and_blob_digests(tiny_model, tmp_path, monkeypatch):
    """No hashing for a hub model: the commit of its cached snapshot, and each weight file's SHA-256 as its blob's
    name; a newer revision in the cache, or a local copy with other weights, is then named."""
    import hashlib

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    first, second = "a" * 40, "b" * 40
    fake_hub_model(tmp_path / "hub", "org/tiny", Path(tiny_model), first)
    monkeypatch.setattr(data, "file_digest", lambda path: pytest.fail(f"{path} hashed"))
    weights = data.model_record("org/tiny")
    digest = hashlib.sha256((Path(tiny_model) / "model.safetensors").read_bytes()).hexdigest()
    assert weights == {"revision": first, "files": {"model.safetensors": {
        "sha256": digest, "size": (Path(tiny_model) / "model.safetensors").stat().st_size, "mtime_ns": None}}}
    assert data.model_changed("org/tiny", weights, None) is None
    fake_hub_model(tmp_path / "hub", "org/tiny", with_weight_changed(Path(tiny_model), tmp_path / "newer"), second)
    assert data.model_changed("org/tiny", weights, None) == \
        f"the local cache holds its revision {second[:12]}, the run began on {first[:12]}"
    monkeypatch.undo()
    assert data.weights_differ(tiny_model, weights, moved=True) is None  # the same weights, moved to a folder
    assert data.weights_differ(str(tmp_path / "newer"), weights, moved=True) == \
        "its model.safetensors differs (another SHA-256)"


def fake_hub_dataset(cache: Path, repo: str, rows_file: str, commit: str, build: Path):
    """A hub dataset in the datasets library's own cache, as a load of it at `commit` leaves it (the folder of a
    built copy is named by the commit it was built from): built from a local file by the library itself, then
    moved to where a hub copy lives."""
    import datasets

    built = datasets.load_dataset("json", data_files=rows_file, split="train", cache_dir=str(build / commit))
    source = Path(built.cache_files[0]["filename"]).parent
    name = repo.split("/")[1]
    folder = cache / repo.replace("/", "___") / "default" / "0.0.0" / commit
    folder.mkdir(parents=True)
    shutil.copy(source / "json-train.arrow", folder / f"{name}-train.arrow")
    info = json.loads((source / "dataset_info.json").read_text())
    info.update(config_name="default", dataset_name=name)
    info["splits"]["train"]["dataset_name"] = name
    (folder / "dataset_info.json").write_text(json.dumps(info))


def test_a_hub_dataset_is_checked_by_the_revision_it_began_on(tiny_model, train_file, tmp_path, monkeypatch, capsys):
    """The default dataset is a hub id: its revision is recorded, and a resume that would read another one (offline,
    the datasets library loads the newest cached copy) is named in one line."""
    import datasets.config

    from tests.common import tiny_args

    cache, first, second = tmp_path / "datasets", "a" * 40, "b" * 40
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 does in a new process
    fake_hub_dataset(cache, "org/tiny_set", train_file, first, tmp_path / "build")
    out = tmp_path / "run"
    try:
        remix.train(tiny_args(tiny_model, "org/tiny_set", out, steps=1, save_every=1, algo="grpo", group_size=2,
                              prompts_per_step=4, max_response_tokens=8))
    finally:
        unlock()
    state = checkpoints.read_pt(str(out / "checkpoint-1" / "trainer_state.pt"))
    assert (state["inputs"]["dataset"], state["inputs"]["dataset_revision"]) == (None, first)
    edited_rows = tmp_path / "edited.jsonl"
    edited_rows.write_bytes(first_answer_changed(Path(train_file).read_bytes()))
    time.sleep(0.01)  # the newer copy is the one with the later modification time
    fake_hub_dataset(cache, "org/tiny_set", str(edited_rows), second, tmp_path / "build")
    capsys.readouterr()  # the build's progress bars
    resume_refused(capsys, out, f"the run's dataset org/tiny_set is at revision {second[:12]} (as the datasets library "
                                f"loads it here), the run began on {first[:12]}", steps=2)
