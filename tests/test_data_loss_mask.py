"""Training reads the loss masks of chat data: tools/preprocess_data.py writes {prefix}_loss_mask_document beside the
tokens, training/data.py finds it by name, GPTDataset cuts the sample's token span from it, and the loader yields the
label-aligned mask (the label at position i is token i + 1: its own bit), ANDed with eod_mask_loss.

The expected masks are computed here independently of the sample-cutting code: the documents of the shuffled
document index laid end to end, sample s = that stream's tokens [s * seq_length, (s + 1) * seq_length].
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data.blended_dataset import BlendedDataset
from data.gpt_dataset import GPTDataset
from data.indexed_dataset import IndexedDataset
from data.loss_mask import LossMaskMismatchError, loss_mask_prefix
from model.parallel import ParallelContext
from tests.launch import TWO_PROCESSES, final_weights, run_training, same_weights, trajectory
from tests.test_chat_data import CONVERSATIONS, TEMPLATES
from tools.preprocess_data import main

ROOT = Path(__file__).resolve().parents[1]
CHAT_DEMO = str(ROOT / "data" / "corpus" / "chat_demo.jsonl")
EOD = 50256
SEQ_LENGTH, MICRO_BATCH = 32, 4


def preprocess(source: str, prefix: Path) -> str:
    """tools/preprocess_data.py on chat jsonl with GPT-2's BPE (the tiny model's vocabulary: the template's special
    tokens are text) and the qwen-style template, whose {% generation %} blocks mark the replies; the tokens' prefix."""
    assert main(["--input", source, "--output-prefix", str(prefix), "--chat-template",
                 str(TEMPLATES / "qwen_style.jinja"), "--append-eod", "--no-progress"]) == 0
    return f"{prefix}_text_document"


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> str:
    return preprocess(CHAT_DEMO, tmp_path_factory.mktemp("chat") / "chat")


def copy_dataset(source: str, target: str) -> str:
    for suffix in (".bin", ".idx"):
        shutil.copyfile(source + suffix, target + suffix)
    return target


def run_config(blend: list, *overrides: str):
    from runconfig.run import load_run_config

    items = ", ".join(f"[{weight}, \"{prefix}\"]" for weight, prefix in blend)
    return load_run_config("ds_configs/tiny-cpu.json", [
        f"model.seq_length={SEQ_LENGTH}", f"train_micro_batch_size_per_gpu={MICRO_BATCH}", "train_batch_size=16",
        "schedule.train_tokens=4096", "schedule.warmup_tokens=512", "schedule.decay_tokens=4096",
        "schedule.batch.start=16", "data.split=\"1\"", "training.eval_iters=0", f"data.blend=[{items}]",
        f"data.cache_dir=\"{Path(blend[0][1]).parent / 'index-cache'}\"", *TWO_PROCESSES, *overrides])


def loader_of(config, consumed_samples: int = 0):
    """The train loader as training builds it (training/data.py), for DP rank 0 of 1."""
    from training.data import build_loader_factories

    train, _ = build_loader_factories(config, ParallelContext())
    return train(consumed_samples)


def expected_bits(dataset: GPTDataset, flat: np.ndarray, index: int) -> np.ndarray:
    """Bits of ``flat`` (a token or mask array of the dataset's .bin) over sample ``index``, from the document index
    and the shuffle index alone: the shuffled documents end to end, seq_length tokens per sample plus the next one."""
    indexed = dataset.indexed
    stream = np.concatenate([flat[indexed.document_start(int(d)) : indexed.document_start(int(d) + 1)]
                             for d in dataset.document_index])
    sample = int(dataset.shuffle_index[index])
    return stream[sample * SEQ_LENGTH : (sample + 1) * SEQ_LENGTH + 1]


def check_micro_batches(loader, parts, count: int, eod_mask_loss: bool = False) -> int:
    """Sample by sample: tokens and labels as the stream says, loss_mask = the mask bits shifted by one (ones for a
    dataset without masks), ANDed with input != eod under eod_mask_loss; returns how many masked samples were seen."""
    masked, index = 0, 0
    for _ in range(count):
        (tokens, _), (labels, loss_mask) = next(loader)
        for row in range(tokens.shape[0]):
            dataset, sample = parts(index)
            index += 1
            stream_tokens = expected_bits(dataset, dataset.indexed.tokens, sample)
            assert tokens[row].tolist() == stream_tokens[:-1].tolist()
            assert labels[row].tolist() == stream_tokens[1:].tolist()
            if dataset.loss_mask is None:
                want = np.ones(SEQ_LENGTH)
            else:
                want = expected_bits(dataset, dataset.loss_mask.tokens, sample)[1:].astype(np.float64)
                masked += 1
            if eod_mask_loss:
                want = want * (stream_tokens[:-1] != EOD)
            assert loss_mask[row].tolist() == want.tolist(), (index - 1, row)
    return masked


def test_the_loader_yields_each_labels_own_mask_bit(chat) -> None:
    loader = loader_of(run_config([[1.0, chat]]))
    dataset = loader.loader.dataset
    assert isinstance(dataset, GPTDataset) and dataset.loss_mask is not None
    assert dataset.loss_mask.prefix == loss_mask_prefix(chat)
    count = len(dataset) // MICRO_BATCH
    assert check_micro_batches(loader, lambda i: (dataset, i), count) == count * MICRO_BATCH
    (_, _), (_, first_mask) = next(loader_of(run_config([[1.0, chat]])))
    assert 0 < first_mask.sum() < first_mask.numel()


