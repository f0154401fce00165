"""Several inputs, --shard K/N and the merge: sharded then merged is byte for byte one run over all the inputs, and a
missing, failed, stale or altered shard stops the merge instead of giving a dataset that looks complete."""

from __future__ import annotations

import gzip
import json
import os
import random

import pytest

from data import sharding
from data.preprocess import BadInputError, PreprocessConfig, preprocess
from data.sharding import ShardError, merge_shards
from tests.test_data_tokenizers import corpus_texts

KEYS = ("text", "title")


def write_inputs(directory, compress_first: bool = False) -> list[str]:
    """The shipped corpus as two JSONL files (50 and 34 documents), each record with a text and a title."""
    records = [json.dumps({"title": f"part {i}", "text": text}) + "\n" for i, text in enumerate(corpus_texts())]
    first = os.path.join(directory, "a.jsonl.gz" if compress_first else "a.jsonl")
    with (gzip.open if compress_first else open)(first, "wt", encoding="utf-8") as stream:
        stream.writelines(records[:50])
    second = os.path.join(directory, "b.jsonl")
    with open(second, "w", encoding="utf-8") as stream:
        stream.writelines(records[50:])
    return [first, second]


def files_of(prefix: str) -> dict[str, bytes]:
    return {suffix: open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx", ".stats.json")}


def tool(argv: list[str]) -> int:
    from tools.preprocess_data import main

    return main([*argv, "--no-progress"])


@pytest.mark.parametrize("compress_first", [False, True])
def test_three_shards_of_two_files_merge_into_the_bytes_of_one_run(tmp_path, compress_first, capsys) -> None:
    from tools.merge_datasets import main as merge_main

    inputs = write_inputs(tmp_path, compress_first)
    common = ["--input", *inputs, "--json-keys", *KEYS, "--append-eod"]
    assert tool([*common, "--output-prefix", str(tmp_path / "single" / "corpus")]) == 0
    shards = str(tmp_path / "shards" / "corpus")
    for index, workers in [(0, "1"), (1, "2"), (2, "1")]:
        assert tool([*common, "--output-prefix", shards, "--shard", f"{index}/3", "--workers", workers]) == 0
    assert merge_main(["--shards", shards, "--output-prefix", str(tmp_path / "merged" / "corpus")]) == 0
    assert "merged the shards" in capsys.readouterr().out
    for key in KEYS:
        single = files_of(str(tmp_path / f"single/corpus_{key}_document"))
        assert files_of(str(tmp_path / f"merged/corpus_{key}_document")) == single
    manifests = [json.load(open(sharding.manifest_path(sharding.shard_prefix(shards, k, 3)))) for k in range(3)]
    assert sum(m["documents"] for m in manifests) == 84 and all(m["documents"] > 0 for m in manifests)
    cut_inside = [piece for m in manifests for piece in m["slices"] if piece[1] > 0]
    assert cut_inside and all(piece[0].endswith("b.jsonl") or not compress_first for piece in cut_inside)


def test_the_merge_writes_the_one_run_names_by_default(tmp_path) -> None:
    inputs = write_inputs(tmp_path)
    for index in range(2):
        preprocess(PreprocessConfig(input=inputs, output_prefix=str(tmp_path / "c"), shard=(index, 2), progress=False))
    merged = merge_shards(str(tmp_path / "c"))
    assert list(merged) == ["text"] and merged["text"].prefix == str(tmp_path / "c_text_document")
    assert merged["text"].num_documents == 84


@pytest.mark.parametrize("count", [1, 2, 3, 7, 40])
def test_slices_cover_every_line_once_in_order(tmp_path, count) -> None:
    rng = random.Random(count)
    plain = []
    for name in ("x.jsonl", "y.jsonl"):
        lines = [b"z" * rng.choice([0, 1, 5, 300, 5000]) + b"\n" for _ in range(rng.randint(1, 30))]
        if name == "y.jsonl":
            lines[-1] = lines[-1].rstrip(b"\n") + b"no final newline"
        (tmp_path / name).write_bytes(b"".join(lines))
        plain.append(str(tmp_path / name))
    (tmp_path / "w.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    files = [plain[0], str(tmp_path / "w.jsonl.gz"), plain[1]]
    pieces = [p for k in range(count) for p in sharding.shard_slices(files, [True, False, True], k, count)]
    read = b""
    for piece in pieces:
        with open(piece.path, "rb") as stream:
            content = stream.read()
        assert piece.start == 0 or content[piece.start - 1 : piece.start] == b"\n"  # cut at a line start
        read += content[piece.start : piece.end] if piece.path.endswith(".jsonl") else b"<gz>"
    expected = open(plain[0], "rb").read() + b"<gz>" + open(plain[1], "rb").read()
    assert read == expected


def test_more_shards_than_documents_leaves_empty_shards_that_merge(tmp_path) -> None:
    path = tmp_path / "two.jsonl"
    path.write_text('{"text": "Hello world"}\n{"text": "Hi"}\n')
    single = preprocess(PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "one"), progress=False))
    reports = [preprocess(PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "s"), shard=(k, 5),
                                           progress=False)) for k in range(5)]
    assert sorted(report.documents for report in reports) == [0, 0, 0, 1, 1]
    merge_shards(str(tmp_path / "s"), str(tmp_path / "merged"))
    assert files_of(str(tmp_path / "merged_text_document")) == files_of(single.outputs[0])


