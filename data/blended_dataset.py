"""Blending several datasets by weights, with exact proportions.

Which dataset sample n comes from is decided so that, for every dataset k and every prefix of n samples, the count
c_k(n) stays within one of weight_k * n. Megatron's greedy rule (pick the largest weight_k * n - c_k) does not
guarantee this: its error exceeds one sample for some weights (10/9 for 7:1:1, ~1.8 with eight datasets). We use
Tijdeman's chairman-assignment rule (R. Tijdeman, "The chairman assignment problem", Discrete Math. 32, 1980),
which guarantees |c_k(n) - weight_k * n| <= 1 - 1/(2K - 2) for K datasets: at slot n, among the datasets whose
deficit weight_k * n - c_k is at least s = 1/(2K - 2), take the one whose deficit would soonest reach 1 - s.

The rule is sequential; it is vectorised over blocks of slots run side by side, each block started from a warm-up
(see :func:`build_blending_indices`), and checked to agree exactly with the sequential run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from data.index_cache import IndexCache

BLEND_INDEX_VERSION = 1
_TOLERANCE = 1e-9  # float slack on the eligibility test; deficits are exact to ~1e-8 at 1e8 samples


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights as float64 summing to 1; ValueError for negative, non-finite or all-zero weights."""
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)) or np.any(array < 0) or array.sum() <= 0:
        raise ValueError(f"blend weights must be finite, >= 0 and not all zero; got {list(weights)}")
    return array / array.sum()


def _deadline_keys(counts: np.ndarray, weights: np.ndarray, threshold: float, index_bits: int) -> np.ndarray:
    """int64 keys ordering datasets by the slot at which their deficit reaches 1 - s, ties to the lower index.

    The bit pattern of a positive float64 orders like the float; its lowest ``index_bits`` mantissa bits (a relative
    2**-44 or less) are replaced by the dataset index. counts: (K, B); weights: (K, 1).
    """
    deadline = (counts + (1.0 - threshold)) / weights
    dataset = np.broadcast_to(np.arange(counts.shape[0]).reshape(-1, 1), counts.shape)
    return (deadline.view(np.int64) & ~np.int64((1 << index_bits) - 1)) | dataset


def _release_slots(counts: np.ndarray, weights: np.ndarray, threshold: float) -> np.ndarray:
    """int64 first slot n at which a dataset is eligible: weights * n - counts >= s."""
    return np.ceil((counts + threshold - _TOLERANCE) / weights).astype(np.int64)


def _run_blocks(weights: np.ndarray, counts: np.ndarray, first_slot: np.ndarray, steps: int,
                chosen: np.ndarray | None = None, taken: np.ndarray | None = None) -> None:
    """Run the chairman rule for ``steps`` slots in each block, side by side.

    weights: (K,) positive, summing to 1. counts: (B, K) int64 samples taken before ``first_slot``, updated in
    place. first_slot: (B,) the 1-based slot each block starts at. When given, chosen (B, steps) receives the dataset
    of each slot and taken (B, steps) how many samples that dataset had given before it.
    """
    num_datasets, num_blocks = weights.size, counts.shape[0]
    threshold = 1.0 / (2 * num_datasets - 2)
    index_bits = max(1, int(num_datasets - 1).bit_length())
    column = weights.reshape(-1, 1)
    state = np.ascontiguousarray(counts.T)  # (K, B): reductions over datasets run along axis 0, row by row
    release = _release_slots(state, column, threshold)
    keys = _deadline_keys(state.astype(np.float64), column, threshold, index_bits)
    flat_state, flat_release, flat_keys = state.reshape(-1), release.reshape(-1), keys.reshape(-1)
    slot, blocks = first_slot.astype(np.int64).copy(), np.arange(num_blocks)
    low_bits, never = np.int64((1 << index_bits) - 1), np.iinfo(np.int64).max
    buffer = 256  # slots recorded row-wise, then written to the (B, steps) outputs a tile at a time (cache-friendly)
    chosen_rows = np.empty((buffer, num_blocks), dtype=np.int64)
    taken_rows = np.empty((buffer, num_blocks), dtype=np.int64)
    for step in range(steps):
        smallest = np.where(release <= slot, keys, never).min(axis=0)  # (B,)
        pick = smallest & low_bits
        flat = pick * num_blocks + blocks
        before = flat_state[flat]
        flat_state[flat] = before + 1
        after = (before + 1).astype(np.float64)
        flat_release[flat] = np.ceil((after + threshold - _TOLERANCE) / weights[pick])
        deadline = (after + (1.0 - threshold)) / weights[pick]
        flat_keys[flat] = (deadline.view(np.int64) & ~low_bits) | pick
        chosen_rows[step % buffer], taken_rows[step % buffer] = pick, before
        if chosen is not None and (step % buffer == buffer - 1 or step == steps - 1):
            first = step - step % buffer
            chosen[:, first : step + 1] = chosen_rows[: step + 1 - first].T
            taken[:, first : step + 1] = taken_rows[: step + 1 - first].T
        slot += 1
    if chosen is not None and steps and chosen.max() >= num_datasets:
        raise AssertionError("blending: a slot found no eligible dataset (cannot happen for weights summing to 1)")
    counts[:] = state.T


