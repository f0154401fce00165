"""The command-line tools: merge (datasets and shards) and inspect (preprocess and train_tokenizer are tested with
their libraries)."""

from __future__ import annotations

import numpy as np

from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from data.summary import describe, length_histogram


def write(prefix: str, documents: list[list[int]]) -> None:
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for document in documents:
            builder.add_item(document)
            builder.end_document()


def test_merge_tool_from_a_directory_in_name_order(tmp_path, capsys) -> None:
    from tools.merge_datasets import main

    (tmp_path / "shards").mkdir()
    write(str(tmp_path / "shards" / "b"), [[3, 4]])
    write(str(tmp_path / "shards" / "a"), [[1], [2]])
    assert main(["--input", str(tmp_path / "shards"), "--output-prefix", str(tmp_path / "all")]) == 0
    merged = IndexedDataset(tmp_path / "all")
    assert [merged[i].tolist() for i in range(3)] == [[1], [2], [3, 4]]
    assert "3 documents, 3 sequences, 4 tokens (uint16)" in capsys.readouterr().out
    assert main(["--input", str(tmp_path / "shards" / "a"), str(tmp_path / "nope"),
                 "--output-prefix", str(tmp_path / "x")]) == 1
    assert "nope.idx does not exist" in capsys.readouterr().err


def test_merge_tool_shards_mode_refuses_what_is_not_one_run(tmp_path, capsys) -> None:
    from data.preprocess import PreprocessConfig, preprocess
    from tools.merge_datasets import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "Hello world"}\n{"text": "Hi"}\n{"text": "Hello"}\n')
    prefix = str(tmp_path / "out")
    assert main(["--shards", prefix]) == 1
    assert "no shard manifests" in capsys.readouterr().err
    preprocess(PreprocessConfig(input=str(corpus), output_prefix=prefix, shard=(1, 2), progress=False))
    assert main(["--shards", prefix]) == 1
    assert "1 of 2 shards are missing or incomplete (no manifest: out-shard00000of00002" in capsys.readouterr().err
    preprocess(PreprocessConfig(input=str(corpus), output_prefix=prefix, shard=(0, 2), progress=False))
    assert main(["--shards", prefix]) == 0
    assert "3 documents, 3 sequences, 4 tokens (uint16)" in capsys.readouterr().out
    assert [IndexedDataset(f"{prefix}_text_document")[i].tolist() for i in range(3)] == [[15496, 995], [17250], [15496]]
    assert main(["--input", prefix + "_text_document"]) == 1
    assert "--input needs --output-prefix" in capsys.readouterr().err


def test_inspect_tool_counts_histogram_and_decodes(tmp_path, capsys) -> None:
    from tools.inspect_dataset import main

    write(str(tmp_path / "d"), [[15496, 995, 50256], [17250] * 9, []])
    assert main([str(tmp_path / "d"), "--document", "0", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "documents: 3" in out and "tokens: 12" in out and "max_token_id: 50256" in out
    assert "Hello world<|endoftext|>" in out
    with open(tmp_path / "d.idx", "r+b") as stream:
        stream.write(b"garbage")
    assert main([str(tmp_path / "d")]) == 1
    assert "bad magic" in capsys.readouterr().err


def test_summary_statistics_and_histogram(tmp_path) -> None:
    write(str(tmp_path / "s"), [[1] * 3, [2] * 4, [3] * 100, []])
    stats = describe(IndexedDataset(tmp_path / "s"))
    assert (stats["documents"], stats["tokens"], stats["document_tokens_max"], stats["document_tokens_min"]) == (
        4, 107, 100, 0)
    assert length_histogram(np.array([0, 3, 4, 100])) == [(0, 1, 1), (2, 4, 1), (4, 8, 1), (64, 128, 1)]
