"""Chat and prompt/completion data: tokens and a loss mask as TRL's SFTTrainer masks (tools/preprocess_data.py with
--chat-template / --loss-on, data/chat.py, data/loss_mask.py).

The tokenizer is the shipped GPT-2 BPE with the special tokens of the two test templates (tests/data/chat_templates/,
one in the style of Llama 3, one of Qwen2.5, each with {% generation %} blocks around the reply and its end-of-turn
token), saved to a directory the tool loads offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.chat import BadRecord, ChatEncoder, has_generation_blocks, strip_generation_blocks
from data.chat_preprocess import ChatPreprocessConfig, preprocess_chat
from data.indexed_dataset import IndexedDataset
from data.loss_mask import LossMaskMismatchError, MaskedDocuments, loss_mask_prefix
from data.preprocess import BadInputError
from tests.test_data_reference import reference_bin_bytes, reference_idx_bytes
from tools.preprocess_data import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
CHAT_DEMO = str(ROOT / "data" / "corpus" / "chat_demo.jsonl")
SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
END_OF_TURN = {"llama3_style": "<|eot_id|>", "qwen_style": "<|im_end|>"}
EOD = 50256

CONVERSATIONS = [  # multi-turn, with system prompts (and one without, where qwen_style adds its default)
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of Japan?"},
     {"role": "assistant", "content": "Tokyo."}, {"role": "user", "content": "And of Kenya?"},
     {"role": "assistant", "content": "Nairobi."}],
    [{"role": "system", "content": "Answer in one line.\nNo lists."}, {"role": "user", "content": "Why is ice slippery?"},
     {"role": "assistant", "content": "A thin film of water forms on its surface."},
     {"role": "user", "content": "Even when very cold?"},
     {"role": "assistant", "content": "Less so: at -30 C ice grips almost like sand."},
     {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": " You're welcome. "}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from hf.tokenizer import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(1024)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = template("qwen_style")  # saved with it: --chat-template tokenizer
    directory = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


def run(tmp_path, tokenizer, records_or_path, name="out", **options):
    path = records_or_path if isinstance(records_or_path, str) else write_jsonl(tmp_path / f"{name}.jsonl",
                                                                                  records_or_path)
    config = ChatPreprocessConfig(input=path, output_prefix=str(tmp_path / name), progress=False, **options)
    report = preprocess_chat(config, tokenizer=tokenizer)
    return report, MaskedDocuments(report.outputs[0])


@pytest.mark.parametrize(("name", "choice"), [("llama3_style", "file"), ("qwen_style", "tokenizer")])
def test_the_tools_mask_is_transformers_assistant_mask(tmp_path, tokenizer_dir, tokenizer, capsys, name,
                                                       choice) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    prefix = str(tmp_path / "chat")
    chosen = str(TEMPLATES / f"{name}.jinja") if choice == "file" else "tokenizer"
    assert main(["--input", path, "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", tokenizer_dir, "--chat-template", chosen, "--no-progress"]) == 0
    summary = capsys.readouterr().out
    documents = MaskedDocuments(f"{prefix}_text_document")
    assert len(documents) == len(CONVERSATIONS)
    total = targets = 0
    for (ids, mask), messages in zip(documents, CONVERSATIONS, strict=True):
        expected = tokenizer.apply_chat_template(messages, chat_template=template(name), tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(expected["input_ids"])
        assert mask.tolist() == list(expected["assistant_masks"])  # position by position
        replies = [m["content"].strip() if name == "llama3_style" else m["content"] for m in messages
                   if m["role"] == "assistant"]
        assert tokenizer.decode(ids[mask == 1]) == "".join(r + END_OF_TURN[name] for r in replies)
        total, targets = total + ids.size, targets + int(mask.sum())
    assert "masks from the {% generation %} blocks" in summary
    assert f"3 documents written, {total} tokens, {targets / total:.1%} of them targets; refused 0" in summary


def test_incremental_rendering_gives_the_generation_blocks_mask(tmp_path, tokenizer) -> None:
    with_blocks = tmp_path / "qwen.jinja"
    without = tmp_path / "qwen_stripped.jinja"
    with_blocks.write_text(template("qwen_style"))
    without.write_text(strip_generation_blocks(template("qwen_style")))
    assert has_generation_blocks(with_blocks.read_text()) and not has_generation_blocks(without.read_text())
    a, _ = run(tmp_path, tokenizer, CHAT_DEMO, "blocks", chat_template=str(with_blocks), append_eod=True)
    b, _ = run(tmp_path, tokenizer, CHAT_DEMO, "incremental", chat_template=str(without), append_eod=True)
    assert "incremental rendering" in b.masks_from and "generation" in a.masks_from
    assert a.documents == b.documents == 61 and a.target_tokens == b.target_tokens > 0
    for prefix_a, prefix_b in zip(a.outputs, b.outputs, strict=True):
        for suffix in (".bin", ".idx"):
            assert Path(prefix_a + suffix).read_bytes() == Path(prefix_b + suffix).read_bytes()
    ids, mask = MaskedDocuments(a.outputs[0])[0]  # the eod follows an assistant turn, and is no target (TRL's mask)
    assert ids[-1] == EOD and mask[-1] == 0 and tokenizer.decode(ids[mask == 1]) == "Paris.<|im_end|>Rome.<|im_end|>"


def test_a_template_that_is_not_prefix_stable_is_a_clear_error(tmp_path, tokenizer) -> None:
    # GPT-2's BPE tokenises "\n\n" alone as one token but "\n\nTokyo" as "\n", "\n", "Tokyo": the generation
    # prompt of the Llama 3 style template is not a token prefix of the turn that follows it
    stripped = ChatEncoder(tokenizer, strip_generation_blocks(template("llama3_style")))
    with pytest.raises(BadRecord, match=r"not prefix-stable: the tokens of messages\[:2\] with the generation "
                                        r"prompt .* diverge at token .* add \{% generation %\} blocks"):
        stripped({"messages": CONVERSATIONS[0]})
    path = tmp_path / "llama_stripped.jinja"
    path.write_text(strip_generation_blocks(template("llama3_style")))
    records = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(BadInputError, match=r"chat.jsonl:1: the chat template is not prefix-stable.*--skip-bad-lines"):
        run(tmp_path, tokenizer, records, chat_template=str(path))
    # with the blocks the same template works
    assert ChatEncoder(tokenizer, template("llama3_style"))({"messages": CONVERSATIONS[0]}).mask.count(1) > 0


@pytest.mark.parametrize("eod_is_target", [False, True])
def test_prompt_completion_masks(tmp_path, tokenizer, eod_is_target) -> None:
    """The appended end token is no target (TRL's mask), unless --eod-is-target: then it is after a final target."""
    records = [{"prompt": "Q: What is two plus two?\nA:", "completion": " Four."},
               {"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello?"}],
                "completion": [{"role": "assistant", "content": "Hello there."}]}]
    report, documents = run(tmp_path, tokenizer, records, chat_template=str(TEMPLATES / "qwen_style.jinja"),
                            append_eod=True, eod_is_target=eod_is_target)
    (ids, mask), (chat_ids, chat_mask) = documents
    prompt = tokenizer(records[0]["prompt"])["input_ids"]
    end = "<|endoftext|>" if eod_is_target else ""
    assert ids.tolist() == tokenizer("Q: What is two plus two?\nA: Four.")["input_ids"] + [EOD]
    assert mask.tolist() == [0] * len(prompt) + [1] * (ids.size - len(prompt) - 1) + [int(eod_is_target)]
    assert tokenizer.decode(ids[mask == 1]) == " Four." + end
    text = tokenizer.decode(chat_ids)
    assert text.endswith("<|im_start|>assistant\nHello there.<|im_end|>\n<|endoftext|>")
    # the newline the template writes after <|im_end|> is not the reply's
    assert tokenizer.decode(chat_ids[chat_mask == 1]) == "Hello there.<|im_end|>" + end
    assert chat_mask[-2:].tolist() == [0, int(eod_is_target)]
    everything, documents = run(tmp_path, tokenizer, records, "all", chat_template=str(TEMPLATES / "qwen_style.jinja"),
                                loss_on="all", append_eod=True, eod_is_target=eod_is_target)
    assert all(mask[:-1].all() and mask[-1] == eod_is_target for _, mask in documents)
    assert everything.target_fraction == (1.0 if eod_is_target else 1 - 2 / sum(len(m) for _, m in documents))


