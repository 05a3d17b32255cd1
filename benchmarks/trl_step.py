"""One side of toy/toy.py's step-time comparison: a few GRPO steps of remix.py or of TRL's GRPOTrainer on the
toy base model, same batch (16 prompts x 8 completions, 2 optimizer steps of 64) and lengths, both with the
transformers sampler and math-verify grading in a worker process. Prints a JSON list of seconds per
rollout batch (the first, warm-up batch left out).

    python benchmarks/trl_step.py remix|trl TOY_CACHE STEPS
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import remix  # noqa: E402
from machinery import console, report  # noqa: E402

PROMPTS, GROUP, MAX_TOKENS, LR = 16, 8, 48, 1e-4  # the toy's batch shape and response limit


def main():
    which, toy, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    out = Path(tempfile.mkdtemp(prefix=f"remix-trl-step-{which}-"))
    if which == "remix":
        args = console.settings(remix.Args, algo="grpo", model=str(toy / "base"), dataset=str(toy / "train.jsonl"),
                              out=str(out), steps=steps, prompts_per_step=PROMPTS, group_size=GROUP,
                              mini_batch_prompts=PROMPTS // 2, on_policy=True, max_response_tokens=MAX_TOKENS,
                              actor_lr=LR, sampler="hf", save_every=0, grader_workers=1, max_prompt_tokens=256,
                              eval_every=0)
        remix.train(args)
        seconds = [json.loads(line)["perf/step_s"] for line in open(out / "metrics.jsonl")][1:]
    else:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        rows = [json.loads(line) for line in open(toy / "train.jsonl")]
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["problem"] + remix.Args.prompt_suffix}],
                                   "answer": r["answer"]} for r in rows])

        def reward(completions, answer, **kwargs):
            texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
            return [g[0] for g in report.grade_many(remix.METHOD, list(zip(texts, [[a] for a in answer])), workers=1)]

        marks = []

        class Clock(TrainerCallback):
            def on_step_end(self, *a, **k):
                marks.append(time.perf_counter())

        config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * GROUP // 2,
                            steps_per_generation=2, num_generations=GROUP, max_completion_length=MAX_TOKENS,
                            learning_rate=LR, beta=0.001, temperature=1.0, top_k=0, max_steps=2 * steps,
                            use_vllm=False, report_to="none", save_strategy="no", logging_steps=1000,
                            disable_tqdm=True, use_cpu=True, bf16=False)
        tokenizer = AutoTokenizer.from_pretrained(toy / "base", trust_remote_code=False)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(toy / "base", trust_remote_code=False), reward_funcs=reward,
                              args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
        start = time.perf_counter()
        trainer.train()
        ends = [start] + marks[1::2]  # one rollout batch = two optimizer steps
        seconds = [b - a for a, b in zip(ends, ends[1:])][1:]
    print(json.dumps(seconds))


if __name__ == "__main__":
    main()
