#!/usr/bin/env bash
# The first run on a GPU: one GPU, nothing outside the machine needed, sized to finish in under 8 minutes on an
# H100 or H200 (tools/plan.py: about 70 s of training on an H200, the rest start-up, install and checkpoints).
#
#   1. installs what is missing: DeepSpeed 0.19.8 from wheels/ when that folder exists (built beforehand on a machine
#      with network: bash scripts/gpu_smoke.sh --build-wheels), else from the package index; this project in
#      editable mode without dependencies (with --site DIR instead: the wheels into DIR, without dependencies, and
#      DIR and this repository on PYTHONPATH, the Python environment untouched); then checks that torch sees CUDA and
#      that every module the run imports is there, naming what is missing;
#   2. tokenises the shipped corpus (data/corpus/botchan.jsonl), as scripts/demo.sh does;
#   3. trains ds_configs/125m.json, then ds_configs/1.3b.json, 30 steps each on this one GPU: bf16, TP 1 x PP 1,
#      a fixed global batch of 64 (micro-batch 8, 8 micro-batches; the configs' ramp would start there anyway and
#      their full batch of 256 / 512 takes minutes a step on one GPU), a checkpoint at the end;
#   4. on the 125m checkpoint (scripts/gpu_smoke_checks.py says how each is judged): attention on SDPA's flash
#      kernel alone; tools/evaluate.py against lm-eval's HFLM on the export, both fp32; tools/generate.py's greedy
#      tokens against transformers' generate(); a run stopped at step 20 (sync saves) and resumed from its
#      checkpoint against the straight run, which saves asynchronously at steps 10, 20, 30 (of --steps 30); the stall of those saves
#      against the sync ones. Parts that need two ranks are skipped on one GPU (NCCL cannot put two ranks on one);
#      The 125m run dumps a CUDA memory snapshot after step 3 (training.memory_snapshot, Python stacks), checked
#      for its segments and allocation history; both runs log measured / planned at every step (training.plan_hardware);
#      document masks on packed samples with FlexAttention (model.attention_backend "flex") against SDPA's reference;
#      the host synchronisations (torch.cuda.set_sync_debug_mode) of a dense (also on packed documents) and a sparse
#      Llama block of 125m's shape, forward and backward, and of every training step, by owner (model, training, DeepSpeed): each run prints a
#      "[host-syncs]" line per step (scripts/gpu_smoke_syncs.py); FlexAttention's memory on 8 packed documents at
#      16k and 32k positions, one 125m block forward and backward, against planner/memory.py's figure;
#   5. prints one table: per config the measured tokens/s, TFLOP/s, MFU and peak memory beside what tools/plan.py
#      predicts, and the trainer's own measured / planned ratios; then every check with pass, fail or skip and its
#      figure; exits 1 if any failed. A third 125m run, its blocks compiled (training.compile, off by default until
#      measured here), prints its tokens/s, MFU and compile time against the eager 125m run's.
#
# Usage: bash scripts/gpu_smoke.sh [--dry-run] [--skip-install] [--site DIR] [--steps N] [--gpu PRESET] [--allow-cpu]
#                                  [--set BLOCK.FIELD=VALUE ...]
#        bash scripts/gpu_smoke.sh --build-wheels
#   --dry-run        print the commands it would run (one per line, prefixed "+ "), run nothing
#   --skip-install   use the Python environment as it is
#   --site DIR       install wheels/*.whl with pip's --target DIR --no-deps (nothing resolved, the environment left as it
#                    is, read-only or not) and put this repository and DIR first on PYTHONPATH in place of the
#                    editable install; with --skip-install only the PYTHONPATH (DIR installed before)
#   --steps N        optimizer steps per config (default 30)
#   --gpu PRESET     tools/plan.py's hardware preset (default: chosen from the visible GPU; h200 in a dry run)
#   --allow-cpu      rehearse on CPU (DS_ACCELERATOR=cpu): the same commands, no CUDA check; add --set overrides
#                    that shrink the models, e.g. --set model.num_layers=2 --set model.hidden_size=64
#   --set X=Y        one more override for train.py and tools/plan.py (repeatable)
#   --build-wheels   on a machine with network, PYTHON a Python with torch (DeepSpeed's build imports it): write to
#                    wheels/ what the GPU machine's image lacks, for its Python 3.12 on x86-64 (WHEEL_PYTHON): DeepSpeed
#                    and its requirements, lm-eval and those it imports here; one pinned version of each, for --site
# Python: $PYTHON, default python3 (the GPU machine's, with its CUDA build of torch; not .venv, which is CPU-only).
# GPU_SMOKE_TRAIN_TIMEOUT_S: one training run's limit in seconds (default 240).
# The launcher listens on $MASTER_PORT, default 29500.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