def test_loss_on_completion_of_a_chat_is_its_last_reply(tmp_path, tokenizer) -> None:
    for name in ("qwen_style", "llama3_style"):
        _, documents = run(tmp_path, tokenizer, [{"messages": CONVERSATIONS[0]}], name,
                           chat_template=str(TEMPLATES / f"{name}.jinja"), loss_on="completion")
        ids, mask = documents[0]
        assert tokenizer.decode(ids[mask == 1]) == "Nairobi." + END_OF_TURN[name]


def test_examples_without_targets_are_refused_and_counted(tmp_path, tokenizer) -> None:
    good = {"messages": CONVERSATIONS[2]}
    records = [good, {"messages": CONVERSATIONS[0][:2]},  # system and user, no assistant
               {"prompt": "Tell me.", "completion": ""}, good,
               {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                             {"role": "user", "content": "z"}]}]
    report, documents = run(tmp_path, tokenizer, records, chat_template=str(TEMPLATES / "qwen_style.jinja"),
                            loss_on="completion")
    assert report.documents == len(documents) == 2
    assert dict(report.refused) == {"no target token": 1,
                                    "--loss-on completion: the last message is not the assistant's": 2}
    report, documents = run(tmp_path, tokenizer, records, "assistant", chat_template=str(TEMPLATES / "qwen_style.jinja"))
    assert dict(report.refused) == {"no assistant message": 1, "no target token": 1}
    assert report.documents == 3 and report.skipped == 0
    assert report.refused_examples == ["%s:2: no assistant message" % (tmp_path / "assistant.jsonl"),
                                       "%s:3: no target token" % (tmp_path / "assistant.jsonl")]
    assert "refused 2 (1 no assistant message, 1 no target token)" in report.summary()


