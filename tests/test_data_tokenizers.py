"""Tokenizers: GPT-2 ids as Megatron's BPE gives them on both backends, SentencePiece trained and used, Hugging Face
files loaded; which byte-level vocabularies run on tiktoken, and why the others do not."""

from __future__ import annotations

import json
import os
import re

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
from tests.test_data_reference import _gpt2_tables, reference_gpt2_encode

CORPUS = os.path.join(os.path.dirname(__file__), "..", "data", "corpus", "botchan.jsonl")
BACKENDS = ["tiktoken", "tokenizers"]
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
TRICKY = ["Hello world", " leading space", "trailing  \n\n", "tabs\tand\r\nCRLF", "numbers 1234567 3.14",
          "it's we'll they'd I'M", "émigré naïve — “quotes” 😀 日本語", "<|endoftext|> is text here", "", "   "]


def corpus_texts() -> list[str]:
    with open(CORPUS, encoding="utf-8") as stream:
        return [json.loads(line)["text"] for line in stream]


@pytest.fixture(scope="module", params=BACKENDS)
def gpt2(request) -> GPT2BPETokenizer:
    tokenizer = GPT2BPETokenizer(backend=request.param)
    assert tokenizer.backend == request.param
    return tokenizer


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


# ------------------------------------------------------------------------------------------------ the two backends


def test_auto_runs_gpt2_on_tiktoken() -> None:
    tokenizer = GPT2BPETokenizer()
    assert (tokenizer.backend, tokenizer.backend_note) == ("tiktoken", "")
    assert build_tokenizer("GPT2BPETokenizer", backend="tokenizers").backend == "tokenizers"
    with pytest.raises(ValueError, match="tiktoken is for byte-level BPE"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=CORPUS, backend="tiktoken")


@pytest.fixture(scope="module")
def transformers_gpt2(tmp_path_factory):
    """Megatron-LM's current GPT2BPETokenizer encodes with `transformers`' GPT2Tokenizer over the same two files."""
    import shutil

    import transformers

    directory = tmp_path_factory.mktemp("gpt2_files")
    for path in (DEFAULT_VOCAB_FILE, DEFAULT_MERGE_FILE):
        shutil.copy(path, directory)
    return transformers.GPT2Tokenizer.from_pretrained(str(directory))


SPECIAL_IN_TEXT = ["Hello <|endoftext|> world", "<|endoftext|>", "a<|endoftext|>b<|endoftext|>", "<|endoftext",
                   "x <|endoftext|>\n\ny", "<|endoftext|><|endoftext|> it's"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_end_of_text_written_in_a_document_under_both_rules(backend, transformers_gpt2) -> None:
    as_text = GPT2BPETokenizer(backend=backend)
    parsed = GPT2BPETokenizer(backend=backend, parse_special_tokens=True)
    # Megatron-DeepSpeed's rule (the default): the token is text, as the plain BPE encodes it
    assert as_text.encode("Hello <|endoftext|> world") == [15496, 1279, 91, 437, 1659, 5239, 91, 29, 995]
    assert [as_text.encode(text) for text in SPECIAL_IN_TEXT] == [reference_gpt2_encode(t) for t in SPECIAL_IN_TEXT]
    # Megatron-LM's rule: a document boundary inside the document, as transformers gives it
    assert parsed.encode("Hello <|endoftext|> world") == [15496, 220, 50256, 995]
    assert parsed.encode_batch(SPECIAL_IN_TEXT) == [transformers_gpt2(text).input_ids for text in SPECIAL_IN_TEXT]
    assert parsed.encode_batch(corpus_texts()) == as_text.encode_batch(corpus_texts())


# ---------------------------------------------------------------------------------------- tokenizer.json files


def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's token bytes -> id, from vocab.json with the reference byte table (not the project's converter)."""
    byte_encoder, encoder, _ = _gpt2_tables()
    byte_decoder = {character: byte for byte, character in byte_encoder.items()}
    return {bytes(byte_decoder[c] for c in token): index for token, index in encoder.items() if token != "<|endoftext|>"}


def llama3_kind_tokenizer_json(directory) -> str:
    """GPT-2's ranks converted the way Llama 3's tokenizer.json was, by `transformers`' TikTokenConverter: every split
    of every token listed as a merge, ignore_merges, Llama 3's Split pattern, added special tokens, a BOS template."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class FromRanks(TikTokenConverter):
        def load_tiktoken_bpe(self, url: str) -> dict[bytes, int]:  # the ranks in memory: nothing to download
            return gpt2_ranks()

    converter = FromRanks(vocab_file="gpt2-ranks", pattern=LLAMA3_PATTERN,
                          extra_special_tokens=["<|begin_of_text|>", "<|end_of_text|>"])
    tokenizer = converter.converted()
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])])
    path = os.path.join(directory, "llama3_kind.json")
    tokenizer.save(path)
    return path


