#!/usr/bin/env bash
# Long context with Ulysses context parallelism (parallelism.context_parallel_size): the demo model (tiny-cpu) at 4x
# its sequence length, 256 positions, each sample split over 2 CP ranks (128 positions each outside attention; all
# 256 positions of half the heads inside it), x 2 pipeline stages, on 4 CPU processes; about 1.5 minutes on 2 cores
# after set-up. Extra arguments go to train.py, e.g. bash scripts/long_context_demo.sh --set training.max_steps=40
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
RUN=runs/long-context-demo
rm -rf "$RUN"

echo "== 1. tokenise data/corpus/botchan.jsonl (GPT-2 BPE)"
python tools/preprocess_data.py --input data/corpus/botchan.jsonl --output-prefix "$RUN/data/botchan" \
    --append-eod --workers 2 --no-progress

echo "== 2. train tiny-cpu at 256 positions: PP 2 x CP 2 on 4 processes"
deepspeed --num_gpus 4 train.py --ds_config ds_configs/tiny-cpu.json --data-path "$RUN/data/botchan_text_document" \
    --set model.seq_length=256 --set parallelism.tensor_parallel_size=1 --set parallelism.pipeline_parallel_size=2 \
    --set parallelism.context_parallel_size=2 --set train_batch_size=16 --set schedule.batch={} \
    --set schedule.warmup_tokens=8192 --set schedule.decay_tokens=81920 --set schedule.train_tokens=81920 \
    --set training.max_steps=20 --set training.log_interval=2 --set training.eval_interval=0 \
    --set training.eval_iters=0 --set training.save="$RUN/checkpoints" --set training.save_interval=0 "$@"
