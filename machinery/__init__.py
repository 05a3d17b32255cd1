"""The machinery remix.py runs on. A reader of the method may skip all of it: remix.py names the module at every
call (`dist.all_reduce(...)`, `engines.push_weights(...)`), and nothing here changes what the method computes.

    dist         several processes: the process group, reductions, FSDP2 sharding, mini- and micro-batches over ranks
    models       loading the policy, reference and critic; precision; the chunked output layer; collation
    engines      the samplers: the vLLM engine (start, generate, weight push, sleep) and transformers' generate
    grader       worker processes with a hard deadline per task (math-verify can hang inside C code)
    data         training problems from files or the hub, checked row by row; the prompt stream
    run          a program's entry and the Session that ties the modules below to train()
    flags        each numeric flag's range (both bounds) from its docstring; impossible combinations; model path, hub
    plan         before step 1: the disk and memory a run will take, from the model's config; one line if it cannot fit
    runfolder    where a run may write, its lock, refusing to clobber a run; every write, never through a link
    logs         metrics.jsonl, completions.jsonl, TensorBoard and wandb, trimmed on resume
    metrics      the step's record, combined over the ranks from what the method hands over
    guard        a non-finite loss or gradient skips the update; three in a row stop the run
    signals      Ctrl-C, SIGTERM and SIGHUP end a program with one line that says what is kept
    messages     one clear line: fail (exit 2) and say, from the first process only
    checkpoints  checkpoints written atomically, rotated (older ones reduced to model folders), read back for a resume
    safeload     files from a folder a user points at, read without running anything they hold; model folders checked
    inputs       what a resume reads again from outside --out (base model, dataset, benchmarks): moved, and the same
    statecheck   what a checkpoint's trainer state and optimizer shards must hold before a resume uses them
    evaluation   Pass@1 on the benchmarks, for eval.py and for evaluation during training
    progress     progress on long waits: an evaluation's done/total, tokens/s and time left; each step's line
    deepscaler   DeepScaleR's answer rules (the grader behind the paper's numbers), for eval.py --grader deepscaler
    notation     answers rewritten into notation math-verify reads (1.39e9, x', \\dfrac, ...) before it parses them
    curves       the pictures of eval.py --curves: Pass@1 against rollouts and tokens, length and reflection
    startup      the first lines a program runs: Ctrl-C while torch imports ends in one line
"""
