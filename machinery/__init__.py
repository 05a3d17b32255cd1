"""The machinery remix.py runs on: one module per job, listed below from the program's entry down.

A reader of the method may skip it: remix.py names the module at every call (`dist.all_reduce(...)`,
`engines.push_weights(...)`), and every equation of the paper is in remix.py. What this package computes for the
method reaches its numbers only through calls remix.py names: grader.rewrite decides which answers the reward counts as
right (remix.parse_boxed passes every answer through it), models.chunked_logprobs computes the log-probabilities
through the output layer in chunks (the same values and gradients as one pass: test_remix.py), models.finite_update
skips an update whose loss or gradient is not finite, dist sums over the ranks what remix.py hands it, the engines
draw the responses with the seeds and settings remix.py passes, and session.next_prompts (runner's stream) hands it
its prompts. Each module imports only modules listed below it, at its top or inside a function, and none imports remix
(tests/test_machinery.py reads the whole graph).

    runner       a program's entry (main, cli) and the Session that carries a training run's schedule
    overlap      --overlap's sampler: a process of its own drawing step k+1's batch while step k trains
    report       Pass@1 on the benchmarks (eval.py's and training's), and a run's logs and metrics
    plan         before step 1: the disk and memory a run will take, and the flags that make one fit that does not
    checkpoints  checkpoints written with a manifest of digests, rotated, read back for a resume
    engines      the samplers: vLLM (start, generate, sleep, weight push), transformers' generate, over the ranks
    models       loading the models (weights checked), precision, the chunked output layer, collation, the guard
    data         what a run reads from outside --out: dataset, tokenizer (template guarded), model source; recorded
    runfolder    the run folder's lock, where a job may write, and every write under --out, never through a link
    grader       the answer check: answers rewritten into notation math-verify reads; workers with a deadline
    dist         several processes: the process group, reductions, FSDP2 sharding, mini- and micro-batches
    console      the command line and the terminal: settings and their checks, messages, progress, signals
"""
