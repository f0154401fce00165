"""The tiktoken backend gives the ids of the `tokenizers` backend on 100,000+ generated strings, under both rules for
``<|endoftext|>`` in text, for GPT-2's files and for a Llama-3-kind tokenizer.json.

The strings are built from fragments that stress the pre-tokenizer regex and the BPE: whitespace runs of every kind,
contractions in every case (with the Unicode letters that case-fold to s and k), digits of several scripts, punctuation
runs, emoji with skin tones and ZWJ sequences, combining marks, CJK, right-to-left scripts with direction marks,
random code points (no lone surrogates: both backends reject those) and the special token inside text. Seeded.
"""

from __future__ import annotations

import random
import string
import time

import pytest

from data.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer
from tests.test_data_tokenizers import llama3_kind_tokenizer_json

NUM_STRINGS = 100_000
WHITESPACE = [" ", "\t", "\n", "\r\n", "\r", "\x0b", "\x0c", "\x85", "\u00a0", "\u1680", "\u2009", "\u200b", "\u2028",
              "\u2029", "\u202f", "\u3000", "\u180e", "\ufeff"]
APOSTROPHES = ["'", "\u2019", "\u02bc"]
CONTRACTIONS = ["s", "t", "re", "ve", "m", "ll", "d"]
CASE_FOLDS = {"s": ["s", "S", "\u017f"], "k": ["k", "K", "\u212a"]}  # long s, Kelvin sign: fold to s and k
DIGITS = ["0123456789", "\u0660\u0661\u0662\u0663", "\u0966\u0967\u0968", "\uff10\uff11\uff12", "\u00b2\u00b3\u00bd",
          "\u2160\u2161\u2162", "\U0001d7ce\U0001d7cf"]
PUNCTUATION = string.punctuation + "\u201c\u201d\u2018\u2014\u2013\u2026\u00ab\u00bb\u00bf\u00a1\u3002\u3001\uff01\u00b7"
EMOJI = ["\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
         "\U0001f3f3\ufe0f\u200d\U0001f308", "\U0001f469\U0001f3fd\u200d\U0001f4bb", "\U0001f1ef\U0001f1f5",
         "1\ufe0f\u20e3", "\u2764\ufe0f", "\U0001faf6\U0001f3ff", "\u263a"]
SPECIAL = ["<|endoftext|>", " <|endoftext|>", "<|endoftext|>\n", "<|endoftext|><|endoftext|>", "<|endoftext",
           "endoftext|>", "<|end_of_text|>", "<|begin_of_text|>", "<|"]


def _whitespace(rng: random.Random) -> str:
    return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 6)))


def _contraction(rng: random.Random) -> str:
    ending = "".join(rng.choice(CASE_FOLDS.get(c, [c, c.upper()])) for c in rng.choice(CONTRACTIONS))
    word = rng.choice(["it", "I", "they", "WE", "o", "", "rock", "kk"])
    return word + rng.choice(APOSTROPHES) + ending + rng.choice(["", " ", "a", "'", "s"])


def _digits(rng: random.Random) -> str:
    alphabet = rng.choice(DIGITS)
    run = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
    return rng.choice(["", " ", "$", "-"]) + run + rng.choice(["", ".5", ",000", "%", "th", " "])


def _punctuation(rng: random.Random) -> str:
    return rng.choice(["", " "]) + "".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(1, 8)))


def _emoji(rng: random.Random) -> str:
    return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3)))


def _combining(rng: random.Random) -> str:
    base = rng.choice("aeiouAEIOU\u0915\u1100 ")
    marks = "".join(chr(rng.randint(0x300, 0x36F)) for _ in range(rng.randint(1, 5)))
    return base + marks + rng.choice(["", "\u094d\u0937", "\u1161\u11a8", "n"])


def _cjk(rng: random.Random) -> str:
    ranges = [(0x4E00, 0x9FFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7A3), (0xFF01, 0xFF5E)]
    low, high = rng.choice(ranges)
    return "".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 8)))


def _rtl(rng: random.Random) -> str:
    letters = [chr(c) for c in [*range(0x621, 0x64B), *range(0x5D0, 0x5EB)]]
    marks = ["", "\u064e", "\u0650", "\u0651", "\u05b7", "\u200f", "\u200e", "\u202e", "\u061f"]
    return "".join(rng.choice(letters) + rng.choice(marks) for _ in range(rng.randint(1, 6)))


def _random_code_points(rng: random.Random) -> str:
    points = (rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
              for _ in range(rng.randint(1, 4)))
    return "".join(chr(p) for p in points if not 0xD800 <= p <= 0xDFFF)


def _words(rng: random.Random) -> str:
    word = "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 10)))
    return rng.choice(["", " ", "  "]) + rng.choice([word, word.lower(), word.capitalize(), "the", " the"])


def _special(rng: random.Random) -> str:
    return rng.choice(SPECIAL)


FRAGMENTS = [_whitespace, _contraction, _digits, _punctuation, _emoji, _combining, _cjk, _rtl, _random_code_points,
             _words, _special]


def fuzz_strings(count: int, seed: int = 0) -> list[str]:
    """count strings of 1 to 6 fragments, every kind of fragment equally likely."""
    rng = random.Random(seed)
    return ["".join(rng.choice(FRAGMENTS)(rng) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def test_the_strings_cover_every_kind_of_fragment() -> None:
    texts = fuzz_strings(NUM_STRINGS)
    assert len(texts) == NUM_STRINGS and len(set(texts)) > 0.95 * NUM_STRINGS
    joined = "".join(texts)
    for needle in ["<|endoftext|>", "\u200d", "\u0301", "\u017f", "\u212a", "\u202e", "\r\n", "\u3000", "\u0663"]:
        assert needle in joined, needle
    assert all(not 0xD800 <= ord(c) <= 0xDFFF for c in joined)


def assert_same_ids(texts: list[str], fast, reference) -> None:
    assert (fast.backend, reference.backend) == ("tiktoken", "tokenizers")
    expected = reference.encode_batch(texts)
    got = fast.encode_batch(texts)
    differ = [i for i in range(len(texts)) if got[i] != expected[i]]
    assert not differ, [(texts[i], got[i], expected[i]) for i in differ[:5]]


@pytest.mark.parametrize("parse_special_tokens", [False, True])
def test_gpt2_backends_give_the_same_ids(parse_special_tokens) -> None:
    start = time.perf_counter()
    texts = fuzz_strings(NUM_STRINGS, seed=1 + parse_special_tokens)
    fast = GPT2BPETokenizer(backend="tiktoken", parse_special_tokens=parse_special_tokens)
    reference = GPT2BPETokenizer(backend="tokenizers", parse_special_tokens=parse_special_tokens)
    assert_same_ids(texts, fast, reference)
    with_special = [ids for text, ids in zip(texts, fast.encode_batch(texts[:2000]), strict=False)
                    if "<|endoftext|>" in text]
    assert with_special and any(50256 in ids for ids in with_special) == parse_special_tokens
    assert time.perf_counter() - start < 60


def test_llama3_kind_tokenizer_json_backends_give_the_same_ids(tmp_path) -> None:
    path = llama3_kind_tokenizer_json(tmp_path)
    texts = fuzz_strings(NUM_STRINGS // 2, seed=3)
    fast = HuggingFaceTokenizer(path, backend="tiktoken")
    assert_same_ids(texts, fast, HuggingFaceTokenizer(path, backend="tokenizers"))