def qwen2_kind_tokenizer_json(directory, normalizer=None, pattern: str = QWEN2_PATTERN) -> str:
    """GPT-2's vocabulary and merges behind a Qwen2-style Split pattern (one digit per piece) and chat tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE.from_file(DEFAULT_VOCAB_FILE, DEFAULT_MERGE_FILE))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    path = os.path.join(directory, f"qwen2_kind_{id(normalizer)}_{len(pattern)}.json")
    tokenizer.save(path)
    return path


def assert_backends_agree(path: str, texts: list[str]) -> HuggingFaceTokenizer:
    fast, reference = HuggingFaceTokenizer(path), HuggingFaceTokenizer(path, backend="tokenizers")
    assert fast.backend == "tiktoken", fast.backend_note
    assert fast.encode_batch(texts) == reference.encode_batch(texts)
    assert (fast.vocab_size, fast.eod_id) == (reference.vocab_size, reference.eod_id)
    return fast


def test_llama3_kind_tokenizer_json_runs_on_tiktoken(tmp_path) -> None:
    path = llama3_kind_tokenizer_json(tmp_path)
    texts = corpus_texts() + TRICKY + ["<|begin_of_text|>Hi<|end_of_text|>", "IT'S 1234567 \u017f'S \r\n\n x"]
    tokenizer = assert_backends_agree(path, texts)
    assert tokenizer.encode("Hello world") == [50256, 15496, 995]  # BOS from the template, then GPT-2's ids
    assert tokenizer.decode(tokenizer.encode("naïve 😀")) == "<|begin_of_text|>naïve 😀"


def test_qwen2_kind_runs_on_tiktoken_unless_it_normalizes(tmp_path) -> None:
    from tokenizers import normalizers

    texts = corpus_texts()[:20] + TRICKY + ["<|im_start|>user\n12345<|im_end|>"]
    tokenizer = assert_backends_agree(qwen2_kind_tokenizer_json(tmp_path), texts)
    assert tokenizer.encode("12345") == [16, 17, 18, 19, 20]  # one digit per piece
    with_nfc = HuggingFaceTokenizer(qwen2_kind_tokenizer_json(tmp_path, normalizers.NFC()))
    assert with_nfc.backend == "tokenizers" and "the normalizer NFC has no tiktoken equivalent" in with_nfc.backend_note


def test_a_split_pattern_that_skips_text_is_encoded_by_tokenizers(tmp_path) -> None:
    """tiktoken drops what its pattern does not match; `tokenizers` keeps it as a piece: such texts fall back."""
    path = qwen2_kind_tokenizer_json(tmp_path, pattern=r"\p{L}+")
    assert_backends_agree(path, ["Hello world", "ab 12!? cd", "  ", "x<|im_end|>  y"])


def tiny_tokenizer_json(directory, merges: list[tuple[str, str, int]], extra: dict[str, int] | None = None,
                        **options) -> str:
    """Every byte (id = its value) plus the merges (left, right, id of the result), ByteLevel as GPT-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from data.tiktoken_bpe import byte_alphabet

    vocab = {character: byte for byte, character in byte_alphabet().items()}
    vocab.update({left + right: index for left, right, index in merges}, **(extra or {}))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for left, right, _ in merges], **options))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    path = os.path.join(directory, "tiny.json")
    tokenizer.save(path)
    return path


def raw_tiktoken_ids(ranks: dict[bytes, int], text: str) -> list[int]:
    """What tiktoken itself gives with these ranks: the ids a conversion without the checks would write."""
    import tiktoken

    from data.tiktoken_bpe import GPT2_PATTERN

    encoding = tiktoken.Encoding("raw", pat_str=GPT2_PATTERN, mergeable_ranks={bytes([b]): b for b in range(256)} | ranks,
                                 special_tokens={})
    return encoding.encode_ordinary(text)


