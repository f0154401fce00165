#!/usr/bin/env bash
# Supervised fine-tuning on the shipped chat set: tokenise data/corpus/chat_demo.jsonl with GPT-2's BPE and the
# qwen-style template in data/chat_templates/ (tokens + loss mask: the assistant replies and their end-of-turn are
# the targets), then train the tiny-cpu model on it (PP 2, 2 CPU processes) with the loss divided by the step's
# target tokens (training.loss_normalization "tokens"), print the loss going down and one chat answer
# (tools/generate.py --chat, stopped at the template's end of turn). Extra arguments go to
# train.py, e.g. bash scripts/sft_demo.sh --set training.max_steps=40, or, after bash scripts/demo.sh, start from its
# pretrained model: --set training.init_from=runs/demo/checkpoints --set training.fine_tune=true
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
RUN=runs/sft-demo
rm -rf "$RUN"

echo "== 1. tokenise data/corpus/chat_demo.jsonl: tokens and loss mask"
python tools/preprocess_data.py --input data/corpus/chat_demo.jsonl --output-prefix "$RUN/data/chat_demo" \
    --chat-template data/chat_templates/qwen_style.jinja --append-eod --no-progress

# The tiny model has 64 positions and the conversations 66 to 180 tokens: whole-conversation packing (data.packing
# "bfd", the default when fine-tuning) would truncate every one, so the demo lays them end to end ("concat") and
# keeps them apart with document masks and positions that restart at each conversation. With model.seq_length 256
# or more, --set 'data.packing="bfd"' packs whole conversations (docs/data.md).
echo "== 2. train tiny-cpu on the replies only (PP 2 on 2 processes), loss over the step's target tokens"
deepspeed --num_gpus 2 train.py --ds_config ds_configs/tiny-cpu.json \
    --data-path "$RUN/data/chat_demo_text_document" --set training.save="$RUN/checkpoints" \
    --set parallelism.tensor_parallel_size=1 --set parallelism.pipeline_parallel_size=2 \
    --set train_batch_size=16 --set schedule.batch={} --set schedule.warmup_tokens=1024 \
    --set schedule.decay_tokens=20480 --set schedule.train_tokens=20480 --set training.max_steps=20 \
    --set training.log_interval=1 --set training.eval_interval=0 --set training.eval_iters=0 \
    --set training.save_interval=0 --set 'training.loss_normalization="tokens"' \
    --set 'data.packing="concat"' --set data.reset_attention_mask=true --set data.reset_position_ids=true "$@"

echo "== 3. the loss, step by step"
python - "$RUN/checkpoints/metrics.jsonl" <<'PY'
import sys

from training.metrics_log import read_metrics

losses = [(record["step"], record["loss"]) for record in read_metrics(sys.argv[1])]
print("  ".join(f"{step}: {loss:.2f}" for step, loss in losses))
print(f"loss {losses[0][1]:.3f} at step {losses[0][0]} -> {losses[-1][1]:.3f} at step {losses[-1][0]}")
PY

echo "== 4. one chat answer (tools/generate.py --chat, sampled; 20 steps from random weights make no sense yet)"
# the tiny model has 64 positions and the template's system prompt takes most: 10 new tokens
python tools/generate.py --checkpoint "$RUN/checkpoints" --set parallelism.pipeline_parallel_size=1 --chat \
    --chat-template data/chat_templates/qwen_style.jinja --prompt "What do bees make?" --max-new-tokens 10 \
    --temperature 0.7 --seed 1 --stop "<|im_end|>" 2>/dev/null
