"""Preference data (tools/preprocess_data.py --preference, data/preference_preprocess.py, data/preference.py): the
pairs and their masks equal TRL 1.16's DPOTrainer tokenisation, bad records are named and counted, the JSON is
written last, and the reader and the fingerprint catch what does not match.

The reference is TRL's own code on the same records: ``DPOTrainer._prepare_dataset`` (extract_prompt, add_eos, the
tokenisation, the drop of prompts that fill max_length) then ``DataCollatorForPreference`` (the concatenation, the
completion mask, the keep_start truncation), each row unpadded by its attention mask. Exact comparisons: token ids
and mask bits are integers.

The tokenizers follow the conventions of the two instruct families users fine-tune most (no real ones are on this
machine): GPT-2's BPE with the test templates (tests/data/chat_templates), their special tokens, the split regex of
Llama 3's / Qwen2's tokenizer (so that the end of a generation prompt, "\\n\\n" or "\\n", is one token whatever
follows, as in theirs) and eos the end-of-turn token; Llama 3's also prepends its bos to plain text, as Llama 3's
tokenizer does (the template writes it itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from data import preference_preprocess
from data.chat import BadRecord
from data.preference import (
    PREFERENCE_SUFFIX,
    PreferenceDataError,
    PreferencePairs,
    data_files,
    data_fingerprint,
    preference_meta_path,
)
from data.preference_preprocess import (
    PairRefused,
    PreferenceEncoder,
    PreferencePreprocessConfig,
    extract_prompt,
    preprocess_preference,
)
from data.preprocess import BadInputError
from tests.test_chat_data import SPECIAL, TEMPLATES, write_jsonl
from tools.preprocess_data import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "data" / "corpus" / "preference_demo.jsonl")
SPLIT = {  # the pre-tokenizer regexes of Llama 3's and Qwen2's tokenizer.json (Qwen2: one digit a token)
    "llama3_style": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                    r"\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen_style": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
STYLES = tuple(SPLIT)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are kind and correct."}
RECORDS = {
    "conversational": [
        {"prompt": [SYSTEM, user("Capital of Japan?")], "chosen": [assistant("Tokyo.")],
         "rejected": [assistant("Look it up yourself.")]},
        {"prompt": [user("2 + 2?"), assistant("4."), user("And 3 + 3?")], "chosen": [assistant("6.")],
         "rejected": [assistant("7, obviously.")]},
        {"prompt": [user("Say hi.")], "chosen": [assistant(" Hi there! ")], "rejected": [assistant("No.")]},
    ],
    "implicit": [
        {"chosen": [SYSTEM, user("Opposite of hot?"), assistant("Cold.")],
         "rejected": [SYSTEM, user("Opposite of hot?"), assistant("Warm.")]},
        {"chosen": [user("Hello"), assistant("Hello! How can I help?")],
         "rejected": [user("Hello"), assistant("What now?")]},
    ],
    "plain": [
        {"prompt": "Q: What is 2 + 2?\nA:", "chosen": " 4.", "rejected": " 5."},
        {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome, I think."},
    ],
    "plain_implicit": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Thanks! You are welcome.", "rejected": "Thanks! Whatever."},
    ],
}


def style_tokenizer(style: str):
    from tokenizers import Regex, pre_tokenizers

    from hf.tokenizer import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(1024)
    if style == "llama3_style":
        tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL, "bos_token": "<|begin_of_text|>",
                                      "eos_token": "<|eot_id|>"})
        tokenizer.add_bos_token = True
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL, "eos_token": "<|im_end|>"})
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT[style]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.chat_template = (TEMPLATES / f"{style}.jinja").read_text()
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {style: style_tokenizer(style) for style in STYLES}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    """The Qwen-style tokenizer saved where --tokenizer-model finds it (GPT-2's own split regex once reloaded)."""
    directory = tmp_path_factory.mktemp("qwen_style")
    style_tokenizer("qwen_style").save_pretrained(str(directory))
    return str(directory)


def trl_pairs(tokenizer, records: list[dict], seq_length: int | None = None) -> list[tuple[list, ...]]:
    """TRL 1.16's (chosen ids, chosen mask, rejected ids, rejected mask) of each pair it keeps (module docstring)."""
    import datasets
    import trl
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    assert trl.__version__ == "1.16.0", f"the reference is TRL 1.16.0's private _prepare_dataset, got {trl.__version__}"
    datasets.disable_progress_bars()
    max_length = None if seq_length is None else seq_length + 1
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start")
    rows = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), datasets.Dataset.from_list(records),
                                       tokenizer, args, "train")
    collator = DataCollatorForPreference(pad_token_id=0, max_length=max_length)
    pairs = []
    for row in rows:
        batch = collator([{key: row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        pairs.append(tuple(batch[key][side, :lengths[side]].tolist() for side in (0, 1)
                           for key in ("input_ids", "completion_mask")))
    return pairs


def run(tmp_path: Path, tokenizer, records_or_path, name: str = "pref", **options):
    path = records_or_path if isinstance(records_or_path, str) else write_jsonl(tmp_path / f"{name}.jsonl",
                                                                                  records_or_path)
    config = PreferencePreprocessConfig(input=path, output_prefix=str(tmp_path / name), progress=False,
                                        chat_template="tokenizer", **options)
    report = preprocess_preference(config, tokenizer=tokenizer)
    return report, PreferencePairs(tmp_path / name)


def as_lists(pairs: PreferencePairs) -> list[tuple[list, ...]]:
    return [tuple(array.tolist() for array in pairs.pair(i)) for i in range(len(pairs))]


@pytest.mark.parametrize("style", STYLES)
def test_pairs_and_masks_equal_trls_tokenisation(tmp_path, tokenizers, style) -> None:
    tokenizer = tokenizers[style]
    for kind, records in RECORDS.items():
        report, pairs = run(tmp_path, tokenizer, records, kind)
        ours, theirs = as_lists(pairs), trl_pairs(tokenizer, records)
        assert len(ours) == len(theirs) == len(records) == report.pairs and not report.refused
        for number, (mine, trls) in enumerate(zip(ours, theirs, strict=True)):
            assert mine == trls, f"{style} {kind} pair {number}: ids and masks differ from TRL's"
        chosen, chosen_mask, rejected, rejected_mask = pairs.pair(0)
        assert chosen.dtype == np.int64 and chosen_mask.dtype == np.uint8
        assert 0 < chosen_mask.sum() < chosen.size and chosen_mask[-1] == 1  # the completion, the end token included
    end = tokenizer.eos_token  # the last kind, plain implicit: the prompt is the characters both start with
    assert tokenizer.decode(chosen[chosen_mask == 1]) == " blue." + end
    assert tokenizer.decode(rejected[rejected_mask == 1]) == " green." + end
    assert tokenizer.decode(chosen[chosen_mask == 0]) == tokenizer.decode(rejected[rejected_mask == 0])


def test_the_shipped_set_equals_trl(tmp_path, tokenizers) -> None:
    tokenizer = tokenizers["llama3_style"]
    records = [json.loads(line) for line in Path(DEMO).read_text().splitlines()]
    report, pairs = run(tmp_path, tokenizer, DEMO)
    assert report.records == report.pairs == len(pairs) == 200
    assert as_lists(pairs) == trl_pairs(tokenizer, records)
    ids, mask, _, _ = pairs.pair(0)
    assert tokenizer.decode(ids[mask == 1]) == records[0]["chosen"][0]["content"] + "<|eot_id|>"


@pytest.mark.parametrize(("seq_length", "kept", "truncated"), [(26, 2, 2), (48, 3, 1)])
def test_truncation_is_trls_and_drop_refuses(tmp_path, tokenizers, seq_length, kept, truncated) -> None:
    """Qwen style: the pairs' prompts have 24, 45, 23 and 61 tokens, their sequences 29 to 65."""
    tokenizer = tokenizers["qwen_style"]
    records = RECORDS["conversational"] + [{"prompt": [user("word " * 40)], "chosen": [assistant("A.")],
                                            "rejected": [assistant("B.")]}]
    report, pairs = run(tmp_path, tokenizer, records, "truncate", seq_length=seq_length)
    theirs = trl_pairs(tokenizer, records, seq_length)  # TRL drops the pairs whose prompt fills max_length
    assert as_lists(pairs) == theirs and len(theirs) == kept
    assert all(len(sequence) <= seq_length + 1 for pair in theirs for sequence in pair)
    assert report.truncated == truncated and dict(report.refused) == {"longer than seq_length": 4 - kept}
    assert report.refused_lines[-1] == (f"{tmp_path / 'truncate.jsonl'}:4: longer than seq_length (the prompt alone "
                                        f"has 61 tokens, at least --seq-length {seq_length} + 1: truncated, no "
                                        f"completion token would be left (TRL drops it too))")
    assert pairs.meta["seq_length"] == seq_length and pairs.meta["truncation"] == "truncate"
    whole = [pair for pair in trl_pairs(tokenizer, records) if max(len(pair[0]), len(pair[2])) <= seq_length + 1]
    if not whole:
        with pytest.raises(BadInputError, match=r"no pairs \(every record was refused or bad: \{'longer than "
                                                r"seq_length': 4\}\); nothing was written"):
            run(tmp_path, tokenizer, records, "drop", seq_length=seq_length, truncation="drop")
        return
    report, pairs = run(tmp_path, tokenizer, records, "drop", seq_length=seq_length, truncation="drop")
    assert as_lists(pairs) == whole and report.truncated == 0 and pairs.meta["truncation"] == "drop"
    assert report.refused_lines[0] == (f"{tmp_path / 'drop.jsonl'}:2: longer than seq_length (chosen 49 and rejected "
                                       f"51 tokens, more than --seq-length {seq_length} + 1 (--preference-truncation "
                                       f"drop))")


def test_bad_records_are_named_by_line_and_counted(tmp_path, tokenizers) -> None:
    tokenizer = tokenizers["llama3_style"]
    good = RECORDS["conversational"][0]
    records = [
        good,
        {"prompt": [user("Hi")], "chosen": [assistant("")], "rejected": [assistant("Hello.")]},  # 2
        {"prompt": "Tell me:", "chosen": "", "rejected": " no."},  # 3
        {"prompt": [user("Hi")], "chosen": [assistant("Hello.")], "rejected": [assistant("Hello.")]},  # 4
        {"prompt": [user("Hi")], "chosen": [assistant("Hello.")], "rejected": [assistant(" Hello. ")]},  # 5: trimmed
        {"prompt": "Hello wor", "chosen": "ld!", "rejected": "ms!"},  # 6: "wor" + "ld" is one word
        "{not json",  # 7
        {"prompt": [user("Hi")], "chosen": [assistant("Hello.")], "rejected": [{"role": "assistant"}]},  # 8
        {"prompt": [user("Q")], "chosen": "A", "rejected": "B"},  # 9
        {"chosen": "only one"},  # 10
        good,
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(BadInputError, match=r"bad.jsonl:7: malformed JSON .* --skip-bad-lines"):
        run(tmp_path, tokenizer, path, "bad")
    assert not list(tmp_path.glob("bad_*"))  # nothing is left behind
    report, pairs = run(tmp_path, tokenizer, path, "bad", skip_bad_lines=True)
    assert [line.split(": ", 1)[0] for line in report.refused_lines] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6)]
    reasons = [line.split(": ", 1)[1] for line in report.refused_lines]
    assert reasons[:4] == ["empty completion (the chosen completion has no text)",
                           "empty completion ('chosen' is empty)",
                           "chosen identical to rejected (both sequences are the same 15 tokens)",
                           "chosen identical to rejected (both sequences are the same 15 tokens)"]
    assert reasons[4] == ("prompt not a prefix (the prompt's tokens are not a prefix of prompt + chosen: they "
                          "diverge at token 2, ' wor' vs ' world!<|eot_id|>')")  # token 0: the bos
    assert report.skipped_examples == [f"{path}:7: malformed JSON (Expecting property name enclosed in double "
                                       f"quotes at column 2)",
                                       f"{path}:8: 'rejected'[0] (assistant) must have a string 'content', got "
                                       f"NoneType",
                                       f"{path}:9: 'prompt' is a list but 'chosen' and 'rejected' are strs: give all "
                                       f"three as strings or all as lists of messages",
                                       f"{path}:10: a preference record needs 'chosen' and 'rejected' (and "
                                       f"optionally 'prompt'); it lacks 'rejected' (it has ['chosen'])"]
    assert report.pairs + sum(report.refused.values()) + report.skipped == report.records == len(records)
    assert pairs.meta["refused"] == {"empty completion": 2, "chosen identical to rejected": 2,
                                     "prompt not a prefix": 1}
    assert len(pairs) == 2 and as_lists(pairs)[0] == as_lists(pairs)[1]
    summary = report.summary()
    assert f"{path}:6: prompt not a prefix" in summary
    assert ("refused 5 (2 empty completion, 2 chosen identical to rejected, 1 prompt not a prefix); skipped 4 bad "
            "lines") in summary
    assert summary.endswith("11 records: 2 pairs written (0 truncated to seq_length), 5 refused, 4 bad lines skipped")


def test_a_prompt_that_is_not_a_prefix_is_what_trl_warns_about(tokenizers) -> None:
    """TRL keeps the record and starts its completion where the tokens diverge; here it is refused."""
    tokenizer = tokenizers["qwen_style"]
    record = {"prompt": "Hello wor", "chosen": "ld!", "rejected": "ms!"}
    (chosen, chosen_mask, _, _), = trl_pairs(tokenizer, [record])
    prompt = tokenizer("Hello wor")["input_ids"]
    assert chosen_mask.index(1) < len(prompt)  # TRL's completion starts inside the prompt
    with pytest.raises(PairRefused, match="prompt not a prefix"):
        PreferenceEncoder(tokenizer, None)(record)


def test_extract_prompt_is_trls() -> None:
    from trl.data_utils import extract_prompt as trls

    cases = [RECORDS["implicit"][0], RECORDS["plain_implicit"][0], RECORDS["plain_implicit"][1],
             {"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("b"), user("c")]},
             {"chosen": "same start", "rejected": "same start and more"}, {"chosen": "x y", "rejected": "x z"}]
    for case in cases:
        expected = trls(case)
        assert extract_prompt(case["chosen"], case["rejected"]) == (expected["prompt"], expected["chosen"],
                                                                    expected["rejected"])


def test_a_string_prompt_beside_messages_is_extracted_as_trls_maybe_extract_prompt(tokenizers) -> None:
    """UltraFeedback's layout: "prompt" a string, chosen and rejected whole conversations (the prompt inside)."""
    from trl.data_utils import maybe_extract_prompt

    tokenizer = tokenizers["llama3_style"]
    record = {"prompt": "Opposite of hot?", **RECORDS["implicit"][0]}
    pair = PreferenceEncoder(tokenizer, tokenizer.chat_template)(record)
    expected, = trl_pairs(tokenizer, [maybe_extract_prompt(record)])
    assert (pair.chosen.ids, pair.chosen.mask, pair.rejected.ids, pair.rejected.mask) == expected


def test_the_json_is_written_last(tmp_path, tokenizers, monkeypatch) -> None:
    tokenizer = tokenizers["qwen_style"]
    records = RECORDS["conversational"]
    run(tmp_path, tokenizer, records, "pref")
    meta = preference_meta_path(tmp_path / "pref")
    assert meta == str(tmp_path / "pref") + PREFERENCE_SUFFIX and Path(meta).exists()
    written = preference_preprocess.write_preference_meta

    def checked(prefix, content):  # when the JSON is written, the four files are complete
        assert all(Path(path).exists() for path in data_files(prefix))
        assert content["fingerprint"] == data_fingerprint(prefix)
        return written(prefix, content)

    monkeypatch.setattr(preference_preprocess, "write_preference_meta", checked)
    run(tmp_path, tokenizer, records, "pref")

    def crash(prefix):
        raise RuntimeError("killed before the JSON")

    monkeypatch.setattr(preference_preprocess, "data_fingerprint", crash)
    with pytest.raises(RuntimeError, match="killed before the JSON"):
        run(tmp_path, tokenizer, records, "pref")
    assert all(Path(path).exists() for path in data_files(tmp_path / "pref")) and not Path(meta).exists()
    with pytest.raises(PreferenceDataError, match=r"pref_preference.json does not exist: .* is not complete "
                                                  r"preference data .* --preference --output-prefix"):
        PreferencePairs(tmp_path / "pref")


def test_the_reader_refuses_what_does_not_match(tmp_path, tokenizers) -> None:
    tokenizer = tokenizers["qwen_style"]
    run(tmp_path, tokenizer, RECORDS["conversational"], "pref")
    meta_path = Path(preference_meta_path(tmp_path / "pref"))
    meta = json.loads(meta_path.read_text())
    assert set(meta) == {"format", "version", "pairs", "seq_length", "truncation", "tokenizer", "fingerprint",
                         "refused"} and meta["pairs"] == 3 and meta["seq_length"] is None
    for change, message in [({"format": "chat"}, "format 'chat', not 'preference'"),
                            ({"version": 2}, "version 2, this reader knows version 1"),
                            ({"pairs": 4}, r"says 4 pairs, but .*pref_text_document.idx holds 6 documents, not 8")]:
        meta_path.write_text(json.dumps({**meta, **change}))
        with pytest.raises(PreferenceDataError, match=message):
            PreferencePairs(tmp_path / "pref")
    meta_path.write_text("{")
    with pytest.raises(PreferenceDataError, match="not valid JSON"):
        PreferencePairs(tmp_path / "pref")
    meta_path.write_text(json.dumps(meta))
    pairs = PreferencePairs(tmp_path / "pref")
    assert len(pairs) == 3 and pairs.fingerprint == meta["fingerprint"] and pairs.prefix == str(tmp_path / "pref")
    with pytest.raises(IndexError, match="pair 3 of 3"):
        pairs.pair(3)
    Path(data_files(tmp_path / "pref")[2]).unlink()  # the mask's .bin
    with pytest.raises(PreferenceDataError, match=r"cannot be read: .*pref_loss_mask_document.bin does not exist"):
        PreferencePairs(tmp_path / "pref")


def test_the_fingerprint_changes_when_one_token_changes(tmp_path, tokenizers) -> None:
    tokenizer = tokenizers["qwen_style"]
    _, pairs = run(tmp_path, tokenizer, RECORDS["conversational"], "pref")
    pairs.check_fingerprint()
    before = data_fingerprint(tmp_path / "pref")
    assert before == pairs.fingerprint and len(before) == 64
    tokens = Path(data_files(tmp_path / "pref")[0])
    data = bytearray(tokens.read_bytes())
    data[10] ^= 1  # one token id (uint16) changes
    tokens.write_bytes(bytes(data))
    assert data_fingerprint(tmp_path / "pref") != before
    with pytest.raises(PreferenceDataError, match=f"records the fingerprint {before} but the files hash to "):
        PreferencePairs(tmp_path / "pref").check_fingerprint()


def test_the_command_line(tmp_path, qwen_dir, capsys) -> None:
    text = build_parser().format_help()
    assert "--preference" in text and "--preference-truncation {truncate,drop}" in text and "--seq-length N" in text
    prefix = str(tmp_path / "demo")
    common = ["--input", DEMO, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", qwen_dir,
              "--chat-template", "tokenizer", "--no-progress", "--preference"]
    assert main([*common, "--output-prefix", prefix, "--seq-length", "64"]) == 0
    summary = capsys.readouterr().out
    assert f"{prefix}_preference.json" in summary
    assert (f"{DEMO}:66: longer than seq_length (truncated to 65 tokens (--seq-length 64 + 1), chosen and rejected are "
            f"the same: they differ only after that)") in summary  # "The capital of ... is" and 59 prompt tokens
    assert "200 records: 199 pairs written (6 truncated to seq_length), 1 refused, 0 bad lines skipped" in summary
    pairs = PreferencePairs(prefix)
    assert len(pairs) == 199 and pairs.seq_length == 64 and pairs.meta["tokenizer"] == qwen_dir
    assert main([*common, "--output-prefix", str(tmp_path / "two"), "--seq-length", "64", "--workers", "2",
                 "--batch-size", "16"]) == 0
    assert data_fingerprint(tmp_path / "two") == pairs.fingerprint  # the same bytes with two workers
    assert main([*common, "--output-prefix", prefix, "--loss-on", "all"]) == 1
    assert "--loss-on does not apply to --preference data" in capsys.readouterr().err
    assert main(["--input", DEMO, "--output-prefix", prefix, "--seq-length", "8"]) == 1
    assert "--seq-length and --preference-truncation apply to --preference data" in capsys.readouterr().err
    assert main([*common, "--output-prefix", prefix, "--append-eod"]) == 1
    assert "--append-eod and --eod-is-target do not apply to preference data" in capsys.readouterr().err


def test_a_conversational_record_needs_a_template(tokenizers) -> None:
    with pytest.raises(BadRecord, match="needs a chat template: pass --chat-template"):
        PreferenceEncoder(tokenizers["qwen_style"], None)(RECORDS["conversational"][0])