def test_resume_reads_the_same_masks(chat) -> None:
    """The mask is a function of the sample index: a loader started at a data position yields what a loader that
    ran up to it yields."""
    config = run_config([[1.0, chat]])
    whole = loader_of(config)
    batches = [next(whole) for _ in range(6)]
    resumed = loader_of(config, consumed_samples=4 * MICRO_BATCH)
    for want in batches[4:]:
        got = next(resumed)
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip((*want[0], *want[1]), (*got[0], *got[1]),
                                                                           strict=True))


def test_a_blend_with_a_dataset_without_masks_gives_it_ones(chat, tmp_path) -> None:
    plain = copy_dataset(chat, str(tmp_path / "plain_text_document"))  # the same tokens, no mask beside them
    loader = loader_of(run_config([[1.0, chat], [1.0, plain]]))
    blend = loader.loader.dataset
    assert isinstance(blend, BlendedDataset)
    assert [part.loss_mask is not None for part in blend.datasets] == [True, False]

    def parts(index: int) -> tuple[GPTDataset, int]:
        return blend.datasets[int(blend.dataset_index[index])], int(blend.dataset_sample_index[index])

    count = len(blend) // MICRO_BATCH
    masked = check_micro_batches(loader, parts, count)
    assert 0 < masked < count * MICRO_BATCH


def test_eod_mask_loss_ands_with_the_mask(chat) -> None:
    config = run_config([[1.0, chat]], "data.eod_mask_loss=true", f"data.eod_token_id={EOD}")
    loader = loader_of(config)
    dataset = loader.loader.dataset
    check_micro_batches(loader, lambda i: (dataset, i), len(dataset) // MICRO_BATCH, eod_mask_loss=True)


def test_a_mask_dataset_that_does_not_match_is_refused(chat, tmp_path) -> None:
    from training.data import build_loader_factories, check_datasets

    records = tmp_path / "other.jsonl"
    records.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    other = preprocess(str(records), tmp_path / "other")
    bad = copy_dataset(chat, str(tmp_path / "bad_text_document"))
    copy_dataset(loss_mask_prefix(other), loss_mask_prefix(bad))  # another run's mask beside these tokens
    config = run_config([[1.0, bad]])
    pattern = (r"the loss mask .*bad_loss_mask_document.idx does not match the tokens .*bad_text_document.idx: "
               r"3 documents in the mask, \d+ in the tokens.*re-run .*move .*bad_loss_mask_document.bin/.idx away")
    with pytest.raises(LossMaskMismatchError, match=pattern):
        check_datasets(config)
    with pytest.raises(LossMaskMismatchError, match=pattern):
        build_loader_factories(config, ParallelContext())
    assert len(IndexedDataset(bad).document_lengths()) > 3


SFT = ["training.loss_normalization=\"tokens\"", "training.save_interval=0", "model.seq_length=256",
       "schedule.warmup_tokens=1024", "schedule.batch.start=8", "schedule.batch.increment=8",
       "schedule.train_tokens=20480", "schedule.decay_tokens=20480",
       "data.packing=\"bfd\"", "data.reset_attention_mask=true", "data.reset_position_ids=true"]


def test_packed_chat_training_resumes_exactly_in_the_middle_of_an_epoch(chat, tmp_path) -> None:
    """train.py, 2 processes (PP 2), on the chat data as fine-tuning runs it: whole conversations packed best-fit
    decreasing into samples of 257 tokens (29 per epoch of the train split), document masks and reset positions, the
    loss over the step's target tokens. Steps take 8, 16, 16 samples: the second epoch starts inside step 3.
    Stopped after step 2 (24 samples: the middle of the first epoch) and resumed, the run equals the straight one
    bitwise, weights included."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    result = run_training(Path(chat), straight, max_steps=3, processes=2, extra=SFT)
    assert f"loss mask of {chat}: {loss_mask_prefix(chat)}" in result.stdout
    assert re.search(r"packing bfd \(train, .*chat_text_document\): \d+ packed samples of 257 tokens in \d+ "
                     r"epoch\(s\) \(29 per epoch\), 9\d\.\d% tokens",
                     result.stdout), result.stdout[-3000:]
    run_training(Path(chat), stopped, max_steps=2, processes=2, extra=SFT)
    resumed = run_training(Path(chat), stopped, max_steps=3, processes=2, extra=SFT)
    assert "at step 2" in resumed.stdout
    assert trajectory(stopped) == trajectory(straight)  # bitwise: losses, learning rates, batches, tokens
    assert same_weights(final_weights(stopped), final_weights(straight))
    losses = [loss for _, loss, *_ in trajectory(straight)]
    assert [batch for _, _, _, batch, *_ in trajectory(straight)] == [8, 16, 16]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses


def test_packed_conversations_get_their_documents(chat) -> None:
    """data.reset_attention_mask / reset_position_ids on chat data (each conversation closed by the end token):
    the loader training builds yields each token's conversation and its position in it, through the fault wrapper
    the trainer puts around it, beside the same tokens and masks as without."""
    from data.loader import documents
    from training.faults import FaultPlan, FaultyLoader

    plain = loader_of(run_config([[1.0, chat]], f"data.eod_token_id={EOD}"))
    packed = FaultyLoader(loader_of(run_config([[1.0, chat]], f"data.eod_token_id={EOD}",
                                               "data.reset_attention_mask=true", "data.reset_position_ids=true")),
                          FaultPlan(), vocab_size=50304)
    conversations = 0
    for ((tokens, positions), labels), ((same_tokens, reset, segment_ids), same_labels) in zip(plain, packed, strict=True):
        assert torch.equal(tokens, same_tokens) and all(map(torch.equal, labels, same_labels))
        expected_segments, expected_positions = documents(tokens, EOD)
        assert torch.equal(segment_ids, expected_segments) and torch.equal(reset, expected_positions)
        assert torch.equal(positions, torch.arange(SEQ_LENGTH).expand_as(tokens))
        conversations += int((tokens == EOD).sum())
    assert conversations > 10
