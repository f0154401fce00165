#!/usr/bin/env bash
# The first run on a GPU: one GPU, nothing outside the machine needed, sized to finish in under 8 minutes on an
# H100 or H200 (tools/plan.py: about 70 s of training on an H200, the rest start-up, install and checkpoints).
#
#   1. installs what is missing: DeepSpeed 0.19.8 from wheels/ when that folder exists (built beforehand on a machine
#      with network: bash scripts/gpu_smoke.sh --build-wheels), else from the package index; this project in
#      editable mode without dependencies; then checks that torch sees CUDA and that every module the run imports is
#      there, naming what is missing;
#   2. tokenises the shipped corpus (data/corpus/botchan.jsonl), as scripts/demo.sh does;
#   3. trains ds_configs/125m.json, then ds_configs/1.3b.json, 30 steps each on this one GPU: bf16, TP 1 x PP 1,
#      a fixed global batch of 64 (micro-batch 8, 8 micro-batches; the configs' ramp would start there anyway and
#      their full batch of 256 / 512 takes minutes a step on one GPU), a checkpoint at the end;
#   4. prints, per config, the measured seconds per step, TFLOP/s per GPU, MFU and peak memory
#      (torch.cuda.max_memory_allocated) beside what tools/plan.py predicts for the same run.
#
# Usage: bash scripts/gpu_smoke.sh [--dry-run] [--skip-install] [--steps N] [--gpu PRESET] [--allow-cpu]
#                                  [--set BLOCK.FIELD=VALUE ...]
#        bash scripts/gpu_smoke.sh --build-wheels
#   --dry-run        print the commands it would run (one per line, prefixed "+ "), run nothing
#   --skip-install   use the Python environment as it is
#   --steps N        optimizer steps per config (default 30)
#   --gpu PRESET     tools/plan.py's hardware preset (default: chosen from the visible GPU; h200 in a dry run)
#   --allow-cpu      rehearse on CPU (DS_ACCELERATOR=cpu): the same commands, no CUDA check; add --set overrides
#                    that shrink the models, e.g. --set model.num_layers=2 --set model.hidden_size=64
#   --set X=Y        one more override for train.py and tools/plan.py (repeatable)
#   --build-wheels   on a machine with network: write DeepSpeed's wheel (and its dependencies but torch) to wheels/
# Python: $PYTHON, default python3 (the GPU machine's, with its CUDA build of torch; not .venv, which is CPU-only).
# The launcher listens on $MASTER_PORT, default 29500.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

PY=${PYTHON:-python3}
RUN=runs/gpu_smoke
CONFIGS=(125m 1.3b)
STEPS=30
GLOBAL_BATCH=64
TRAIN_TIMEOUT_S=240
DRY_RUN=0
INSTALL=1
ALLOW_CPU=0
BUILD_WHEELS=0
GPU_PRESET=""
EXTRA_SETS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1 ;;
        --skip-install) INSTALL=0 ;;
        --allow-cpu) ALLOW_CPU=1 ;;
        --build-wheels) BUILD_WHEELS=1 ;;
        --steps) STEPS=$2; shift ;;
        --gpu) GPU_PRESET=$2; shift ;;
        --set) EXTRA_SETS+=(--set "$2"); shift ;;
        *) echo "gpu_smoke.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# Print a command as the shell would read it, then run it (unless --dry-run).
