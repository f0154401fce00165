#!/usr/bin/env bash
# The main job on its built-in default: set-up, tokenise the shipped corpus, train the tiny-cpu config with
# tensor and pipeline parallelism (TP 2 x PP 2) on 4 CPU processes through the deepspeed launcher, checkpoint,
# draw the schedule the run followed, export the model to Hugging Face and sample from it. A few minutes on a 2-core machine. Extra arguments go to train.py,
# e.g. bash scripts/demo.sh --set schedule.train_tokens=1e5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
RUN=runs/demo
rm -rf "$RUN"  # the demo starts fresh; a real run resumes from its checkpoint directory by itself

echo "== 1. tokenise data/corpus/botchan.jsonl (GPT-2 BPE) into an indexed dataset"
python tools/preprocess_data.py --input data/corpus/botchan.jsonl --output-prefix "$RUN/data/botchan" \
    --append-eod --workers 2

echo "== 2. train tiny-cpu: TP 2 x PP 2 on 4 processes, warmup + batch ramp + cosine"
deepspeed --num_gpus 4 train.py --ds_config ds_configs/tiny-cpu.json "$@"

echo "== 3. the schedule the run followed"
python tools/plot_schedule.py --ds_config ds_configs/tiny-cpu.json --metrics "$RUN/checkpoints/metrics.jsonl" \
    --output "$RUN/schedule.png"
echo "checkpoint: $RUN/checkpoints/$(cat $RUN/checkpoints/latest)   metrics: $RUN/checkpoints/metrics.jsonl"

echo "== 4. export to a Hugging Face GPT2LMHeadModel and sample from it with transformers"
python tools/convert_to_hf.py --checkpoint "$RUN/checkpoints" --output "$RUN/hf"
python tools/generate_hf.py --model "$RUN/hf" --prompt "I was" --max-new-tokens 40
