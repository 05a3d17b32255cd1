#!/usr/bin/env bash
# The README's CPU quick start in one command, about two minutes on 2 cores: a tiny random model built offline,
# trained 4 steps (GRPO, evaluated at steps 0, 2 and 4), evaluated by eval.py, its curves drawn; then the files
# listed. Its Pass@1 and rewards are 0 by design (a random model); toy/ holds a CPU run whose numbers rise.
#     bash quickstart.sh [FOLDER]      (default runs/quickstart, under this repository; replaced if there)
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-runs/quickstart}
python tests/tiny_model.py "$out/tiny-qwen2"
python remix.py --model "$out/tiny-qwen2" --dataset data/train/deepscaler_partial.jsonl --algo grpo --steps 4 \
    --prompts-per-step 8 --group-size 4 --max-response-tokens 64 --eval-every 2 --eval-limit 5 --out "$out/run" \
    --overwrite
python eval.py --model "$out/run/checkpoint-4" --limit 5 --max-tokens 64 --out "$out/eval" --overwrite
python eval.py --curves "$out/run" --out "$out/curves"
echo "quickstart: wrote (what each file is: docs/running.md#what-a-run-writes)"
find "$out/run" "$out/eval" "$out/curves" -maxdepth 1 -mindepth 1 | sort | sed 's/^/    /'
