"""training.dpo's data: preference pairs as rows of micro-batches with their reference log-probs, resumable.

What lies on disk for a preference prefix P (tools/preprocess_data.py writes the first three, data/preference.py reads
them; tools/reference_logps.py writes the last two):

    P_text_document, P_loss_mask_document    the pairs as masked sequences: document 2i chosen, 2i + 1 rejected
    P_preference.json                        what the preprocessor did (data/preference.py)
    P_reference_logps.npy                    fp32 (2n,): each sequence's summed completion log-prob under the
                                             reference model, in document order
    P_reference_logps.json                   {"schema_version", "checkpoint": {"path", "tag", "weights"}, "data":
                                             the data's fingerprint, "count", "dtype"}; written after the .npy

How the run reads them (the rows are what DeepSpeed's train_batch_size counts, a pair is two rows):

    what                    rule
    order                   epoch e visits the n pairs in numpy's permutation of default_rng([seed, e]); row j of
                            the run is side j % 2 (0 chosen, 1 rejected) of pair order_e[(j mod 2n) // 2], e = j // 2n
    global batch            rows [data_position, data_position + B) of that sequence: B / 2 pairs (B, the micro-batch
                            and the ramp's batches are even, so no pair straddles two batches)
    micro-batch k, DP rank  data/loader.py's rule (MicroBatchLoader): rows [c + k mb dp + r mb, ... + mb); c and mb
    r                       are even, so every micro-batch holds whole pairs at rows 2i, 2i + 1, and any split of a
                            global batch into micro-batches, accumulation steps and replicas holds the same pairs
    a row                   its tokens padded to seq_length + 1 with data.eod_token_id, mask bits 0 on the padding;
                            first stage (tokens, position_ids), last stage (labels, loss_mask, reference_logps)
    resume                  from the run's data position (consumed_samples), as the next-token loader

A reference file belongs to one checkpoint and one data set: at start-up its ``data`` must be the data's fingerprint
and its ``checkpoint.weights`` the fingerprint of the checkpoint the run starts from (training.init_from, its latest
tag): the sha256 of its weight files' names, sizes and CRC-32s (taken from the checkpoint's own record,
checkpoint.json, when it has one; read from the files otherwise). With training.dpo.reference "model" no file is
read: :class:`ReferenceModel`, that checkpoint frozen on the same ranks, fills each step's micro-batches.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from common.files import atomic_open, write_json_atomically
from data.index_cache import file_crc32
from data.indexed_dataset import IndexedDataset, check_vocab_size
from data.loader import MicroBatch, MicroBatchLoader
from data.loss_mask import tokens_prefix
from data.preference import PreferencePairs
from model.checkpoint_files import read_latest
from model.config import set_option
from training.checkpoint import read_record

REFERENCE_SCHEMA_VERSION = 1
REFERENCE_VALUES_SUFFIX, REFERENCE_RECORD_SUFFIX = "_reference_logps.npy", "_reference_logps.json"
WEIGHT_FILE_PATTERNS = ("layer_*-model_states.pt", "experts_*.pt")


def preference_prefix(path: str) -> str:
    """The preprocessor's output prefix, also when data.blend names its token dataset (``P_text_document``)."""
    suffix = tokens_prefix("")
    return path[: -len(suffix)] if path.endswith(suffix) else path


def reference_paths(prefix: str) -> tuple[Path, Path]:
    """(the values, their record) beside the preference data of ``prefix``."""
    return Path(prefix + REFERENCE_VALUES_SUFFIX), Path(prefix + REFERENCE_RECORD_SUFFIX)


def checkpoint_identity(directory: str | Path, tag: str | None = None) -> dict[str, str]:
    """{"path", "tag", "weights"} of a checkpoint (``tag``, else its latest): ``weights`` is the sha256 of its weight
    files' (name, bytes, CRC-32), from its checkpoint.json when that records them all, else read from the files."""
    directory = Path(directory)
    tag = tag or read_latest(directory)
    if tag is None:
        raise ValueError(f"{directory} holds no checkpoint (no latest file): give the checkpoint directory the run "
                         f"starts from")
    folder = directory / tag
    names = sorted(path.name for pattern in WEIGHT_FILE_PATTERNS for path in folder.glob(pattern))
    if not names:
        raise ValueError(f"{folder} holds no weight files ({', '.join(WEIGHT_FILE_PATTERNS)})")
    recorded = (read_record(directory, tag) or {}).get("files", {})
    entries = [[name, recorded[name]["bytes"], recorded[name]["crc32"]] if name in recorded
               else [name, (folder / name).stat().st_size, file_crc32(str(folder / name))] for name in names]
    weights = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    return {"path": str(directory.resolve()), "tag": tag, "weights": weights}


