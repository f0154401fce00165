"""Preference pairs on disk: the SFT masked-dataset pair (data/loss_mask.py) holding each pair as two documents, and a
JSON file that says what they are. Written by ``tools/preprocess_data.py --preference``
(data/preference_preprocess.py); read by :class:`PreferencePairs`.

    file                                        what                                              written
    {prefix}_text_document.bin/.idx             the tokens: document 2i = pair i's chosen          first, renamed
                                                sequence (prompt + chosen completion), 2i + 1 =   into place when
                                                its rejected one (prompt + rejected completion)   complete
    {prefix}_loss_mask_document.bin/.idx        uint8 0/1 per token, the same documents: 1 where   with the tokens
                                                token i is a target (its completion: TRL's
                                                completion_mask)
    {prefix}_preference.json                    {"format": "preference", "version": 1, "pairs":   last, atomically:
                                                N, "seq_length": S or null, "truncation":         a run that stops
                                                "truncate" | "drop", "tokenizer": as given,       before it leaves
                                                "fingerprint": sha256 hex, "refused": {reason:    none, so nothing
                                                count}}                                           looks complete

``seq_length`` is the model's: every sequence has at most seq_length + 1 tokens, as a training sample of this project
(seq_length inputs, seq_length labels); null when the pairs were not fitted to one.

The fingerprint is the sha256 of the bytes of the four files in the order of :func:`data_files` (tokens .bin, .idx,
then mask .bin, .idx): whatever is computed from the data (reference log-probs) records it, and a changed token
changes it. Adding keys to the JSON is free; renaming or removing one raises ``version``.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from common.files import write_json_atomically
from data.indexed_dataset import IndexFormatError, bin_path, idx_path
from data.loss_mask import MaskedDocuments, loss_mask_prefix, tokens_prefix

PREFERENCE_SUFFIX = "_preference.json"
PREFERENCE_FORMAT = "preference"
PREFERENCE_VERSION = 1
TRUNCATION = ("truncate", "drop")
_HASH_CHUNK = 1 << 24
_REQUIRED_KEYS = ("pairs", "seq_length", "truncation", "tokenizer", "fingerprint", "refused")
_FIX = "write it with tools/preprocess_data.py --preference --output-prefix {prefix} (see docs/preference-data.md)"


class PreferenceDataError(ValueError):
    """Preference data that cannot be read as pairs: the message names the file and the fix."""


def preference_meta_path(prefix: str | os.PathLike) -> str:
    """The JSON that describes the preference data written under ``prefix`` (the preprocessor's output prefix)."""
    return f"{os.fspath(prefix)}{PREFERENCE_SUFFIX}"


def data_files(prefix: str | os.PathLike) -> list[str]:
    """The four files the fingerprint covers, in its order: tokens .bin, .idx, loss mask .bin, .idx."""
    tokens = tokens_prefix(os.fspath(prefix))
    mask = loss_mask_prefix(tokens)
    return [bin_path(tokens), idx_path(tokens), bin_path(mask), idx_path(mask)]


def data_fingerprint(prefix: str | os.PathLike) -> str:
    """sha256 hex over the bytes of :func:`data_files`, in that order (what the JSON's ``fingerprint`` holds)."""
    digest = hashlib.sha256()
    for path in data_files(prefix):
        if not os.path.isfile(path):
            raise PreferenceDataError(f"{path} does not exist: the preference data under {os.fspath(prefix)!r} is "
                                      f"incomplete; " + _FIX.format(prefix=os.fspath(prefix)))
        with open(path, "rb") as stream:
            while chunk := stream.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def write_preference_meta(prefix: str | os.PathLike, meta: dict) -> str:
    """Write the JSON atomically (temporary file, fsync, os.replace); returns its path. Call it after the data."""
    path = preference_meta_path(prefix)
    write_json_atomically(path, {"format": PREFERENCE_FORMAT, "version": PREFERENCE_VERSION, **meta})
    return path


def remove_preference_meta(prefix: str | os.PathLike) -> None:
    """Before the data is rewritten: until the new JSON is written, the old data does not look complete."""
    try:
        os.remove(preference_meta_path(prefix))
    except FileNotFoundError:
        pass


def read_preference_meta(prefix: str | os.PathLike) -> dict:
    """The JSON of the preference data under ``prefix``, checked for its format, version and keys."""
    prefix = os.fspath(prefix)
    path = preference_meta_path(prefix)
    if not os.path.isfile(path):
        raise PreferenceDataError(f"{path} does not exist: {prefix!r} is not complete preference data (the JSON is "
                                  f"written last, so a run that stopped early leaves none); " + _FIX.format(prefix=prefix))
    try:
        with open(path, encoding="utf-8") as stream:
            meta = json.load(stream)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PreferenceDataError(f"{path}: not valid JSON ({error}); " + _FIX.format(prefix=prefix)) from None
    if not isinstance(meta, dict) or meta.get("format") != PREFERENCE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise PreferenceDataError(f"{path}: format {found!r}, not {PREFERENCE_FORMAT!r}: not preference data; "
                                  + _FIX.format(prefix=prefix))
    if meta.get("version") != PREFERENCE_VERSION:
        raise PreferenceDataError(f"{path}: version {meta.get('version')!r}, this reader knows version "
                                  f"{PREFERENCE_VERSION}; " + _FIX.format(prefix=prefix) + " with this checkout")
    missing = [key for key in _REQUIRED_KEYS if key not in meta]
    if missing:
        raise PreferenceDataError(f"{path}: missing {', '.join(missing)}; " + _FIX.format(prefix=prefix))
    if not isinstance(meta["pairs"], int) or meta["pairs"] < 0:
        raise PreferenceDataError(f"{path}: 'pairs' must be a count, got {meta['pairs']!r}")
    return meta


class PreferencePairs:
    """Preference pairs written under ``prefix``: ``pair(i)`` is (chosen tokens, chosen mask, rejected tokens,
    rejected mask) of pair i, tokens int64 and masks uint8 (1 on the completion's tokens), as numpy arrays.

    Opening reads the JSON (:func:`read_preference_meta`) and the masked pair (MaskedDocuments, which checks that the
    mask matches the tokens), and checks that the documents are two per pair. :meth:`check_fingerprint` re-hashes
    the files (the JSON's fingerprint is read, not recomputed, on opening).
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self.meta = read_preference_meta(self.prefix)
        self.fingerprint: str = self.meta["fingerprint"]
        self.seq_length: int | None = self.meta["seq_length"]  # every sequence has at most seq_length + 1 tokens
        try:
            self.documents = MaskedDocuments(tokens_prefix(self.prefix))
        except IndexFormatError as error:
            raise PreferenceDataError(f"{preference_meta_path(self.prefix)} describes data that cannot be read: "
                                      f"{error}; " + _FIX.format(prefix=self.prefix)) from None
        if len(self.documents) != 2 * self.meta["pairs"]:
            raise PreferenceDataError(
                f"{preference_meta_path(self.prefix)} says {self.meta['pairs']} pairs, but "
                f"{self.documents.tokens.idx_file} holds {len(self.documents)} documents, not "
                f"{2 * self.meta['pairs']} (two per pair): the token files were rewritten after the JSON; "
                + _FIX.format(prefix=self.prefix))

    def __len__(self) -> int:
        return self.meta["pairs"]

    def pair(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(chosen_tokens, chosen_mask, rejected_tokens, rejected_mask) of pair ``index``: int64, uint8, int64, uint8."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} of {len(self)} in {self.prefix}")
        index %= len(self)
        chosen, chosen_mask = self.documents[2 * index]
        rejected, rejected_mask = self.documents[2 * index + 1]
        return (np.array(chosen, dtype=np.int64), np.array(chosen_mask, dtype=np.uint8),
                np.array(rejected, dtype=np.int64), np.array(rejected_mask, dtype=np.uint8))

    def check_fingerprint(self) -> None:
        """Re-hash the four files; a PreferenceDataError naming both fingerprints when they differ from the JSON's."""
        actual = data_fingerprint(self.prefix)
        if actual != self.fingerprint:
            raise PreferenceDataError(f"{preference_meta_path(self.prefix)} records the fingerprint {self.fingerprint} "
                                      f"but the files hash to {actual}: they changed after the JSON was written; "
                                      + _FIX.format(prefix=self.prefix))