NOT_EXACT = [
    # (merges, a text, the ids tiktoken alone would give, the ids `tokenizers` gives, model options, the reason named)
    ([("a", "b", 257), ("b", "c", 256)], "abc", [97, 256], [257, 99], {}, "do not follow the order of the ids"),
    ([("b", "c", 256), ("a", "b", 257), ("ab", "c", 258)], "abc", [258], [97, 256], {},
     "token 'abc' \\(id 258\\) is not what the merges make of its own bytes"),
    # "abc" (259) is in the vocabulary, no merge makes it: tiktoken merges ab + c into it, `tokenizers` does not
    ([("a", "b", 256)], "abcd", [259, 100], [256, 99, 100], {"ignore_merges": True},
     "multi-byte tokens that no merge makes"),
]


@pytest.mark.parametrize(("merges", "text", "tiktoken_ids", "hf_ids", "options", "reason"), NOT_EXACT)
def test_a_vocabulary_that_does_not_convert_exactly_falls_back_saying_why(tmp_path, merges, text, tiktoken_ids,
                                                                         hf_ids, options, reason) -> None:
    extra = {"abc": 259} if options.get("ignore_merges") else None
    path = tiny_tokenizer_json(tmp_path, merges, extra, **options)
    ranks = {(left + right).encode(): index for left, right, index in merges} | ({b"abc": 259} if extra else {})
    assert raw_tiktoken_ids(ranks, text) == tiktoken_ids  # what a conversion without the checks would write
    tokenizer = HuggingFaceTokenizer(path, eod_token="<eos>")
    assert (tokenizer.backend, tokenizer.encode(text)) == ("tokenizers", hf_ids)
    assert re.search(reason, tokenizer.backend_note)
    with pytest.raises(ValueError, match="--tokenizer-backend tiktoken: .*" + reason):
        HuggingFaceTokenizer(path, eod_token="<eos>", backend="tiktoken")


def test_gpt2_files_with_merges_out_of_order_fall_back(tmp_path) -> None:
    lines = open(DEFAULT_MERGE_FILE, encoding="utf-8").read().split("\n")
    lines[1], lines[2] = lines[2], lines[1]  # "Ġ a" before "Ġ t": merge 1 now makes id 257, merge 2 id 256
    (tmp_path / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    tokenizer = GPT2BPETokenizer(merge_file=str(tmp_path / "merges.txt"))
    assert tokenizer.backend == "tokenizers"
    assert "merge 2 ('Ġ', 't') makes id 256, listed after a merge that makes id 257" in tokenizer.backend_note


@pytest.mark.parametrize(("change", "reason"), [
    ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
     "add_prefix_space"),
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}},
     "pre-tokenizer \\['Metaspace'\\]"),
    ({"normalizer": {"type": "Lowercase"}}, "normalizer Lowercase"),
    ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "^\\s+|\\S+|\\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}},
     "constructs whose meaning may differ"),  # Oniguruma's ^ matches after every newline, fancy-regex's once
    ({"post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0], "trim_offsets": True,
                         "add_prefix_space": False}}, "post-processor RobertaProcessing"),
])
def test_parts_tiktoken_cannot_reproduce_are_refused(tmp_path, change, reason) -> None:
    document = json.load(open(tiny_tokenizer_json(tmp_path, [("a", "b", 256)]), encoding="utf-8"))
    document.update(change)
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    tokenizer = HuggingFaceTokenizer(str(path), eod_token="<eos>")
    assert tokenizer.backend == "tokenizers" and re.search(reason, tokenizer.backend_note), tokenizer.backend_note


def test_overlapping_or_stripping_added_tokens_are_refused(tmp_path) -> None:
    from tokenizers import AddedToken, Tokenizer

    for added, reason in [([AddedToken("<x>", lstrip=True)], "lstrip = true"),
                          (["<a|", "<a|b>"], "added tokens '<a\\|b>' and '<a\\|' overlap")]:
        tokenizer = Tokenizer.from_file(tiny_tokenizer_json(tmp_path, [("a", "b", 256)]))
        tokenizer.add_special_tokens(added)
        tokenizer.save(str(tmp_path / "added.json"))
        loaded = HuggingFaceTokenizer(str(tmp_path / "added.json"), eod_token="<eos>")
        assert loaded.backend == "tokenizers" and re.search(reason, loaded.backend_note), loaded.backend_note
