"""The machinery remix.py runs on: one module per job, listed below from the program's entry down.

A reader of the method may skip it: remix.py names the module at every call (`dist.all_reduce(...)`,
`engines.push_weights(...)`). Every equation of the paper is in remix.py. What this package computes for the method
reaches its numbers only through calls remix.py names: grader.rewrite decides which answers the reward counts as
right (remix.parse_boxed passes every gold and predicted answer through it), models.chunked_logprobs computes the
log-probabilities through the output layer in chunks (the same values and gradients as one pass: test_remix.py),
models.finite_update skips an update whose loss or gradient is not finite, dist sums over the ranks what remix.py
hands it, the engines draw the responses with the seeds and settings remix.py passes, and session.next_prompts
(data's stream) hands it its prompts. Each module imports, at its top, only modules listed below it, and none imports remix
(tests/test_machinery.py; four imports inside functions point up, each named there with its reason).

    runner       a program's entry (main, cli) and the Session that ties a run's parts to remix.train()
    plan         before step 1: the disk and memory a run will take, from the model's config; one line if it cannot fit
    advice       the flags under which a run that does not fit would, each judged by the plan's own arithmetic
    checkpoints  checkpoints written atomically, rotated (older ones reduced to model folders), read back for a resume
    paths        what a run reads from outside --out (moved, and the same on a resume) and where it writes under it
    logs         metrics.jsonl and the step's record over the ranks, completions, TensorBoard, wandb; eval.py --curves
    evaluation   Pass@1 on the benchmarks, for eval.py and for the evaluation during training
    deepscaler   DeepScaleR's answer rules (the grader behind the paper's numbers), for eval.py --grader deepscaler
    grader       the answer check: answers rewritten into notation math-verify reads; workers with a deadline per task
    engines      the samplers: vLLM (start, generate, sleep, weight push), transformers' generate, their KV cache
    models       loading the models, precision, the chunked output layer, collation, the optimizer, the finite guard
    data         training problems from files or the hub, checked row by row; the prompt stream
    flags        the run's settings (RunArgs, beside remix.Args); each numeric flag's range; impossible combinations
    safeload     model, tokenizer and checkpoint files read without running anything they hold, and checked
    runfolder    the run folder's lock, refusing to clobber a run; every write under --out, never through a link
    dist         several processes: the process group, reductions, FSDP2 sharding, mini- and micro-batches over ranks
    console      what a program prints (fail: exit 2, say, progress) and how it ends on Ctrl-C, SIGTERM or SIGHUP
"""
