#!/usr/bin/env python
"""The reference log-probs of a preference set, for DPO (training.dpo.reference "file"): one forward of the
reference model over every sequence, at any TP x PP x DP.

    python tools/reference_logps.py --checkpoint runs/sft/checkpoints --data-prefix runs/dpo/data/pairs
    deepspeed --num_gpus 8 tools/reference_logps.py --checkpoint ckpts/sft --data-prefix data/pairs \\
        --set parallelism.tensor_parallel_size=2 --set parallelism.pipeline_parallel_size=2

--data-prefix is the --output-prefix tools/preprocess_data.py wrote the pairs under (P_text_document,
P_loss_mask_document, P_preference.json). The checkpoint is any of this project's (trained, imported from Hugging
Face, reshaped), run at its own TP x PP (or --set's), DP being what the launched world leaves; launch it as
tools/evaluate.py. Each sequence's summed completion log-prob (the targets of its mask, fp32, summed as training/dpo.py
sums the policy's) is written, in document order (2i chosen, 2i + 1 rejected), to

    P_reference_logps.npy    float32 (2 x pairs,)
    P_reference_logps.json   the checkpoint's identity (path, tag, a fingerprint of its weight files), the data's
                             fingerprint, the count and dtype; written after the .npy, both atomically

A DPO run checks the record against its data and the checkpoint it starts from (training.init_from) and refuses a
mismatch (training/preference_data.py). A progress bar goes to stdout (--no-progress: none).
"""

from __future__ import annotations

import argparse
import sys

from tools.inference_options import is_rank_zero, layout, run_and_clean_up
from tools.streams import deepspeed_logs_to_stderr


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the reference model's checkpoint directory (holding "
                        "`latest`): the checkpoint the DPO run starts from (training.init_from)")
    parser.add_argument("--tag", help="a checkpoint other than the latest, e.g. global_step1000")
    parser.add_argument("--data-prefix", required=True, help="the preference set's prefix (tools/preprocess_data.py "
                        "--output-prefix); P_text_document is accepted too")
    parser.add_argument("--set", action="append", default=[], metavar="BLOCK.FIELD=VALUE",
                        help="the layout, e.g. --set parallelism.tensor_parallel_size=2 (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass of a replica (8)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--local_rank", "--local-rank", type=int, help="set by the deepspeed launcher")
    parser.set_defaults(ds_config=None)  # tools/inference_options.py layout(): the checkpoint's own, --set edits it
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        print(f"error: --batch-size must be >= 1, got {args.batch_size}", file=sys.stderr)
        return 2
    deepspeed_logs_to_stderr()  # stdout carries the progress bar and the result line only

    def work() -> int:
        import contextlib

        from data.preference import PreferencePairs
        from evaluation.loading import load_pipeline
        from training.preference_data import (
            checkpoint_identity,
            compute_reference_logps,
            preference_prefix,
            write_reference,
        )

        prefix = preference_prefix(args.data_prefix)
        pairs = PreferencePairs(prefix)
        pairs.check_fingerprint()  # the record names the data its files are now
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's PipelineModule prints its partition
            pipeline, checkpoint = load_pipeline(args.checkpoint, args.tag, layout(args))
        values = compute_reference_logps(pipeline, pairs, args.batch_size, progress=not args.no_progress)
        if is_rank_zero():
            identity = checkpoint_identity(checkpoint.directory, checkpoint.tag)
            path = write_reference(prefix, values, identity, pairs.fingerprint)
            ctx = pipeline.ctx
            print(f"wrote {path}: {values.size} sequences of {len(pairs)} pairs, mean log-prob "
                  f"{float(values.mean()) if values.size else 0.0:.4f}, from {checkpoint.directory}/{checkpoint.tag} "
                  f"at TP {ctx.tensor_parallel_size} x PP {ctx.pipeline_parallel_size} x DP "
                  f"{ctx.data_parallel_size}", flush=True)
        return 0

    return run_and_clean_up(work, (ValueError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
