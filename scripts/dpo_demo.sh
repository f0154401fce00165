#!/usr/bin/env bash
# Direct preference optimisation on the shipped preference set, end to end on 2 CPU processes (docs/dpo.md):
#   1. tokenise data/corpus/chat_demo.jsonl (SFT) and data/corpus/preference_demo.jsonl (200 pairs: a polite, right
#      reply chosen over a wrong or rude one) with GPT-2's BPE and the qwen-style chat template, model.seq_length 128;
#   2. SFT the tiny-cpu model briefly on the chat set (PP 2), the checkpoint DPO starts from and its reference;
#   3. the reference log-probs of every sequence of the pairs, from that checkpoint (tools/reference_logps.py);
#   4. DPO from that checkpoint (training.dpo, PP 2), and TRL's rewards/accuracies step by step: it rises.
# Extra arguments go to the DPO run's train.py, e.g. bash scripts/dpo_demo.sh --set training.max_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
RUN=runs/dpo-demo
TEMPLATE=data/chat_templates/qwen_style.jinja
rm -rf "$RUN"
LAYOUT=(--set parallelism.tensor_parallel_size=1 --set parallelism.pipeline_parallel_size=2
        --set model.seq_length=128 --set train_batch_size=16 --set schedule.batch={}
        --set training.log_interval=1 --set training.eval_interval=0 --set training.eval_iters=0
        --set training.save_interval=0 --set training.checkpoint_mode=\"sync\")

echo "== 1. tokenise the chat set and the preference pairs"
python tools/preprocess_data.py --input data/corpus/chat_demo.jsonl --output-prefix "$RUN/data/chat" \
    --chat-template "$TEMPLATE" --append-eod --no-progress
python tools/preprocess_data.py --input data/corpus/preference_demo.jsonl --output-prefix "$RUN/data/pairs" \
    --chat-template "$TEMPLATE" --preference --seq-length 128 --no-progress

echo "== 2. SFT: tiny-cpu on the replies of the chat set, 30 steps (PP 2)"
deepspeed --num_gpus 2 train.py --ds_config ds_configs/tiny-cpu.json --data-path "$RUN/data/chat_text_document" \
    "${LAYOUT[@]}" --set training.save="$RUN/sft" --set training.max_steps=30 \
    --set schedule.warmup_tokens=2048 --set schedule.decay_tokens=61440 --set schedule.train_tokens=61440 \
    --set 'training.loss_normalization="tokens"' --set 'data.packing="concat"' \
    --set data.reset_attention_mask=true --set data.reset_position_ids=true

echo "== 3. reference log-probs of the 400 sequences, from the SFT checkpoint (at its own PP 2)"
deepspeed --num_gpus 2 tools/reference_logps.py --checkpoint "$RUN/sft" --data-prefix "$RUN/data/pairs"

echo "== 4. DPO from the SFT checkpoint: 8 pairs a step, 60 steps (2.4 epochs), beta 0.1 (PP 2)"
deepspeed --num_gpus 2 train.py --ds_config ds_configs/tiny-cpu.json --data-path "$RUN/data/pairs" \
    "${LAYOUT[@]}" --set training.save="$RUN/dpo" --set training.max_steps=60 \
    --set training.init_from="$RUN/sft" --set training.fine_tune=true --set 'training.dpo={"beta": 0.1}' \
    --set schedule.lr=1e-3 --set schedule.warmup_tokens=2048 --set schedule.decay_tokens=122880 \
    --set schedule.train_tokens=122880 "$@"

echo "== 5. TRL's metrics, step by step"
python - "$RUN/dpo/metrics.jsonl" <<'PY'
import sys

from training.metrics_log import read_metrics

records = [record for record in read_metrics(sys.argv[1]) if "rewards/accuracies" in record]
print("step  loss    rewards/accuracies  rewards/margins")
for record in records:
    print(f"{record['step']:4d}  {record['loss']:.4f}  {record['rewards/accuracies']:18.3f}  "
          f"{record['rewards/margins']:15.4f}")
first, last = records[:10], records[-10:]
mean = lambda part, key: sum(record[key] for record in part) / len(part)
print(f"reward accuracy {mean(first, 'rewards/accuracies'):.3f} over steps 1-{first[-1]['step']} -> "
      f"{mean(last, 'rewards/accuracies'):.3f} over steps {last[0]['step']}-{last[-1]['step']}; loss "
      f"{mean(first, 'loss'):.3f} -> {mean(last, 'loss'):.3f}")
PY