def test_malformed_lines_name_the_file_and_line_or_are_counted(tmp_path, tokenizer) -> None:
    qwen = str(TEMPLATES / "qwen_style.jinja")
    records = [{"messages": CONVERSATIONS[2]}, "{not json", {"messages": [{"role": "user"}]},
               {"text": "plain"}, {"messages": CONVERSATIONS[0]}]
    with pytest.raises(BadInputError, match=r"bad.jsonl:2: malformed JSON .* --skip-bad-lines"):
        run(tmp_path, tokenizer, records, "bad", chat_template=qwen)
    assert not (tmp_path / "bad_text_document.idx").exists()  # nothing is left behind
    report, documents = run(tmp_path, tokenizer, records, "bad", chat_template=qwen, skip_bad_lines=True)
    assert (report.documents, report.skipped, len(documents)) == (2, 3, 2)
    assert report.skipped_examples[1].endswith("bad.jsonl:3: 'messages'[0] (user) must have a string 'content', "
                                               "got NoneType")
    assert "expected 'messages', or 'prompt' and 'completion'" in report.skipped_examples[2]
    assert "skipped 3 bad lines" in report.summary()
    with pytest.raises(BadInputError, match="needs a chat template: pass --chat-template"):
        run(tmp_path, tokenizer, [{"messages": CONVERSATIONS[2]}], "none")


def test_the_tokens_are_megatrons_bytes_and_the_mask_is_uint8_beside_them(tmp_path, tokenizer) -> None:
    report, documents = run(tmp_path, tokenizer, [{"messages": m} for m in CONVERSATIONS],
                            chat_template=str(TEMPLATES / "llama3_style.jinja"), append_eod=True)
    pairs = [(ids.tolist(), mask.tolist()) for ids, mask in documents]
    tokens = [[ids] for ids, _ in pairs]
    masks = [[mask] for _, mask in pairs]
    prefix, mask_prefix = report.outputs
    assert mask_prefix == loss_mask_prefix(prefix) and prefix.endswith("out_text_document")
    assert Path(prefix + ".idx").read_bytes() == reference_idx_bytes(tokens, 8, 2)  # uint16, as Megatron writes
    assert Path(prefix + ".bin").read_bytes() == reference_bin_bytes(tokens, "H")
    assert Path(mask_prefix + ".idx").read_bytes() == reference_idx_bytes(masks, 1, 1)  # uint8
    assert Path(mask_prefix + ".bin").read_bytes() == reference_bin_bytes(masks, "B")
    dataset = IndexedDataset(prefix)  # the existing reader
    dataset.verify()
    assert [dataset[i].tolist() for i in range(len(dataset))] == [ids for ids, _ in pairs]
    assert all(ids[0] == EOD and ids[-1] == EOD for ids, _ in pairs)  # the template's bos, the appended eod
    assert documents.target_fraction() == pytest.approx(report.target_fraction)


