"""The loader: Megatron's sampler rule per data-parallel rank, DeepSpeed's tuple, exact resume, the vocabulary check,
and the device prefetcher (a pass-through on CPU; on CUDA the next micro-batch's copy is issued first)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.loader import DevicePrefetcher, MicroBatchLoader, check_token_ids_fit, map_tensors
from training.faults import FaultPlan, FaultyLoader

SEQ_LENGTH = 6


class Counting:
    """Sample i is [i * 100, i * 100 + 1, ..., i * 100 + seq_length]: batches show which samples they hold."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return index * 100 + np.arange(SEQ_LENGTH + 1, dtype=np.int64)


def sample_ids(micro_batch) -> list[int]:
    (tokens, _), _ = micro_batch
    return (tokens[:, 0] // 100).tolist()


def test_micro_batch_tuple_shapes_and_contents() -> None:
    loader = MicroBatchLoader(Counting(100), micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1)
    (tokens, position_ids), (labels, loss_mask) = next(loader)
    assert tokens.shape == position_ids.shape == labels.shape == loss_mask.shape == (2, SEQ_LENGTH)
    assert (tokens.dtype, position_ids.dtype, labels.dtype, loss_mask.dtype) == (torch.int64,) * 3 + (torch.float32,)
    assert tokens[1].tolist() == [100, 101, 102, 103, 104, 105]
    assert labels[1].tolist() == [101, 102, 103, 104, 105, 106]
    assert position_ids.tolist() == [list(range(SEQ_LENGTH))] * 2
    assert loss_mask.sum().item() == 2 * SEQ_LENGTH
    assert all(t.is_contiguous() for t in (tokens, position_ids, labels, loss_mask))


def test_megatron_sampler_rule_for_every_rank() -> None:
    micro_batch_size, data_parallel_size, consumed = 3, 4, 24
    for rank in range(data_parallel_size):
        loader = MicroBatchLoader(Counting(1000), micro_batch_size, rank, data_parallel_size, consumed)
        for k in range(5):
            first = consumed + k * micro_batch_size * data_parallel_size + rank * micro_batch_size
            assert sample_ids(next(loader)) == list(range(first, first + micro_batch_size))
        assert loader.consumed_samples == consumed + 5 * micro_batch_size * data_parallel_size


def test_ranks_together_read_each_sample_once() -> None:
    loaders = [MicroBatchLoader(Counting(48), 2, rank, 3) for rank in range(3)]
    seen = [i for loader in loaders for batch in loader for i in sample_ids(batch)]
    assert sorted(seen) == list(range(48))


@pytest.mark.parametrize("data_parallel_size", [1, 2, 4])
def test_resume_after_n_samples_equals_an_uninterrupted_run_for_every_rank(data_parallel_size) -> None:
    dataset, micro_batch_size, stop_after = Counting(400), 2, 7  # micro-batches before the "checkpoint"
    for rank in range(data_parallel_size):
        uninterrupted = MicroBatchLoader(dataset, micro_batch_size, rank, data_parallel_size)
        expected = [next(uninterrupted) for _ in range(stop_after + 10)][stop_after:]
        first_run = MicroBatchLoader(dataset, micro_batch_size, rank, data_parallel_size)
        for _ in range(stop_after):
            next(first_run)
        state = first_run.state_dict()
        assert state == {"consumed_samples": stop_after * micro_batch_size * data_parallel_size}
        resumed = MicroBatchLoader(dataset, micro_batch_size, rank, data_parallel_size)
        resumed.load_state_dict(state)
        constructed = MicroBatchLoader(dataset, micro_batch_size, rank, data_parallel_size, state["consumed_samples"])
        for want, got, also in zip(expected, [next(resumed) for _ in range(10)], [next(constructed) for _ in range(10)],
                                   strict=True):
            for a, b, c in zip([*want[0], *want[1]], [*got[0], *got[1]], [*also[0], *also[1]], strict=True):
                assert torch.equal(a, b) and torch.equal(a, c)


def test_resume_with_a_different_data_parallel_size_continues_the_global_order() -> None:
    before = MicroBatchLoader(Counting(200), 2, 0, 2)
    for _ in range(3):
        next(before)  # 12 samples consumed by the two ranks
    after = [MicroBatchLoader(Counting(200), 1, rank, 4, before.consumed_samples) for rank in range(4)]
    assert [sample_ids(next(loader)) for loader in after] == [[12], [13], [14], [15]]


def test_resume_on_a_real_gpt_dataset(tmp_path) -> None:
    prefix = str(tmp_path / "docs")
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for document in range(20):
            builder.add_item(np.arange(document * 10, document * 10 + 7 + document % 5))
            builder.end_document()
    dataset = GPTDataset(IndexedDataset(prefix), (0, 20), SEQ_LENGTH, 30, seed=2)
    whole = [next(MicroBatchLoader(dataset, 2, 1, 2, consumed)) for consumed in (0, 4, 8, 12)]
    resumed = MicroBatchLoader(dataset, 2, 1, 2, consumed_samples=8)
    assert torch.equal(next(resumed)[0][0], whole[2][0][0])
    assert torch.equal(next(resumed)[1][0], whole[3][1][0])


def test_eod_mask_loss_masks_what_megatron_lm_masks() -> None:
    """Where the input token is the end of a document, the prediction that crosses into the next one: the positions
    of Megatron-LM's own _get_ltor_masks_and_position_ids (megatron-core) on the same tokens. The end-of-document
    token stays a label that is learnt."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    class WithEod(Counting):
        def __getitem__(self, index: int) -> np.ndarray:
            sample = super().__getitem__(index)
            sample[[2, 5]] = 50256
            return sample

    (tokens, _), (labels, loss_mask) = next(MicroBatchLoader(WithEod(10), 1, 0, 1, eod_mask_loss=True,
                                                              eod_token_id=50256))
    assert tokens[0].tolist() == [0, 1, 50256, 3, 4, 50256] and labels[0].tolist() == [1, 50256, 3, 4, 50256, 6]
    assert loss_mask[0].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    _, megatron, _ = _get_ltor_masks_and_position_ids(tokens[0], 50256, reset_position_ids=False,
                                                      reset_attention_mask=False, eod_mask_loss=True,
                                                      create_attention_mask=False)
    assert torch.equal(loss_mask[0], megatron.float())
    (_, _), (_, unmasked) = next(MicroBatchLoader(WithEod(10), 1, 0, 1))
    assert unmasked[0].tolist() == [1.0] * SEQ_LENGTH


def test_stops_before_running_past_the_end() -> None:
    loader = MicroBatchLoader(Counting(10), 2, 1, 2)  # 4 samples per micro-batch: 2 full micro-batches
    assert [sample_ids(batch) for batch in loader] == [[2, 3], [6, 7]]
    assert loader.consumed_samples == 8


def test_argument_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        MicroBatchLoader(Counting(10), 1, 2, 2)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        MicroBatchLoader(Counting(10), 0, 0, 1)
    with pytest.raises(ValueError, match="eod_mask_loss needs eod_token_id"):
        MicroBatchLoader(Counting(10), 1, 0, 1, eod_mask_loss=True)


def test_start_up_check_of_token_ids_against_the_vocabulary(tmp_path) -> None:
    prefix = str(tmp_path / "wide_ids")
    with IndexedDatasetBuilder(prefix, np.int32) as builder:
        builder.add_item(np.array([1, 2, 60000] + list(range(40))))
        builder.end_document()
    dataset = GPTDataset(IndexedDataset(prefix), (0, 1), SEQ_LENGTH, 3, seed=0)
    check_token_ids_fit(dataset, 60001)
    with pytest.raises(ValueError, match=r"wide_ids\.bin: token id 60000 does not fit the model's vocabulary of 51200"):
        check_token_ids_fit(dataset, 51200)


def flat(micro_batch) -> list[torch.Tensor]:
    (tokens, position_ids), (labels, loss_mask) = micro_batch
    return [tokens, position_ids, labels, loss_mask]


def test_on_cpu_the_prefetcher_yields_the_loaders_micro_batches_unchanged() -> None:
    expected = list(MicroBatchLoader(Counting(50), 2, 1, 2, consumed_samples=8))
    prefetcher = DevicePrefetcher.for_device(MicroBatchLoader(Counting(50), 2, 1, 2, consumed_samples=8),
                                             torch.device("cpu"))
    assert prefetcher.transfer is None
    got = list(prefetcher)
    assert len(got) == len(expected) == 10
    assert all(torch.equal(a, b) and a.dtype == b.dtype
               for x, y in zip(got, expected, strict=True) for a, b in zip(flat(x), flat(y), strict=True))
    assert prefetcher.consumed_samples == 48


def test_the_next_micro_batch_is_transferred_before_the_current_one_is_returned() -> None:
    events = []

    def transfer(micro_batch):  # stands for pin_memory() + .to("cuda", non_blocking=True)
        events.append(("transfer", sample_ids(micro_batch)[0]))
        return map_tensors(torch.clone, micro_batch)

    loader = MicroBatchLoader(Counting(10), 2, 0, 1)  # 5 micro-batches: samples 0-1, 2-3, ..., 8-9
    prefetcher = DevicePrefetcher(loader, transfer)
    assert prefetcher.consumed_samples == 0 and events == []  # nothing is read before the first next()
    positions = []
    for micro_batch in prefetcher:
        positions.append(prefetcher.consumed_samples)
        events.append(("returned", sample_ids(micro_batch)[0]))
    assert events == [("transfer", 0), ("transfer", 2), ("returned", 0), ("transfer", 4), ("returned", 2),
                      ("transfer", 6), ("returned", 4), ("transfer", 8), ("returned", 6), ("returned", 8)]
    assert positions == [2, 4, 6, 8, 10]  # the next micro-batch it returns, though the loader is one ahead
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_faults_see_the_same_data_positions_through_the_prefetcher() -> None:
    plan = FaultPlan(garbage_samples=[6, 10])
    plain = list(FaultyLoader(MicroBatchLoader(Counting(20), 2, 0, 1), plan, vocab_size=100_000))
    prefetched = list(FaultyLoader(DevicePrefetcher(MicroBatchLoader(Counting(20), 2, 0, 1),
                                                    lambda batch: map_tensors(torch.clone, batch)),
                                   plan, vocab_size=100_000))
    garbage = [bool((flat(batch)[0] >= 100_000 - 256).all()) for batch in prefetched]
    assert garbage == [False, False, False, True, True, False, False, False, False, False]
    assert all(torch.equal(a, b) for x, y in zip(prefetched, plain, strict=True) for a, b in zip(flat(x), flat(y), strict=True))