run() {
    printf '+'; printf ' %q' "$@"; printf '\n'
    if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

if [ "$BUILD_WHEELS" = 1 ]; then
    run "$PY" -m pip wheel deepspeed==0.19.8 --no-deps -w wheels
    # DeepSpeed's own requirements, torch excepted (the GPU machine has its CUDA build), as wheels for this Python.
    run "$PY" -m pip download --only-binary=:all: -d wheels einops hjson msgpack ninja numpy packaging psutil \
        py-cpuinfo "pydantic>=2" tqdm
    exit 0
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
if [ "$ALLOW_CPU" = 1 ]; then export DS_ACCELERATOR=cpu; fi

echo "== 1. install and check"
if [ "$INSTALL" = 1 ]; then
    if compgen -G "wheels/*.whl" >/dev/null; then
        run "$PY" -m pip install --no-index --find-links wheels wheels/*.whl
    elif [ "$DRY_RUN" = 1 ] || ! "$PY" -c "import deepspeed" 2>/dev/null; then
        run "$PY" -m pip install deepspeed==0.19.8
    fi
    run "$PY" -m pip install --no-deps --no-build-isolation -e .
fi
CHECK_ARGS=()
if [ "$ALLOW_CPU" = 1 ]; then CHECK_ARGS+=(--allow-cpu); fi
run "$PY" scripts/gpu_smoke.py check "${CHECK_ARGS[@]}"

if [ "$DRY_RUN" = 1 ]; then
    HARDWARE=(--gpu "${GPU_PRESET:-h200}")
else
    HARDWARE_ARGS=$("$PY" scripts/gpu_smoke.py plan-args ${GPU_PRESET:+--gpu "$GPU_PRESET"})
    read -r -a HARDWARE <<< "$HARDWARE_ARGS"
fi

if [ "$DRY_RUN" = 0 ]; then rm -rf "$RUN"; fi  # a fresh start: a run resumes from its checkpoint directory by itself
echo "== 2. tokenise data/corpus/botchan.jsonl (GPT-2 BPE)"
run "$PY" tools/preprocess_data.py --input data/corpus/botchan.jsonl --output-prefix "$RUN/data/botchan" \
    --append-eod --workers 2

# The same run for train.py and tools/plan.py: one GPU, TP 1 x PP 1, bf16, a fixed batch of GLOBAL_BATCH.
RUN_SETS=(--set parallelism.tensor_parallel_size=1 --set parallelism.pipeline_parallel_size=1
          --set bf16.enabled=true --set model.precision=bf16
          --set train_batch_size=$GLOBAL_BATCH --set schedule.batch={})
STATUS=0
for CONFIG in "${CONFIGS[@]}"; do
    echo "== 3. train $CONFIG: $STEPS steps on 1 GPU, bf16, TP 1 x PP 1, global batch $GLOBAL_BATCH"
    # deepspeed.launcher.runner is what the `deepspeed` command runs; as a module it runs on $PY, whatever PATH says.
    TRAIN=(timeout --kill-after=30 "$TRAIN_TIMEOUT_S" "$PY" -m deepspeed.launcher.runner --num_gpus 1
           --master_port "${MASTER_PORT:-29500}" scripts/gpu_smoke_train.py
           --ds_config "ds_configs/$CONFIG.json" --data-path "$RUN/data/botchan_text_document" "${RUN_SETS[@]}"
           --set "training.max_steps=$STEPS" --set training.log_interval=1 --set training.eval_iters=1
           --set "training.save=$RUN/$CONFIG" --set training.save_interval=0 "${EXTRA_SETS[@]}")
    PLAN=("$PY" tools/plan.py --ds_config "ds_configs/$CONFIG.json" --nodes 1 --gpus-per-node 1 "${HARDWARE[@]}"
          "${RUN_SETS[@]}" "${EXTRA_SETS[@]}" --json)
    if [ "$DRY_RUN" = 1 ]; then
        run "${TRAIN[@]}"
        run "${PLAN[@]}"
        continue
    fi
    mkdir -p "$RUN"
    run "${TRAIN[@]}" 2>&1 | tee "$RUN/$CONFIG.log" || STATUS=1
    printf '+'; printf ' %q' "${PLAN[@]}"; printf ' > %q\n' "$RUN/$CONFIG.plan.json"
    "${PLAN[@]}" > "$RUN/$CONFIG.plan.json" || STATUS=1
done

echo "== 4. measured beside tools/plan.py's prediction"
run "$PY" scripts/gpu_smoke.py report "$RUN" "${CONFIGS[@]}"
exit $STATUS