def write_reference(prefix: str, values: np.ndarray, checkpoint: dict[str, str], data_fingerprint: str) -> Path:
    """The values (fp32, one per sequence) then their record, each written beside its path and renamed into place:
    a crash leaves the old pair or a record that does not describe the new values (its count or checkpoint)."""
    values_path, record_path = reference_paths(prefix)
    values = np.ascontiguousarray(values, dtype=np.float32)
    with atomic_open(values_path, "wb") as stream:
        np.save(stream, values)
    write_json_atomically(record_path, {"schema_version": REFERENCE_SCHEMA_VERSION, "checkpoint": checkpoint,
                                        "data": data_fingerprint, "count": int(values.size), "dtype": "float32"})
    return values_path


def _reference_command(prefix: str, checkpoint: str) -> str:
    return f"python tools/reference_logps.py --checkpoint {checkpoint} --data-prefix {prefix}"


def read_reference(prefix: str, sequences: int, data_fingerprint: str, checkpoint: dict[str, str]) -> np.ndarray:
    """The reference log-probs of ``prefix``'s ``sequences`` sequences, checked against the data's fingerprint and
    the identity of the checkpoint the run starts from; a ValueError naming the file, what was expected, what it
    holds, and the command that makes the right one."""
    values_path, record_path = reference_paths(prefix)
    fix = f"compute them with: {_reference_command(prefix, checkpoint['path'])}"
    if not record_path.exists() or not values_path.exists():
        raise ValueError(f"training.dpo.reference \"file\": {record_path if values_path.exists() else values_path} "
                         f"does not exist: {fix}")
    record = json.loads(record_path.read_text())
    if record.get("data") != data_fingerprint:
        raise ValueError(f"{record_path} was computed on other data: its data fingerprint is {record.get('data')}, "
                         f"{prefix}'s is {data_fingerprint} (the preference set was preprocessed again or replaced): "
                         f"{fix}")
    found = record.get("checkpoint", {})
    if found.get("weights") != checkpoint["weights"]:
        raise ValueError(f"{record_path} holds the reference log-probs of checkpoint {found.get('path')} (tag "
                         f"{found.get('tag')}, weights {found.get('weights')}), and the run starts from "
                         f"{checkpoint['path']} (training.init_from, tag {checkpoint['tag']}, weights "
                         f"{checkpoint['weights']}): DPO's reference is the model it starts from; {fix}, or set "
                         f"{set_option('training.init_from', found.get('path'))}")
    values = np.load(values_path, mmap_mode="r", allow_pickle=False)
    if record.get("count") != sequences or values.shape != (sequences,) or values.dtype != np.float32:
        raise ValueError(f"{values_path} holds {values.dtype} {values.shape} (its record says {record.get('count')} "
                         f"{record.get('dtype')}), the data has {sequences} sequences: the file is damaged or "
                         f"half-written; {fix}")
    return np.asarray(values)


