#!/usr/bin/env python
"""Convert a checkpoint ahead of time so that a run at another TP x PP x DP resumes from it at once.

    python tools/reshape_checkpoint.py --checkpoint checkpoints/530b
    python tools/reshape_checkpoint.py --checkpoint checkpoints/530b --tag global_step1000 --workers 16

train.py does the same by itself when it finds that the checkpoint it resumes from was written at another layout
(rank 0 converts, the other ranks wait): converting beforehand, on a machine with memory and cores to spare, saves
that time on the cluster. The checkpoint is first checked against its record (sizes, CRC-32); DeepSpeed's converter
(deepspeed.checkpoint.ds_to_universal's steps, strict, with a Mixture-of-Experts model's experts merged by
training/universal_conversion.py, any expert-parallel size) then writes <checkpoint>/universal/<tag>/, under a
temporary name renamed when complete. Its progress goes to stderr; stdout gets one line: the output folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the run's checkpoint directory (holding `latest`)")
    parser.add_argument("--tag", help="a checkpoint other than the latest, e.g. global_step1000")
    parser.add_argument("--workers", type=int, default=4,
                        help="processes that extract the ZeRO shards (half as many merge TP slices; default 4)")
    args = parser.parse_args(argv)
    from training.checkpoint import RECORD, UNIVERSAL, convert_to_universal, read_latest, read_record, verify_alone

    directory = Path(args.checkpoint)
    try:
        tag = args.tag or read_latest(directory)
        if tag is None or not (directory / tag).is_dir():
            raise ValueError(f"{directory} holds no checkpoint {tag or '(no latest file)'}")
        if read_record(directory, tag) is None:
            print(f"note: {directory / tag} has no {RECORD} (written before records existed): not verified",
                  file=sys.stderr)
        damage = verify_alone(directory, tag)
        if damage:
            raise ValueError(f"{directory / tag} is damaged: " + "; ".join(damage))
        if (directory / UNIVERSAL / tag).is_dir():
            print(f"note: {directory / UNIVERSAL / tag} exists already", file=sys.stderr)
        start = time.perf_counter()
        output = convert_to_universal(directory, tag, workers=max(1, args.workers), show_progress=True)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"converted in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