def run_shard(tmp_path, inputs, index: int, count: int = 3, **options):
    config = PreprocessConfig(input=inputs, output_prefix=str(tmp_path / "s"), shard=(index, count), progress=False,
                              **options)
    return preprocess(config)


def test_the_merge_needs_every_shard_complete_and_from_one_run(tmp_path) -> None:
    inputs = write_inputs(tmp_path)
    prefix = str(tmp_path / "s")
    with pytest.raises(ShardError, match="no shard manifests"):
        merge_shards(prefix)
    run_shard(tmp_path, inputs, 0)
    run_shard(tmp_path, inputs, 2)
    with pytest.raises(ShardError, match=r"1 of 3 shards are missing or incomplete .*s-shard00001of00003"):
        merge_shards(prefix)
    run_shard(tmp_path, inputs, 1, append_eod=True)  # not the settings of the others
    with pytest.raises(ShardError, match="s-shard00001of00003.manifest.json: its append_eod differ.*different runs"):
        merge_shards(prefix)
    run_shard(tmp_path, inputs, 1)
    with open(f"{prefix}-shard00002of00003_text_document.bin", "ab") as stream:
        stream.write(b"\0\0")  # not the file shard 2 wrote
    with pytest.raises(ShardError, match=r"shard00002of00003_text_document.bin: missing, or not the file shard 2"):
        merge_shards(prefix)
    run_shard(tmp_path, inputs, 2)
    assert merge_shards(prefix)["text"].num_documents == 84


def test_a_failed_rerun_leaves_the_shard_incomplete(tmp_path, monkeypatch) -> None:
    from data import preprocess as module

    inputs = write_inputs(tmp_path)
    for index in range(3):
        run_shard(tmp_path, inputs, index)

    def crash(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(module.IndexedDatasetBuilder, "finalize", crash)
    with pytest.raises(OSError, match="No space left"):
        run_shard(tmp_path, inputs, 1)
    with pytest.raises(ShardError, match="1 of 3 shards are missing or incomplete"):
        merge_shards(str(tmp_path / "s"))


def test_a_bad_line_in_a_shard_names_its_file_and_line(tmp_path) -> None:
    inputs = write_inputs(tmp_path)
    lines = open(inputs[1], encoding="utf-8").readlines()
    lines[19] = "{broken\n"
    open(inputs[1], "w", encoding="utf-8").writelines(lines)
    failing = [k for k in range(3) if any(p.path == inputs[1] and p.start > 0 for p in
                                          sharding.shard_slices(inputs, [True, True], k, 3))]
    assert failing == [2]  # the shard reading b.jsonl from the middle, after its line 1
    with pytest.raises(BadInputError, match=r"b\.jsonl:20: malformed JSON"):
        run_shard(tmp_path, inputs, 2)
    report = run_shard(tmp_path, inputs, 2, skip_bad_lines=True)
    assert report.skipped == 1 and report.skipped_examples[0].startswith(f"{inputs[1]}:20: malformed JSON")


def test_all_shards_empty_is_an_error_at_merge(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"other": 1}\n{"other": 2}\n')
    for index in range(2):
        run_shard(tmp_path, [str(path)], index, count=2, skip_bad_lines=True)
    with pytest.raises(ShardError, match="no documents in any of the 2 shards"):
        merge_shards(str(tmp_path / "s"))


def test_inputs_by_glob_in_name_order(tmp_path, capsys) -> None:
    inputs = write_inputs(tmp_path)
    by_glob = str(tmp_path / "by_glob")
    assert tool(["--input", str(tmp_path / "*.jsonl"), "--output-prefix", by_glob]) == 0
    assert tool(["--input", *inputs, "--output-prefix", str(tmp_path / "listed")]) == 0
    assert files_of(f"{by_glob}_text_document") == files_of(str(tmp_path / "listed_text_document"))
    assert tool(["--input", inputs[0], inputs[0], "--output-prefix", by_glob]) == 1
    assert "a.jsonl is listed more than once" in capsys.readouterr().err
    assert tool(["--input", str(tmp_path / "*.parquet"), "--output-prefix", by_glob]) == 1
    assert "*.parquet: no file matches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool(["--input", *inputs, "--output-prefix", by_glob, "--shard", "3/3"])
    assert "K must be in 0..N-1 (0-based" in capsys.readouterr().err
