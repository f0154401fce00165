"""tools/preprocess_data.py: Megatron's bytes on both tokenizer backends, every key finalized, streaming workers, the
two rules for <|endoftext|> inside a document, and every kind of bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset
from data.preprocess import BadInputError, PreprocessConfig, preprocess
from tests.test_data_reference import reference_bin_bytes, reference_gpt2_encode, reference_idx_bytes
from tests.test_data_tokenizers import BACKENDS, CORPUS, corpus_texts

EOD = 50256


def write_jsonl(path, records: list) -> str:
    with open(path, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def run(tmp_path, input_path: str, **options) -> tuple[object, str]:
    prefix = str(tmp_path / "out")
    config = PreprocessConfig(input=input_path, output_prefix=prefix, progress=False, **options)
    return preprocess(config), prefix


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workers", [1, 2])
def test_corpus_bytes_equal_megatrons_layout_with_append_eod(tmp_path, workers, backend) -> None:
    report, prefix = run(tmp_path, CORPUS, append_eod=True, workers=workers, batch_size=7, tokenizer_backend=backend)
    documents = [[reference_gpt2_encode(text) + [EOD]] for text in corpus_texts()]
    assert open(f"{prefix}_text_document.idx", "rb").read() == reference_idx_bytes(documents, 8, 2)
    assert open(f"{prefix}_text_document.bin", "rb").read() == reference_bin_bytes(documents, "H")
    assert (report.documents, report.tokens["text"], report.skipped, report.backend) == (84, 64832, 0, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_append_eod_no_eod_is_written(tmp_path, backend) -> None:
    path = write_jsonl(tmp_path / "two.jsonl", [{"text": "Hello world"}, {"text": "Hi"}])
    _, prefix = run(tmp_path, path, tokenizer_backend=backend)
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert [dataset[i].tolist() for i in range(2)] == [[15496, 995], [17250]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workers", [1, 2])
def test_end_of_text_inside_a_document_is_text_unless_parsed(tmp_path, backend, workers) -> None:
    path = write_jsonl(tmp_path / "eot.jsonl", [{"text": "Hello <|endoftext|> world"}, {"text": "Hi"}])
    as_text, prefix = run(tmp_path, path, append_eod=True, tokenizer_backend=backend, workers=workers)
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset[0].tolist() == [15496, 1279, 91, 437, 1659, 5239, 91, 29, 995, EOD]  # Megatron-DeepSpeed
    parsed, prefix = run(tmp_path, path, append_eod=True, tokenizer_backend=backend, workers=workers,
                         parse_special_tokens=True)
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset[0].tolist() == [15496, 220, 50256, 995, EOD]  # Megatron-LM: a boundary inside the document
    assert dataset[1].tolist() == [17250, EOD] and (as_text.backend, parsed.backend) == (backend, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_json_key_is_finalized(tmp_path, backend) -> None:
    path = write_jsonl(tmp_path / "keys.jsonl", [{"title": "A", "text": "Hello world"}, {"title": "B", "text": "Hi"}])
    _, prefix = run(tmp_path, path, json_keys=("title", "text"), append_eod=True, tokenizer_backend=backend)
    title, text = IndexedDataset(f"{prefix}_title_document"), IndexedDataset(f"{prefix}_text_document")
    assert [title[i].tolist() for i in range(2)] == [[32, EOD], [33, EOD]]
    assert [text[i].tolist() for i in range(2)] == [[15496, 995, EOD], [17250, EOD]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_list_of_sentences_makes_one_sequence_each_with_eod_on_the_last(tmp_path, backend) -> None:
    path = write_jsonl(tmp_path / "sentences.jsonl", [{"text": ["Hello world", "", "Hi"]}, {"text": "Hello"}])
    _, prefix = run(tmp_path, path, append_eod=True, tokenizer_backend=backend)
    documents = [[[15496, 995], [17250, EOD]], [[15496, EOD]]]  # the empty sentence is dropped, as in Megatron
    assert open(f"{prefix}_text_document.idx", "rb").read() == reference_idx_bytes(documents, 8, 2)


def test_workers_batch_sizes_and_backends_give_identical_bytes(tmp_path) -> None:
    outputs = []
    for workers, batch_size, backend in [(1, 64, "tiktoken"), (2, 1, "tiktoken"), (2, 13, "tokenizers")]:
        directory = tmp_path / f"w{workers}b{batch_size}"
        directory.mkdir()
        _, prefix = run(directory, CORPUS, workers=workers, batch_size=batch_size, append_eod=True,
                        tokenizer_backend=backend)
        outputs.append(open(f"{prefix}_text_document.bin", "rb").read() + open(f"{prefix}_text_document.idx", "rb").read())
    assert outputs[0] == outputs[1] == outputs[2]


BAD_LINES = [
    ("{not json", r"bad\.jsonl:2: malformed JSON"),
    ('{"other": "x"}', r"bad\.jsonl:2: missing key 'text'"),
    ('{"text": 5}', r"bad\.jsonl:2: key 'text' holds int"),
    ('{"text": ""}', r"bad\.jsonl:2: empty document: key 'text' has no tokens"),
    ('["a list"]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ("", r"bad\.jsonl:2: blank line"),
    ('{"text": "\\ud800 lone surrogate"}', r"bad\.jsonl:2: text the tokenizer cannot encode"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
@pytest.mark.parametrize(("workers", "backend"), [(1, "tiktoken"), (2, "tiktoken"), (1, "tokenizers")])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, line, message, workers, backend) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "Hello"}, line, {"text": "world"}])
    with pytest.raises(BadInputError, match=message + r".*--skip-bad-lines"):
        run(tmp_path, path, workers=workers, tokenizer_backend=backend)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]  # nothing left behind


def test_invalid_utf8_is_an_error_naming_file_and_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(BadInputError, match=r"bad\.jsonl:2: invalid UTF-8 at byte offset 13"):
        run(tmp_path, str(path))


def test_skip_bad_lines_counts_and_keeps_keys_aligned(tmp_path) -> None:
    records = [{"a": "one", "b": "uno"}, {"a": "two"}, "{oops", {"a": "", "b": "tres"}, {"a": "four", "b": "cuatro"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    report, prefix = run(tmp_path, path, json_keys=("a", "b"), skip_bad_lines=True, workers=2, batch_size=2)
    assert (report.documents, report.skipped) == (2, 3)
    assert [example.split(": ")[0] for example in report.skipped_examples] == [f"{path}:{n}" for n in (2, 3, 4)]
    a, b = IndexedDataset(f"{prefix}_a_document"), IndexedDataset(f"{prefix}_b_document")
    assert (a.num_documents, b.num_documents) == (2, 2)
    assert "skipped 3 bad lines" in report.summary()


@pytest.mark.parametrize("workers", [1, 2])
def test_empty_input_is_an_error(tmp_path, workers) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(BadInputError, match=r"empty\.jsonl: the file is empty"):
        run(tmp_path, str(empty), workers=workers)
    all_bad = write_jsonl(tmp_path / "all_bad.jsonl", ['{"x": 1}'])
    with pytest.raises(BadInputError, match=r"all_bad\.jsonl: no documents"):
        run(tmp_path, all_bad, skip_bad_lines=True, workers=workers)
    assert sorted(os.listdir(tmp_path)) == ["all_bad.jsonl", "empty.jsonl"]


def test_parquet_and_saved_dataset_inputs(tmp_path) -> None:
    import datasets

    rows = {"text": ["Hello world", "Hi"], "meta": [1, 2]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))
    for source in ("rows.parquet", "saved"):
        directory = tmp_path / f"out_{source}"
        directory.mkdir()
        report, prefix = run(directory, str(tmp_path / source), append_eod=True)
        dataset = IndexedDataset(f"{prefix}_text_document")
        assert [dataset[i].tolist() for i in range(2)] == [[15496, 995, EOD], [17250, EOD]]
    missing = tmp_path / "missing_key"
    missing.mkdir()
    with pytest.raises(BadInputError, match=r"rows\.parquet: row 1: missing key 'body'"):
        run(missing, str(tmp_path / "rows.parquet"), json_keys=("body",))


def test_gzip_input(tmp_path) -> None:
    import gzip

    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as stream:
        stream.write(json.dumps({"text": "Hello world"}) + "\n")
    _, prefix = run(tmp_path, str(tmp_path / "c.jsonl.gz"))
    assert IndexedDataset(f"{prefix}_text_document")[0].tolist() == [15496, 995]


def test_other_tokenizers(tmp_path) -> None:
    from tests.test_data_tokenizers import save_gpt2_tokenizer_json

    save_gpt2_tokenizer_json(str(tmp_path / "tokenizer.json"))
    path = write_jsonl(tmp_path / "small.jsonl", [{"text": "Hello world"}])
    _, prefix = run(tmp_path, path, tokenizer_type="HuggingFaceTokenizer",
                    tokenizer_model=str(tmp_path / "tokenizer.json"), append_eod=True, workers=2)
    assert IndexedDataset(f"{prefix}_text_document")[0].tolist() == [15496, 995, EOD]


def test_config_errors_name_the_field(tmp_path) -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        PreprocessConfig(input=CORPUS, output_prefix="x", workers=0)
    with pytest.raises(ValueError, match="json_keys must be distinct"):
        PreprocessConfig(input=CORPUS, output_prefix="x", json_keys=("text", "text"))
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl does not exist"):
        PreprocessConfig(input=str(tmp_path / "nowhere.jsonl"), output_prefix="x")
    with pytest.raises(ValueError, match="tokenizer_backend 'fast'"):
        PreprocessConfig(input=CORPUS, output_prefix="x", tokenizer_backend="fast")


def test_tool_main_with_megatron_flags(tmp_path, capsys) -> None:
    from tools.preprocess_data import main

    prefix = str(tmp_path / "tool")
    code = main(["--input", CORPUS, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                 "--append-eod", "--workers", "2", "--dataset-impl", "mmap", "--no-progress"])
    assert code == 0
    assert "84 documents, 64832 tokens" in capsys.readouterr().out
    assert IndexedDataset(f"{prefix}_text_document").num_tokens == 64832
    assert main(["--input", CORPUS, "--output-prefix", f"{prefix}_hf", "--tokenizer-backend", "tokenizers",
                 "--no-progress"]) == 0
    assert "MB/s" in (out := capsys.readouterr().out) and "tokens/s) with tokenizers" in out
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{"])
    assert main(["--input", bad, "--output-prefix", prefix, "--no-progress"]) == 1
    assert "bad.jsonl:1: malformed JSON" in capsys.readouterr().err


def test_token_dtype_follows_the_vocabulary(tmp_path) -> None:
    _, prefix = run(tmp_path, CORPUS)
    assert IndexedDataset(f"{prefix}_text_document").dtype == np.uint16