def test_a_mask_that_does_not_match_its_tokens_is_refused_on_opening(tmp_path, tokenizer) -> None:
    qwen = str(TEMPLATES / "qwen_style.jinja")
    three, _ = run(tmp_path, tokenizer, [{"messages": m} for m in CONVERSATIONS], "three", chat_template=qwen)
    two, _ = run(tmp_path, tokenizer, [{"messages": m} for m in CONVERSATIONS[1:]], "two", chat_template=qwen)
    other, _ = run(tmp_path, tokenizer, [{"messages": m} for m in CONVERSATIONS[::-1]], "other", chat_template=qwen)
    with pytest.raises(LossMaskMismatchError, match=r"the loss mask .*two_loss_mask_document.idx does not match the "
                                                    r"tokens .*three_text_document.idx: 2 documents in the mask, 3 "
                                                    r"in the tokens.* re-run it"):
        MaskedDocuments(three.outputs[0], two.outputs[1])
    with pytest.raises(LossMaskMismatchError, match="sequence lengths differ first at sequence 0"):
        MaskedDocuments(three.outputs[0], other.outputs[1])
    with pytest.raises(LossMaskMismatchError, match="holds uint16, not uint8"):
        MaskedDocuments(three.outputs[0], other.outputs[0])
    assert len(MaskedDocuments(three.outputs[0])) == 3


def test_two_workers_write_the_same_bytes(tmp_path, tokenizer) -> None:
    qwen = str(TEMPLATES / "qwen_style.jinja")
    one, _ = run(tmp_path, tokenizer, CHAT_DEMO, "one", chat_template=qwen, batch_size=8)
    two, _ = run(tmp_path, tokenizer, CHAT_DEMO, "two", chat_template=qwen, batch_size=8, workers=2)
    for a, b in zip(one.outputs, two.outputs, strict=True):
        assert Path(a + ".bin").read_bytes() == Path(b + ".bin").read_bytes()
        assert Path(a + ".idx").read_bytes() == Path(b + ".idx").read_bytes()


def test_the_default_gpt2_tokenizer_renders_a_template_as_text(tmp_path, capsys) -> None:
    """GPT-2's BPE without the template's special tokens: <|im_end|> is text, the blocks still mark the replies."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    assert main(["--input", path, "--output-prefix", str(tmp_path / "gpt2"), "--append-eod", "--no-progress",
                 "--chat-template", str(TEMPLATES / "qwen_style.jinja")]) == 0
    assert "1 documents written" in capsys.readouterr().out
    ids, mask = MaskedDocuments(tmp_path / "gpt2_text_document")[0]
    from data.tokenizers import GPT2BPETokenizer

    gpt2 = GPT2BPETokenizer()
    start = gpt2.encode("<|im_start|>system")  # text: the project's own GPT-2 ids
    assert ids[: len(start)].tolist() == start and len(start) == 8
    assert gpt2.decode(ids[mask == 1].tolist()) == "Tokyo.<|im_end|>Nairobi.<|im_end|>"  # the eod: no target
    assert gpt2.decode(ids.tolist()).endswith("<|im_start|>assistant\nNairobi.<|im_end|>\n<|endoftext|>")


def test_the_flags_are_documented_and_checked(tmp_path, capsys) -> None:
    text = build_parser().format_help()
    assert "--chat-template tokenizer|FILE" in text and "--loss-on {assistant,completion,all}" in text
    with pytest.raises(ValueError, match="need a Hugging Face tokenizer"):
        preprocess_chat(ChatPreprocessConfig(input=CHAT_DEMO, output_prefix=str(tmp_path / "x"), progress=False,
                                             tokenizer_type="SentencePieceTokenizer", tokenizer_model="m.model",
                                             chat_template="tokenizer"))
    assert main(["--input", CHAT_DEMO, "--output-prefix", str(tmp_path / "x"), "--chat-template", "tokenizer"]) == 1
    assert "the tokenizer has no chat template" in capsys.readouterr().err  # GPT-2's has none
    assert main(["--input", CHAT_DEMO, "--output-prefix", str(tmp_path / "x"), "--chat-template", "nope.jinja"]) == 1
    assert "--chat-template nope.jinja: no such file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="--json-keys does not apply"):
        ChatPreprocessConfig(input=CHAT_DEMO, output_prefix=str(tmp_path / "x"), json_keys=("messages",))
