"""Tokenizers: GPT-2 ids as Megatron's BPE gives them, SentencePiece trained and used, Hugging Face files loaded."""

from __future__ import annotations

import json
import os

import pytest

from data.tokenizers import (
    DEFAULT_MERGE_FILE,
    DEFAULT_VOCAB_FILE,
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)
from tests.test_data_reference import reference_gpt2_encode

CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "corpus", "botchan.jsonl")
TRICKY = ["Hello world", " leading space", "trailing  \n\n", "tabs\tand\r\nCRLF", "numbers 1234567 3.14",
          "it's we'll they'd I'M", "émigré naïve — “quotes” 😀 日本語", "<|endoftext|> is text here", "", "   "]


def corpus_texts() -> list[str]:
    with open(CORPUS, encoding="utf-8") as stream:
        return [json.loads(line)["text"] for line in stream]


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    return GPT2BPETokenizer()


def test_gpt2_known_ids(gpt2) -> None:
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.eod_id, gpt2.vocab_size) == (50256, 50257)
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"


def test_gpt2_matches_the_reference_bpe_on_the_corpus_and_edge_cases(gpt2) -> None:
    texts = corpus_texts() + TRICKY
    assert gpt2.encode_batch(texts) == [reference_gpt2_encode(text) for text in texts]
    assert sum(len(ids) for ids in gpt2.encode_batch(corpus_texts())) == 64748


def test_gpt2_round_trips_text(gpt2) -> None:
    for text in TRICKY:
        assert gpt2.decode(gpt2.encode(text)) == text


def test_build_tokenizer_by_megatron_names(tmp_path) -> None:
    assert isinstance(build_tokenizer("GPT2BPETokenizer"), GPT2BPETokenizer)
    explicit = build_tokenizer("GPT2BPETokenizer", DEFAULT_VOCAB_FILE, DEFAULT_MERGE_FILE)
    assert explicit.encode("Hello world") == [15496, 995]
    with pytest.raises(ValueError, match="unknown --tokenizer-type 'BertWordPiece'"):
        build_tokenizer("BertWordPiece")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("spm") / "botchan")
    return train_sentencepiece(corpus_texts(), prefix, vocab_size=1000, model_type="bpe")


def test_sentencepiece_trains_and_encodes(sentencepiece_model) -> None:
    tokenizer = GPTSentencePieceTokenizer(sentencepiece_model)
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (1000, 2)
    text = "I have been playing always a losing game since my childhood."
    ids = tokenizer.encode(text)
    assert 5 <= len(ids) < len(text) and all(3 <= i < 1000 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, "Botchan"])[0] == ids


def test_megatron_sentencepiece_wrapper_appends_special_pieces(sentencepiece_model) -> None:
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    plain = GPTSentencePieceTokenizer(sentencepiece_model)
    # <CLS> <SEP> <EOD> <MASK> and <PAD> (the model has no pad) come after the 1000 pieces; <s>, </s> exist already
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (1005, 1002)
    assert tokenizer.encode("a cat") == plain.encode("a cat")
    assert tokenizer.encode("a cat<EOD>the dog</s>") == plain.encode("a cat") + [1002] + plain.encode("the dog") + [2]
    assert tokenizer.decode(plain.encode("a cat") + [1002]) == "a cat <EOD> "


def test_train_tokenizer_tool_writes_a_model(tmp_path) -> None:
    from tools.train_tokenizer import main

    assert main(["--input", CORPUS, "--model-prefix", str(tmp_path / "tool"), "--vocab-size", "800",
                 "--max-documents", "40"]) == 0
    assert GPTSentencePieceTokenizer(str(tmp_path / "tool.model")).vocab_size == 800


def save_gpt2_tokenizer_json(path: str) -> None:
    from data.tokenizers import _byte_level_bpe

    _byte_level_bpe(DEFAULT_VOCAB_FILE, DEFAULT_MERGE_FILE).save(path)


def test_hugging_face_tokenizer_json_file(tmp_path, gpt2) -> None:
    path = str(tmp_path / "tokenizer.json")
    save_gpt2_tokenizer_json(path)
    tokenizer = HuggingFaceTokenizer(path)
    texts = corpus_texts()[:5] + TRICKY
    assert tokenizer.encode_batch(texts) == gpt2.encode_batch(texts)
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (50257, 50256)
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path).encode("Hello world") == [15496, 995]


def test_hugging_face_directory_matches_autotokenizer(tmp_path) -> None:
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    # a Llama-like tokenizer: BOS added by the post-processor, eos named in tokenizer_config.json
    rust = Tokenizer(models.BPE(unk_token="<unk>"))
    rust.normalizer = normalizers.NFKC()
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    rust.train_from_iterator(corpus_texts(), trainer)
    rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    saved = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                                 unk_token="<unk>")
    saved.save_pretrained(tmp_path / "llama_like")
    tokenizer = HuggingFaceTokenizer(str(tmp_path / "llama_like"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "llama_like"))
    texts = corpus_texts()[:3] + ["Hello world", "naïve café"]
    assert tokenizer.encode_batch(texts) == [auto(text).input_ids for text in texts]  # Megatron's tokenize()
    assert tokenizer.encode("Hello")[0] == 1
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (len(auto), auto.eos_token_id) == (600, 2)


def test_hugging_face_without_an_end_token_asks_for_one(tmp_path) -> None:
    from tokenizers import Tokenizer, models

    path = str(tmp_path / "bare.json")
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(path)
    with pytest.raises(ValueError, match="cannot tell the end-of-document token"):
        HuggingFaceTokenizer(path)
    assert HuggingFaceTokenizer(path, eod_token="b").eod_id == 1
    with pytest.raises(FileNotFoundError, match="tokenizer.json or a directory"):
        HuggingFaceTokenizer(str(tmp_path / "nowhere"))