class PreferenceRows:
    """The run's rows (module docstring): ``rows[j]`` is the tokens of row j padded to seq_length + 1, with
    ``sample_loss_mask(j)`` its mask bits and ``reference_logps(js)`` the reference log-probs; data/loader.py's
    SampleDataset, ``rows`` long."""

    def __init__(self, pairs: Any, reference: np.ndarray, seq_length: int, seed: int, rows: int,
                 pad_token_id: int) -> None:
        self.pairs, self.reference, self.seq_length = pairs, reference, seq_length
        self.seed, self.rows, self.pad_token_id = seed, rows, pad_token_id
        self.num_pairs = len(pairs)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.rows

    def order(self, epoch: int) -> np.ndarray:
        """The pairs in the order epoch ``epoch`` visits them."""
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_pairs)}
        return self._orders[epoch]

    def locate(self, row: int) -> tuple[int, int]:
        """(pair, side) of row ``row``: side 0 chosen, 1 rejected."""
        epoch, within = divmod(row, 2 * self.num_pairs)
        return int(self.order(epoch)[within // 2]), within % 2

    def sequence(self, pair: int, side: int, part: int, pad: int, dtype: type) -> np.ndarray:
        """Side ``side`` of pair ``pair``, its tokens (part 0) or mask bits (1), padded to seq_length + 1 with
        ``pad``."""
        values = np.asarray(self.pairs.pair(pair)[2 * side + part], dtype=dtype)
        padded = np.full(self.seq_length + 1, pad, dtype=dtype)
        padded[:len(values)] = values
        return padded

    def __getitem__(self, row: int) -> np.ndarray:
        return self.sequence(*self.locate(row), 0, self.pad_token_id, np.int64)

    def sample_loss_mask(self, row: int) -> np.ndarray:
        return self.sequence(*self.locate(row), 1, 0, np.uint8)

    def reference_logps(self, rows: range) -> np.ndarray:
        """(len(rows),) fp32: each row's sequence's reference log-prob (the file is in document order: 2p + side)."""
        return np.array([self.reference[2 * pair + side] for pair, side in map(self.locate, rows)], dtype=np.float32)


class PairLoader(MicroBatchLoader):
    """data/loader.py's loader over PreferenceRows, each micro-batch's last-stage part with its reference log-probs:
    ((tokens, position_ids), (labels, loss_mask, reference_logps))."""

    def __next__(self) -> MicroBatch:
        first = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        inputs, (labels, loss_mask) = super().__next__()
        reference = self.dataset.reference_logps(range(first, first + self.micro_batch_size))
        return inputs, (labels, loss_mask, torch.from_numpy(reference))  # host: moved with the batch (DevicePrefetcher)


def check_lengths(prefix: str, seq_length: int, what: str) -> IndexedDataset:
    """The token dataset of ``prefix``, every sequence checked to fit ``seq_length`` + 1 tokens (``what`` names
    the limit in the error)."""
    tokens = IndexedDataset(tokens_prefix(prefix))
    longest = int(np.max(tokens.sequence_lengths)) if len(tokens) else 0
    if longest > seq_length + 1:
        raise ValueError(f"{tokens.bin_file}: a sequence of {longest} tokens does not fit {what} {seq_length} (+ 1 "
                         f"for the last label): use a longer model.seq_length, or preprocess the pairs for it "
                         f"(tools/preprocess_data.py truncates or drops longer pairs)")
    return tokens


def open_preference_data(config: Any, check_files: bool = False) -> tuple[Any, np.ndarray]:
    """The run's preference pairs and their checked reference log-probs (module docstring), or a ValueError naming
    the file and the fix; ``check_files``: the data's files hashed again (at start-up, before any process group).
    Under training.dpo.reference "model" the log-probs are zeros here, filled in each step (ReferenceModel)."""
    if len(config.data.blend) != 1:
        raise ValueError(f"training.dpo trains on one preference set, and data.blend names {len(config.data.blend)}: "
                         f"give one prefix (--data-path PREFIX, the --output-prefix of tools/preprocess_data.py)")
    prefix = preference_prefix(str(config.data.blend[0][1]))
    pairs = PreferencePairs(prefix)
    if check_files:
        pairs.check_fingerprint()  # the files hash to what their JSON (and so the reference file) records
    check_vocab_size(check_lengths(prefix, config.model.seq_length, "model.seq_length"), config.model.vocab_size)
    if not config.training.init_from:
        raise ValueError("training.dpo: set training.init_from to the checkpoint the policy starts from, its reference "
                         "(with reference \"file\", the one tools/reference_logps.py computed the log-probs from)")
    if config.training.dpo_config().reference == "model":  # computed in each step (ReferenceModel): zeros until then
        return pairs, np.zeros(2 * len(pairs), np.float32)
    identity = checkpoint_identity(config.training.init_from)
    return pairs, read_reference(prefix, 2 * len(pairs), pairs.fingerprint, identity)


def train_rows(config: Any, rows: int, pairs: Any, reference: np.ndarray) -> PreferenceRows:
    return PreferenceRows(pairs, reference, config.model.seq_length, config.training.seed, rows,
                          config.data.eod_token_id)


def describe_preference_layout(config: Any) -> str:
    """The start-up line of a DPO run's data."""
    pairs = PreferencePairs(preference_prefix(str(config.data.blend[0][1])))
    batch, reference = config.global_batch_size, config.training.dpo_config().reference
    source = (f"from {reference_paths(pairs.prefix)[0]}" if reference == "file"
              else f"computed in each step by {config.training.init_from} frozen (reference \"model\")")
    return (f"data: DPO on {len(pairs):,} preference pairs of {pairs.prefix} ({2 * len(pairs):,} sequences), "
            f"reshuffled every epoch; a global batch of {batch} sequences is {batch // 2} pairs, rows 2i chosen and "
            f"2i + 1 rejected of every micro-batch, padded to {config.model.seq_length + 1} tokens; reference "
            f"log-probs {source}")


def compute_reference_logps(pipeline: Any, pairs: Any, batch_size: int, progress: bool = False) -> np.ndarray:
    """Collective over the world: every sequence's summed completion log-prob under ``pipeline``'s model (evaluation/
    pipeline.py, any TP x PP x DP), fp32 (2n,) in document order, on every rank. Each sequence is padded to the
    model's seq_length + 1 tokens (mask 0 on the padding) and summed as DPOLoss sums the policy's (training/dpo.py
    sequence_logps); the batches are dealt to the DP replicas in turn."""
    from tqdm.auto import tqdm

    from training.dpo import sequence_logps

    ctx, seq_length = pipeline.ctx, pipeline.config.seq_length
    rows = PreferenceRows(pairs, np.zeros(0, np.float32), seq_length, seed=0, rows=2 * len(pairs), pad_token_id=0)
    sequences = 2 * len(pairs)
    check_lengths(pairs.prefix, seq_length, "the reference checkpoint's model.seq_length")
    batches = list(range(0, sequences, batch_size))
    mine = batches[ctx.data_parallel_rank::ctx.data_parallel_size]
    device, found = pipeline.stage.device, {}
    bar = tqdm(total=sequences, desc="reference log-probs", unit="seq", file=sys.stdout,
               disable=not progress or dist.get_rank() != 0)
    with torch.no_grad():
        for start in mine:
            indices = range(start, min(start + batch_size, sequences))
            # document order: sequence k is side k % 2 of pair k // 2, read straight (no shuffle)
            tokens = torch.from_numpy(np.stack([rows.sequence(k // 2, k % 2, 0, 0, np.int64)  # host: read, then moved
                                                for k in indices]))
            masks = torch.from_numpy(np.stack([rows.sequence(k // 2, k % 2, 1, 0, np.uint8)  # host: read, then moved
                                               for k in indices]))
            tokens, masks = tokens.to(device), masks.to(device)
            positions = torch.arange(seq_length, device=device).expand(len(indices), -1)
            logits = pipeline.logits(tokens[:, :-1], positions)
            if logits is not None and pipeline.is_result_rank:
                _, logps = sequence_logps(logits, tokens[:, 1:], masks[:, 1:], ctx)
                found.update(zip(indices, logps.float().cpu().tolist(), strict=True))
            bar.update(len(indices) * ctx.data_parallel_size)
    bar.close()
    shared = pipeline.share(found)
    return np.array([shared[k] for k in range(sequences)], dtype=np.float32)


class ReferenceModel:
    """training.dpo.reference "model": the checkpoint the policy starts from (training.init_from), frozen, on the
    same ranks, at the run's TP x PP (its own stages, eval mode, the training precision, sequence parallelism off),
    run forward over each step's micro-batches before the step (evaluation/pipeline.py: stage to stage, one
    micro-batch at a time). It costs a forward of every micro-batch and one more copy of the stage's weights (no
    gradients, no optimizer state); the log-probs are summed as the policy's (training/dpo.py sequence_logps)."""

    def __init__(self, config: Any) -> None:
        """Collective: every rank (it builds the reference's TP groups)."""
        from evaluation.loading import load_pipeline
        from hf.tables import PRECISION_DTYPES
        from model.config import ParallelConfig

        parallel = config.parallelism
        self.pipeline, self.checkpoint = load_pipeline(
            config.training.init_from, None, ParallelConfig(parallel.tensor_parallel_size,
                                                            parallel.pipeline_parallel_size,
                                                            partition_method=parallel.partition_method),
            PRECISION_DTYPES[config.model.precision])

    def fill(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """Collective over this rank's replica: the step's micro-batches, their last-stage reference log-probs (b,)
        computed (the other stages do not read them and keep the loader's)."""
        from training.dpo import sequence_logps

        filled = []
        with torch.no_grad():
            for inputs, (labels, loss_mask, reference) in micro_batches:
                logits = self.pipeline.logits(inputs[0], inputs[1])  # (b, s, V/TP) on the last stage, else None
                if logits is not None:
                    reference = sequence_logps(logits, labels, loss_mask, self.pipeline.ctx)[1].float()
                filled.append((inputs, (labels, loss_mask, reference)))
        return filled
