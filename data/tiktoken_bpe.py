"""tiktoken for byte-level BPE vocabularies: built offline from the user's files, used only where it is exact.

The same vocabulary and merges run through two different BPE loops over each pre-tokenized piece:

- H, `tokenizers` (Hugging Face): merge, again and again, the adjacent pair (x, y) listed earliest in the merges
  (lowest merge index; leftmost on a tie), only listed pairs; with ``ignore_merges`` a piece that is a token is first
  returned whole;
- T, tiktoken: merge the adjacent pair whose concatenation is a token of the lowest rank (leftmost on a tie),
  whatever the two parts are; a piece that is a token is always returned whole. Its ranks are the ids here.

:func:`tiktoken_vocabulary` gives tiktoken the ranks {token bytes: id} of the single bytes and of every token a merge
makes, and accepts a vocabulary only when all of this holds (else :class:`NotExactError` says which part fails):

1. Byte level: every token is a string of GPT-2's 256-character byte alphabet, and each single byte is a token.
2. Every merge (x, y) has x, y and xy in the vocabulary, and the id of xy never decreases along the merges list
   (H's merge order is then T's rank order; several merges of one token are next to each other).
3. Multi-byte tokens that no merge makes ("orphans") are not given to tiktoken: H's loop never makes them. With
   ``ignore_merges`` H may return one whole, so such a vocabulary is refused (added tokens excepted: they are split
   out of the text before the BPE).
4. A "foreign split" of a token z is a split z = p + q into two tiktoken tokens that is not a listed merge: T could
   merge it, H not. Every z with a foreign split must be what H's loop makes of z's bytes alone, checked by running
   `tokenizers`' own BPE on it. Without ``ignore_merges`` every merged token must (T returns a whole piece that is a
   token directly; H runs its loop on it).
5. Pre-tokenizer: GPT-2's ByteLevel regex, or one Split(Regex, Isolated) then ByteLevel without regex; no prefix
   space; no normalizer. A Split regex may use only constructs both regex engines read alike (_check_regex_syntax:
   no POSIX classes, atomic groups, lookbehind, possessive quantifiers, backreferences, ^ or $, and a
   case-insensitive group only for the English contractions, where no multi-character case folding applies).
   tiktoken drops text its pattern does not match, H keeps it as a piece: GPT-2's pattern matches every character;
   with a Split pattern each text's tokens are checked to cover all of its bytes, and a text they do not cover is
   encoded by `tokenizers`.
6. Added tokens: no lstrip, rstrip or single_word, and no two overlap (H takes the longest match, T the first of an
   alternation). Post-processor: none, ByteLevel (offsets only), or TemplateProcessing (special tokens around).

Why 1-4 give equal ids. Both loops apply merges one at a time and parts only grow, so for two adjacent parts p, q of
any state, no part ever crossed the edges of p + q: the merges inside happened as in the loop run on the bytes of
p + q alone, and [p, q] is the one state of that run with two parts. Take the first step where T and H differ, from
the same state. If T's pair (p, q) is not listed, [p, q] is the two-part state of H's run on z = pq, so that run ends
at [p, q], not z, which 4 excludes. So both choose among the same pairs, and by 2 both choose pairs making the same
token z, the lowest. Every pair making z in the state is the two-part state of H's run on z's bytes, hence the same
split with the same merge index: H too takes the leftmost. So they never differ. A whole piece that is a token: T
returns it; so does H with ignore_merges (3 makes both sets of tokens the same), and without it H's loop makes it (4).
(No condition on the ids of the parts, nor on the splits a converter lists: Llama 3's tokenizer.json lists every
split of every token.)

Pre-tokenizer regexes run in Oniguruma (tokenizers) and fancy-regex (tiktoken); GPT-2's pattern splits every Unicode
code point alike in the contexts tried, and tests/test_tokenizer_fuzz.py compares the ids of both backends.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # = HF ByteLevel's regex
CONTRACTIONS_ANY_CASE = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"  # of GPT-4's, Llama 3's and Qwen2's patterns
# A regex made only of these reads the same in Oniguruma and fancy-regex: escapes of classes, Unicode properties and
# punctuation, non-capturing groups, lookahead, plain groups, and any other character but a backslash or "(".
_SAFE_REGEX = re.compile(r"""(?:\\[sSdDrnt]|\\[pP]\{[A-Za-z_]+\}|\\[^\w\s]|\(\?[:!=]|\((?!\?)|[^\\(])*""")


class NotExactError(ValueError):
    """tiktoken would not give the ids of `tokenizers` for this vocabulary; the message says why."""


@dataclass(frozen=True)
class TiktokenVocabulary:
    """What tiktoken needs, built from a byte-level BPE vocabulary that passed the exactness checks."""

    pattern: str  # the pre-tokenizer regex
    mergeable_ranks: dict[bytes, int]  # token bytes -> id, for the single bytes and every merged token
    special_tokens: dict[str, int]  # added tokens, split out of the text when special tokens are parsed
    token_bytes: dict[int, bytes]  # every id's bytes (orphans and added tokens included), for decoding
    prefix_ids: tuple[int, ...] = ()  # ids the post-processor puts before a text (e.g. a BOS)
    suffix_ids: tuple[int, ...] = ()  # ... and after it
    pattern_covers_all_text: bool = True  # False: check each text's tokens cover all its bytes (item 5)


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode``: byte -> the printable character that stands for it in byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    alphabet = {byte: chr(byte) for byte in printable}
    alphabet.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return alphabet


def gpt2_files_document(vocab_file: str, merge_file: str) -> dict:
    """The tokenizer.json equivalent of GPT-2's vocab.json + merges.txt, read by `tokenizers` itself."""
    from tokenizers import models

    vocab, merges = models.BPE.read_file(vocab_file, merge_file)
    model = {"type": "BPE", "dropout": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": merges}
    pre_tokenizer = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    return {"model": model, "normalizer": None, "pre_tokenizer": pre_tokenizer, "post_processor": None,
            "added_tokens": []}


def tiktoken_vocabulary(document: dict, source: str, extra_special: dict[str, int] | None = None) -> TiktokenVocabulary:
    """Check a tokenizer.json document (see the module docstring) and build tiktoken's tables; NotExactError if not.

    extra_special: tokens of the vocabulary to split out of text as special tokens besides the added tokens
    (GPT-2's ``<|endoftext|>``, which vocab.json holds as an ordinary entry).
    """
    model = document.get("model") or {}
    _check_model_options(model, source)
    if document.get("normalizer"):
        raise NotExactError(f"{source}: the normalizer {_kind(document['normalizer'])} has no tiktoken equivalent")
    pattern, covers_all = _pattern(document.get("pre_tokenizer"), source)
    vocab = model["vocab"]
    token_bytes = _vocab_bytes(vocab, source)
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    _check_merge_order(vocab, merges, source)
    special = _added_tokens(document.get("added_tokens") or [], source)
    special.update(extra_special or {})
    _check_no_overlap(list(special), source)
    ignore_merges = bool(model.get("ignore_merges"))
    ranks = _mergeable_ranks(vocab, token_bytes, merges, ignore_merges, set(special.values()), source)
    _check_same_pairs(vocab, token_bytes, merges, ranks, ignore_merges, source)
    prefix, suffix = _template(document.get("post_processor"), source)
    ids = dict(token_bytes)
    ids.update({index: content.encode("utf-8") for content, index in special.items()})
    return TiktokenVocabulary(pattern, ranks, special, ids, prefix, suffix, covers_all)


def _kind(component: dict) -> str:
    return str(component.get("type", component))


def _check_model_options(model: dict, source: str) -> None:
    if model.get("type") != "BPE":
        raise NotExactError(f"{source}: the model is {model.get('type')!r}, not BPE")
    unsupported = {"dropout": "BPE dropout is random", "continuing_subword_prefix": "a continuing-subword prefix",
                   "end_of_word_suffix": "an end-of-word suffix", "byte_fallback": "byte fallback (<0xNN> tokens)"}
    for key, reason in unsupported.items():
        if model.get(key):
            raise NotExactError(f"{source}: {key} = {model[key]!r}: {reason} has no tiktoken equivalent")


def _pattern(pre_tokenizer: dict | None, source: str) -> tuple[str, bool]:
    """(regex, whether it matches every character) of a byte-level pre-tokenizer tiktoken reproduces, else refuse."""
    if pre_tokenizer is None:
        raise NotExactError(f"{source}: no pre-tokenizer, so not a byte-level BPE")
    steps = pre_tokenizer["pretokenizers"] if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    kinds = [step.get("type") for step in steps]
    if any(step.get("type") == "ByteLevel" and step.get("add_prefix_space") for step in steps):
        raise NotExactError(f"{source}: ByteLevel add_prefix_space = true (a space put before the text)")
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN, True
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        if regex and split.get("behavior") == "Isolated" and not split.get("invert"):
            _check_regex_syntax(regex, source)
            return regex, False
        raise NotExactError(f"{source}: a Split pre-tokenizer other than a Regex pattern with behavior Isolated "
                            f"({split.get('pattern')}, {split.get('behavior')}, invert {split.get('invert')})")
    raise NotExactError(f"{source}: the pre-tokenizer {kinds} is not ByteLevel nor Split(Regex) + ByteLevel")


def _check_regex_syntax(regex: str, source: str) -> None:
    """Item 5: refuse a Split regex that may not mean the same in both engines."""
    plain = regex.replace(CONTRACTIONS_ANY_CASE, "")
    escapes_as_letters = re.sub(r"\\[pP]\{[A-Za-z_]+\}|\\.", "E", plain)
    outside_classes = re.sub(r"\[[^\]]*\]", "C", escapes_as_letters)
    if (not _SAFE_REGEX.fullmatch(plain) or "[[:" in plain
            or re.search(r"[?*+}]\+", escapes_as_letters)  # possessive quantifiers
            or re.search(r"[$^]", outside_classes)):  # Oniguruma's ^ and $ match at every line, fancy-regex's not
        raise NotExactError(f"{source}: the Split regex {regex!r} uses constructs whose meaning may differ between "
                            f"Oniguruma (tokenizers) and fancy-regex (tiktoken)")


def _vocab_bytes(vocab: dict[str, int], source: str) -> dict[int, bytes]:
    """id -> bytes of every token written in GPT-2's byte alphabet (item 1)."""
    alphabet = byte_alphabet()
    outside = re.compile(f"[^{re.escape(''.join(alphabet.values()))}]")
    for token, index in vocab.items():
        if outside.search(token):
            raise NotExactError(f"{source}: token {token!r} (id {index}) is not written in the byte-level "
                                f"alphabet: not a byte-level BPE vocabulary")
    missing = [byte for byte, character in alphabet.items() if character not in vocab]
    if missing:
        raise NotExactError(f"{source}: {len(missing)} single bytes are not tokens (e.g. {missing[0]:#04x})")
    to_latin1 = {ord(character): byte for byte, character in alphabet.items()}  # then one byte per character
    return {index: token.translate(to_latin1).encode("latin-1") for token, index in vocab.items()}


def _check_merge_order(vocab: dict[str, int], merges: Sequence[tuple[str, ...]], source: str) -> None:
    """Item 2: every merge is made of tokens, and the merges list is in the order of the ids it makes."""
    previous = -1
    for number, merge in enumerate(merges, start=1):
        if len(merge) != 2 or merge[0] not in vocab or merge[1] not in vocab or merge[0] + merge[1] not in vocab:
            raise NotExactError(f"{source}: merge {number} {merge} has a part or a result outside the vocabulary")
        result = vocab[merge[0] + merge[1]]
        if result < previous:
            raise NotExactError(f"{source}: merge {number} {merge} makes id {result}, listed after a merge that makes "
                                f"id {previous}: the merges do not follow the order of the ids (tiktoken's ranks)")
        previous = result


def _mergeable_ranks(vocab: dict[str, int], token_bytes: dict[int, bytes], merges: Sequence[tuple[str, ...]],
                     ignore_merges: bool, added_ids: set[int], source: str) -> dict[bytes, int]:
    """Item 3: the single bytes and the merged tokens; orphans are refused under ignore_merges, else left out.

    An added token is split out of the text before the BPE sees it, so it is never an orphan that matters.
    """
    merged = {vocab[left + right] for left, right in merges}
    singles = {vocab[character] for character in byte_alphabet().values()}
    kept = merged | singles
    orphans = [index for index in vocab.values() if index not in kept and index not in added_ids]
    if orphans and ignore_merges:
        token = token_bytes[orphans[0]]
        raise NotExactError(f"{source}: {len(orphans)} multi-byte tokens that no merge makes (e.g. {token!r}); "
                            f"with ignore_merges `tokenizers` can return them whole, tiktoken could merge into them")
    return {token_bytes[index]: index for index in sorted(kept)}


def _check_same_pairs(vocab: dict[str, int], token_bytes: dict[int, bytes], merges: Sequence[tuple[str, ...]],
                      ranks: dict[bytes, int], ignore_merges: bool, source: str) -> None:
    """Item 4: the tokens that H's loop must make of their own bytes, checked with `tokenizers`' own BPE."""
    merged = list(dict.fromkeys(vocab[left + right] for left, right in merges))
    if ignore_merges:
        listed = {(token_bytes[vocab[left]], token_bytes[vocab[right]]) for left, right in merges}
        merged = [index for index in merged if _has_foreign_split(token_bytes[index], ranks, listed)]
    if not merged:
        return
    from tokenizers import models

    bpe = models.BPE(vocab=vocab, merges=[tuple(merge) for merge in merges])  # plain merges: no ignore_merges
    names = {index: token for token, index in vocab.items()}
    for index in merged:
        produced = [token.id for token in bpe.tokenize(names[index])]
        if produced != [index]:
            raise NotExactError(f"{source}: token {names[index]!r} (id {index}) is not what the merges make of its "
                                f"own bytes ({produced}); tiktoken would return it or merge into it")


def _has_foreign_split(token: bytes, ranks: dict[bytes, int], listed: set[tuple[bytes, bytes]]) -> bool:
    return any(token[:cut] in ranks and token[cut:] in ranks and (token[:cut], token[cut:]) not in listed
               for cut in range(1, len(token)))


def _added_tokens(added: Iterable[dict], source: str) -> dict[str, int]:
    """Item 6: added tokens as tiktoken's special tokens; refuse options tiktoken cannot reproduce."""
    special = {}
    for token in added:
        for option in ("lstrip", "rstrip", "single_word"):
            if token.get(option):
                raise NotExactError(f"{source}: added token {token['content']!r} has {option} = true")
        special[token["content"]] = token["id"]
    return special


def _check_no_overlap(tokens: list[str], source: str) -> None:
    """Two added tokens must not overlap: HF takes the longest match, tiktoken the first of an alternation."""
    prefixes: dict[str, set[str]] = {}
    for token in tokens:
        for end in range(1, len(token)):
            prefixes.setdefault(token[:end], set()).add(token)
    for token in tokens:
        inside = [other for other in tokens if other != token and other in token]
        touching = [other for start in range(1, len(token)) for other in prefixes.get(token[start:], ())
                    if other != token]
        if inside or touching:
            raise NotExactError(f"{source}: the added tokens {token!r} and {(inside or touching)[0]!r} overlap")


def _template(post_processor: dict | None, source: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Item 6: (ids before, ids after) a text that the post-processor adds; ByteLevel changes only offsets."""
    steps = [] if post_processor is None else post_processor.get("processors") or [post_processor]
    prefix: list[int] = []
    suffix: list[int] = []
    for step in steps:
        if step.get("type") == "ByteLevel":
            continue
        if step.get("type") != "TemplateProcessing":
            raise NotExactError(f"{source}: the post-processor {_kind(step)} is not reproduced")
        seen_text = False
        for piece in step["single"]:
            if "Sequence" in piece:
                seen_text = True
                continue
            ids = step["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
            (suffix if seen_text else prefix).extend(ids)
    return tuple(prefix), tuple(suffix)


class TiktokenEncoder:
    """Encodes with tiktoken over a :class:`TiktokenVocabulary`; a text it cannot cover goes to ``fallback``."""

    def __init__(self, vocabulary: TiktokenVocabulary, parse_special_tokens: bool, add_special_tokens: bool = False,
                 fallback: Callable[[str], list[int]] | None = None) -> None:
        import tiktoken

        self.vocabulary = vocabulary
        try:
            self._encoding = tiktoken.Encoding(f"byte-level-bpe-{os.getpid()}-{id(self)}", pat_str=vocabulary.pattern,
                                               mergeable_ranks=vocabulary.mergeable_ranks,
                                               special_tokens=vocabulary.special_tokens)
        except ValueError as error:  # e.g. a regex fancy-regex does not compile
            raise NotExactError(f"tiktoken does not accept this vocabulary: {error}") from error
        self._allowed = frozenset(vocabulary.special_tokens) if parse_special_tokens else frozenset()
        self._prefix = list(vocabulary.prefix_ids) if add_special_tokens else []
        self._suffix = list(vocabulary.suffix_ids) if add_special_tokens else []
        self._fallback = fallback

    def encode(self, text: str) -> list[int]:
        if not text.isascii():
            text.encode("utf-8")  # raises on a lone surrogate, as `tokenizers` does (tiktoken would replace it)
        if self._allowed:
            ids = self._encoding.encode(text, allowed_special=self._allowed, disallowed_special=())
        else:
            ids = self._encoding.encode_ordinary(text)
        if not self.vocabulary.pattern_covers_all_text and not self._covers(text, ids):
            if self._fallback is None:
                raise ValueError("the pre-tokenizer pattern skips part of the text and there is no fallback")
            return self._fallback(text)
        return self._prefix + ids + self._suffix if self._prefix or self._suffix else ids

    def _covers(self, text: str, ids: list[int]) -> bool:
        """Whether the tokens hold every byte of the text (tiktoken drops what its pattern does not match)."""
        return len(self._encoding.decode_bytes(ids)) == len(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        table = self.vocabulary.token_bytes
        return b"".join(table[index] for index in ids).decode("utf-8", errors="replace")