def _hamilton_counts(weights: np.ndarray, num_samples: np.ndarray) -> np.ndarray:
    """(B, K) largest-remainder counts for each total in num_samples: a good guess of the state at a block start."""
    ideal = weights * num_samples[:, None].astype(np.float64)
    counts = np.floor(ideal)
    missing = (num_samples - counts.sum(axis=1)).astype(np.int64)
    order = np.argsort(counts - ideal, axis=1, kind="stable")  # largest remainder first
    ranks = np.argsort(order, axis=1, kind="stable")
    return (counts + (ranks < missing[:, None])).astype(np.int64)


def build_blending_indices(
    weights: Sequence[float], num_samples: int, block_size: int = 32768, warmup: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, each blended sample is.

    Returns dataset_index (num_samples,) uint8 (int16 past 255 datasets) and dataset_sample_index (num_samples,)
    int64, the running count of that dataset. The result is identical to the sequential rule for any block size:
    every block starts from a guessed state (largest remainders) and warms up for ``warmup`` slots; blocks whose
    start state differs from the end state of the block before are re-run from that state until all agree.
    """
    weights = normalize_weights(weights)
    index_dtype = np.uint8 if weights.size <= 255 else np.int16
    active = np.flatnonzero(weights > 0)
    if active.size == 1 or num_samples == 0:
        return np.full(num_samples, active[0], dtype=index_dtype), np.arange(num_samples, dtype=np.int64)
    chosen, taken = _blend_active(weights[active], num_samples, block_size, warmup)
    dataset_index = chosen if active.size == weights.size else active[chosen]
    return dataset_index.astype(index_dtype, copy=False), taken


def _blend_active(weights: np.ndarray, num_samples: int, block_size: int, warmup: int) -> tuple[np.ndarray, np.ndarray]:
    block_size = min(block_size, num_samples)
    num_blocks = -(-num_samples // block_size)
    starts = np.arange(num_blocks, dtype=np.int64) * block_size  # samples before each block
    warm_starts = np.maximum(starts - warmup, 0)
    counts = _hamilton_counts(weights, warm_starts)
    _run_warmup(weights, counts, warm_starts, starts - warm_starts)
    start_counts = counts.copy()
    chosen = np.empty((num_blocks, block_size), dtype=np.int16 if weights.size > 255 else np.uint8)
    taken = np.empty((num_blocks, block_size), dtype=np.int64)
    _run_blocks(weights, counts, starts + 1, block_size, chosen, taken)
    end_counts = counts
    while True:
        mismatched = np.flatnonzero(np.any(start_counts[1:] != end_counts[:-1], axis=1)) + 1
        if mismatched.size == 0:
            break
        start_counts[mismatched] = end_counts[mismatched - 1]
        state = start_counts[mismatched].copy()
        rerun_chosen, rerun_taken = chosen[mismatched], taken[mismatched]
        _run_blocks(weights, state, starts[mismatched] + 1, block_size, rerun_chosen, rerun_taken)
        chosen[mismatched], taken[mismatched], end_counts[mismatched] = rerun_chosen, rerun_taken, state
    return chosen.reshape(-1)[:num_samples], taken.reshape(-1)[:num_samples]


def _run_warmup(weights: np.ndarray, counts: np.ndarray, warm_starts: np.ndarray, warm_steps: np.ndarray) -> None:
    """Advance each block's guessed state to its start; blocks with fewer warm-up slots (near 0) run alone."""
    longest = int(warm_steps.max(initial=0))
    full = warm_steps == longest
    if longest:
        advanced = counts[full]  # boolean indexing copies: write the advanced state back
        _run_blocks(weights, advanced, warm_starts[full] + 1, longest)
        counts[full] = advanced
    for block in np.flatnonzero(~full & (warm_steps > 0)):
        state = counts[block : block + 1].copy()
        _run_blocks(weights, state, warm_starts[block : block + 1] + 1, int(warm_steps[block]))
        counts[block] = state[0]


class BlendedDataset:
    """Samples drawn from several datasets in the proportions of their weights (see the module docstring).

    datasets: each with __len__ and __getitem__. dataset_index / dataset_sample_index: (n,) from
    :func:`build_blending_indices`; dataset k must hold at least as many samples as it is asked for.
    """

    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
        self.datasets = list(datasets)
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index
        needed = np.bincount(dataset_index, minlength=len(self.datasets))
        if needed.size > len(self.datasets):
            raise ValueError(f"blended dataset: the index names dataset {needed.size - 1}, "
                             f"only {len(self.datasets)} are given")
        for k, dataset in enumerate(self.datasets):
            if needed[k] > len(dataset):
                raise ValueError(f"blended dataset: dataset {k} has {len(dataset)} samples, {needed[k]} are needed")

    @classmethod
    def from_weights(cls, datasets: Sequence, weights: Sequence[float], num_samples: int,
                     cache: IndexCache | None = None) -> BlendedDataset:
        """Blend ``num_samples`` samples of datasets by weights (indices from the cache when it holds them)."""
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        return cls(datasets, *load_or_build_blending_indices(normalize_weights(weights), num_samples, cache))

    def __len__(self) -> int:
        return self.dataset_index.size

    def __getitem__(self, index: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]

    def sample_loss_mask(self, index: int) -> np.ndarray | None:
        """The loss-mask bits of ``self[index]`` from its dataset (GPTDataset.sample_loss_mask), None when that
        dataset has no mask: a blend may mix datasets with and without masks."""
        masks = getattr(self.datasets[int(self.dataset_index[index])], "sample_loss_mask", None)
        return None if masks is None else masks(int(self.dataset_sample_index[index]))

    def sample_documents(self, index: int) -> np.ndarray | None:
        """Each token's document in ``self[index]``, from its dataset (GPTDataset.sample_documents); None when that
        dataset cannot tell."""
        documents = getattr(self.datasets[int(self.dataset_index[index])], "sample_documents", None)
        return None if documents is None else documents(int(self.dataset_sample_index[index]))


def load_or_build_blending_indices(weights: np.ndarray, num_samples: int, cache: IndexCache | None,
                                   dataset_keys: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Blending indices from the cache (see IndexCache.load_or_build), or built in memory without one.

    The indices depend only on the normalized weights and the number of samples; dataset_keys (e.g. the prefixes)
    only label the cache's record for people.
    """
    description = {"class": "BlendedDataset", "version": BLEND_INDEX_VERSION, "weights": weights.tolist(),
                   "num_samples": int(num_samples)}
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]
    def build() -> dict[str, np.ndarray]:
        dataset_index, dataset_sample_index = build_blending_indices(weights, num_samples)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    if cache is None:
        arrays = build()
    else:
        arrays, _ = cache.load_or_build(key, ("dataset_index", "dataset_sample_index"), build,
                                        {**description, "datasets": list(dataset_keys)})
    return arrays["dataset_index"], arrays["dataset_sample_index"]