PY=${PYTHON:-python3}
RUN=runs/gpu_smoke
CONFIGS=(125m 1.3b)
STEPS=30
GLOBAL_BATCH=64
TRAIN_TIMEOUT_S=${GPU_SMOKE_TRAIN_TIMEOUT_S:-240}  # one training run's limit, start-up included
DRY_RUN=0
INSTALL=1
ALLOW_CPU=0
BUILD_WHEELS=0
SITE=""
GPU_PRESET=""
EXTRA_SETS=()
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1 ;;
        --skip-install) INSTALL=0 ;;
        --site) SITE=$2; shift ;;
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
    # Pure Python (no op is prebuilt: DeepSpeed compiles what it needs on first use); sqlitedict and word2number are
    # sources only.
    run "$PY" -m pip wheel --no-deps --no-build-isolation -w wheels deepspeed==0.19.8 sqlitedict==2.1.0 word2number==1.1
    # The rest as the GPU machine's Python takes them. DeepSpeed's requirements that its image lacks: hjson and
    # pydantic (2.11: typing-extensions >= 4.12.2, where 2.14 wants 4.16); lm-eval's (tools/evaluate.py, HFLM) that it
    # lacks: datasets (5.0.1: pyarrow >= 21, huggingface-hub < 2, as the image's 1.33), dill, multiprocess, evaluate,
    # more-itertools, sqlitedict, word2number. Not carried, as nothing here imports them: pytablewriter (lm-eval's
    # make_table only) and rouge-score (some of lm-eval's own tasks).
    run "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
        hjson==3.1.0 pydantic==2.11.10 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1 \
        lm-eval==0.4.13 datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 more-itertools==11.2.1
    exit 0
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
export GPU_SMOKE_HOST_SYNCS=1  # every training step's host synchronisations, printed (scripts/gpu_smoke_train.py)
if [ "$ALLOW_CPU" = 1 ]; then export DS_ACCELERATOR=cpu; fi

echo "== 1. install and check"
if [ -n "$SITE" ]; then
    case "$SITE" in /*) ;; *) SITE=$PWD/$SITE ;; esac  # PYTHONPATH holds it for every process, wherever it runs
    if [ "$INSTALL" = 1 ]; then
        if [ "$DRY_RUN" = 0 ] && ! compgen -G "wheels/*.whl" >/dev/null; then
            echo "gpu_smoke.sh: --site installs wheels/*.whl, and there are none (see --build-wheels)" >&2
            exit 2
        fi
        run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            wheels/*.whl
    fi
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the repository: what the editable install gives
    echo "+ export PYTHONPATH=$PYTHONPATH"
elif [ "$INSTALL" = 1 ]; then
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
# The schedule spans the smoke's own tokens (STEPS full batches at 2,048 positions): the configs' 300B tokens would
# build a sample index of 146M samples over the small corpus first (minutes and gigabytes of host memory, the
# OOM-kill of a CPU rehearsal at 128 positions), and every run here (stopped, resumed, straight) must share one index.
SMOKE_TOKENS=$(( STEPS * GLOBAL_BATCH * 2048 ))
RUN_SETS=(--set parallelism.tensor_parallel_size=1 --set parallelism.pipeline_parallel_size=1
          --set bf16.enabled=true --set model.precision=bf16
          --set train_batch_size=$GLOBAL_BATCH --set schedule.batch={}
          --set schedule.train_tokens=$SMOKE_TOKENS --set schedule.decay_tokens=$SMOKE_TOKENS
          --set schedule.warmup_tokens=$(( SMOKE_TOKENS / 10 )))
SAVE_EVERY=$(( STEPS >= 3 ? STEPS / 3 : 1 ))  # 10 of 30: saves at 10, 20, 30
SNAPSHOT_STEP=$(( STEPS >= 3 ? 3 : STEPS ))
SNAPSHOT_SET='training.memory_snapshot={"step": '$SNAPSHOT_STEP', "on_oom": false, "stacks": "python"}'
STOP_AT=$(( 2 * SAVE_EVERY ))
# train CONFIG SAVE MAX_STEPS SAVE_INTERVAL MODE LOG [--set X=Y ...]: one training run through the launcher, its
# output in LOG; the --set items after LOG are for this run only.
# deepspeed.launcher.runner is what the `deepspeed` command runs; as a module it runs on $PY, whatever PATH says.
train() {
    local command=(timeout --kill-after=30 "$TRAIN_TIMEOUT_S" "$PY" -m deepspeed.launcher.runner --num_gpus 1
                   --master_port "${MASTER_PORT:-29500}" scripts/gpu_smoke_train.py
                   --ds_config "ds_configs/$1.json" --data-path "$RUN/data/botchan_text_document" "${RUN_SETS[@]}"
                   --set "training.max_steps=$3" --set training.log_interval=1 --set training.eval_iters=1
                   --set "training.save=$2" --set "training.save_interval=$4"
                   --set "training.checkpoint_mode=$5" "${@:7}" "${EXTRA_SETS[@]}")
    if [ "$DRY_RUN" = 1 ]; then run "${command[@]}"; return 0; fi
    mkdir -p "$RUN"
    run "${command[@]}" 2>&1 | tee "$6"
}

for CONFIG in "${CONFIGS[@]}"; do
    echo "== 3. train $CONFIG: $STEPS steps on 1 GPU, bf16, TP 1 x PP 1, global batch $GLOBAL_BATCH"
    # 125m saves every STEPS / 3 (async): the resume and stall checks read those saves; 1.3b at its end only.
    # Both log measured against planned on tools/plan.py's preset (training/plan_check.py); 125m also records the
    # CUDA allocator's history and dumps a snapshot after step 3 (training/memory_snapshot.py), then stops recording.
    INTERVAL=0; SNAPSHOT=(); if [ "$CONFIG" = 125m ]; then INTERVAL=$SAVE_EVERY; SNAPSHOT=(--set "$SNAPSHOT_SET"); fi
    train "$CONFIG" "$RUN/$CONFIG" "$STEPS" "$INTERVAL" async "$RUN/$CONFIG.log" \
        --set "training.plan_hardware=${HARDWARE[1]}" "${SNAPSHOT[@]}" || true
    PLAN=("$PY" tools/plan.py --ds_config "ds_configs/$CONFIG.json" --nodes 1 --gpus-per-node 1 "${HARDWARE[@]}"
          "${RUN_SETS[@]}" "${EXTRA_SETS[@]}" --json)
    if [ "$DRY_RUN" = 1 ]; then run "${PLAN[@]}"; continue; fi
    printf '+'; printf ' %q' "${PLAN[@]}"; printf ' > %q\n' "$RUN/$CONFIG.plan.json"
    "${PLAN[@]}" > "$RUN/$CONFIG.plan.json" || true
done
echo "== 3b. train 125m again, its blocks compiled (training.compile): tokens/s and MFU against the eager run"
train 125m "$RUN/125m-compiled" "$STEPS" 0 async "$RUN/125m-compiled.log" --set training.compile=true || true

# Each check writes RUN/checks/NN-name.json; a command that fails leaves its record unwritten, which the summary
# counts as a failure, so the script goes on to the next check.
CHECK=(scripts/gpu_smoke_checks.py)
CKPT=$RUN/125m
TASKS=alice_choice,alice_lastword
PROMPTS=(--prompt "I was" --prompt "The schoolmaster")
echo "== 4. checks on the 125m checkpoint"
run "$PY" "${CHECK[@]}" flash "$RUN" 1 ds_configs/125m.json "${RUN_SETS[@]}" "${EXTRA_SETS[@]}" || true
run "$PY" tools/convert_to_hf.py --checkpoint "$CKPT" --output "$RUN/125m-hf" --dtype fp32 --no-progress || true
run "$PY" tools/evaluate.py --checkpoint "$CKPT" --dtype fp32 --tasks "$TASKS" --limit 40 --log-samples \
    --output "$RUN/eval-ours.json" || true
run "$PY" "${CHECK[@]}" hflm "$RUN/125m-hf" "$RUN/eval-hf.json" --tasks "$TASKS" --limit 40 || true
run "$PY" "${CHECK[@]}" compare-eval "$RUN" 2 "$RUN/eval-ours.json" "$RUN/eval-hf.json" "$RUN/125m-hf" || true
run "$PY" tools/generate.py --checkpoint "$CKPT" --dtype fp32 "${PROMPTS[@]}" --max-new-tokens 32 \
    --output "$RUN/generate-ours.jsonl" || true
run "$PY" "${CHECK[@]}" hf-generate "$RUN/125m-hf" "$RUN/generate-hf.jsonl" "${PROMPTS[@]}" --max-new-tokens 32 || true
run "$PY" "${CHECK[@]}" compare-generate "$RUN" 3 "$RUN/generate-ours.jsonl" "$RUN/generate-hf.jsonl" || true
echo "== 5. the same 125m run stopped at step $STOP_AT (sync saves), then resumed from its checkpoint"
train 125m "$RUN/125m-resume" "$STOP_AT" "$SAVE_EVERY" sync "$RUN/125m-stopped.log" || true
run cp "$RUN/125m-resume/metrics.jsonl" "$RUN/125m-stopped.jsonl" || true
train 125m "$RUN/125m-resume" "$STEPS" "$SAVE_EVERY" async "$RUN/125m-resumed.log" || true
run "$PY" "${CHECK[@]}" resume "$RUN" 4 "$CKPT/metrics.jsonl" "$RUN/125m-stopped.jsonl" \
    "$RUN/125m-resume/metrics.jsonl" || true
run "$PY" "${CHECK[@]}" stall "$RUN" 5 --sync-log "$RUN/125m-stopped.log" --async-log "$RUN/125m.log" || true
run "$PY" "${CHECK[@]}" memory-snapshot "$RUN" 7 "$CKPT/memory/snapshot_step${SNAPSHOT_STEP}_rank0.pickle" || true
run "$PY" "${CHECK[@]}" document-masks "$RUN" 8 ds_configs/125m.json "${RUN_SETS[@]}" "${EXTRA_SETS[@]}" || true
run "$PY" "${CHECK[@]}" host-syncs "$RUN" 9 ds_configs/125m.json --train-log "$RUN/125m.log" "${RUN_SETS[@]}" \
    "${EXTRA_SETS[@]}" || true
run "$PY" "${CHECK[@]}" flex-memory "$RUN" 10 ds_configs/125m.json "${RUN_SETS[@]}" "${EXTRA_SETS[@]}" || true
GPUS=1
if [ "$DRY_RUN" = 0 ]; then GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" || echo 0); fi
if [ "$GPUS" -ge 2 ]; then
    run "$PY" -m deepspeed.launcher.runner --num_gpus 2 --master_port "${MASTER_PORT:-29500}" tools/evaluate.py \
        --checkpoint "$CKPT" --dtype fp32 --set parallelism.tensor_parallel_size=2 --tasks "$TASKS" --limit 40 \
        --log-samples --output "$RUN/eval-tp2.json" || true
    run "$PY" "${CHECK[@]}" compare-eval "$RUN" 6 "$RUN/eval-tp2.json" "$RUN/eval-hf.json" "$RUN/125m-hf" || true
else
    run "$PY" "${CHECK[@]}" skip "$RUN" 6 "tools/evaluate.py at TP 2" \
        "NCCL cannot put two ranks on one GPU: $GPUS visible" || true
fi

echo "== 6. measured beside tools/plan.py's prediction, and every check"
run "$PY" scripts/gpu_smoke.py report "$RUN" "${CONFIGS[@]}" --compiled 125m:125m-compiled || true
run "$PY" "${CHECK[@]}" summary "$RUN" 10 "${CONFIGS[@]}"
