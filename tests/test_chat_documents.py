"""Packed chat fine-tuning keeps every conversation whole with the tokenizers users fine-tune most, whose end-of-text
token is the template's end-of-turn token: Qwen's (eos <|im_end|>) and Llama 3's (eos <|eot_id|>).

Each tokenizer is the shipped GPT-2 BPE with the templates' special tokens, its eos set to the end-of-turn token and
the test template as its chat template (tests/data/chat_templates, {% generation %} blocks), as the models' own
tokenizers are. The shipped chat set is tokenised as a user would (tools/preprocess_data.py --chat-template tokenizer
--append-eod: the appended end-of-document token is that eos again), packed whole into samples of 257 tokens (bfd,
document masks and reset positions by default), and one step of a Llama-style model (RoPE, GQA, RMSNorm, SwiGLU,
untied head) runs at TP 2 x PP 2 with the loss over the step's target tokens, from weights saved just before it and
exported to Hugging Face. Compared with transformers, run on each conversation alone:

- every per-token loss of every conversation of the step (each prediction inside it, targets or not), within 1e-5
  (relative, fp32): nothing of a conversation is cut off from what comes before it;
- the step's loss, the mean over TRL's assistant targets (apply_chat_template's assistant mask: the replies and their
  end-of-turn tokens; the appended end token is none), within 1e-5.

Measured: the worst per-token loss 2.6e-7 (Qwen style) and 1.9e-7 (Llama 3 style) relative from transformers'; the
step's loss 10.935074 against 10.935073 and 10.974458 against 10.974457, over 433 and 426 targets. Before document
boundaries came from the dataset's index (data.document_boundaries), the end-token rule cut every conversation at
every <|im_end|> / <|eot_id|> and the appended end token was a target: per-token losses up to 15% (Qwen style) and
12% (Llama 3 style) off, the step's loss 10.942365 (Qwen style) and 11.005579 (Llama 3 style).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_chat_data import TEMPLATES
from tests.test_model_parallel import SEED, deepspeed_config
from tests.test_sft_against_transformers import GLOBAL_BATCH, MICRO_BATCH, SEQ_LENGTH, the_batch
from tools import convert_to_hf
from tools.preprocess_data import main as preprocess_data

ROOT = Path(__file__).resolve().parents[1]
CHAT_DEMO = ROOT / "data" / "corpus" / "chat_demo.jsonl"
SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
END_OF_TURN = {"qwen_style": "<|im_end|>", "llama3_style": "<|eot_id|>"}
TOLERANCE = 1e-5


def chat_tokenizer(style: str, directory: Path):
    """GPT-2's BPE with the special tokens, eos the template's end-of-turn token, saved where AutoTokenizer finds it."""
    from hf.tokenizer import gpt2_tokenizer

    tokenizer = gpt2_tokenizer(1024)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL, "eos_token": END_OF_TURN[style]})
    tokenizer.chat_template = (TEMPLATES / f"{style}.jinja").read_text()
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def run_config(style: str, directory: Path, tokenizer):
    """The chat set tokenised with the style's tokenizer, and the run: llama-tiny at TP 2 x PP 2, packed whole."""
    from runconfig.run import load_run_config

    prefix = directory / "chat"
    assert preprocess_data(["--input", str(CHAT_DEMO), "--output-prefix", str(prefix), "--tokenizer-type",
                            "HuggingFaceTokenizer", "--tokenizer-model", str(directory / "tokenizer"),
                            "--chat-template", "tokenizer", "--append-eod", "--no-progress"]) == 0
    return load_run_config("ds_configs/llama-tiny-cpu.json", [
        f"model.seq_length={SEQ_LENGTH}", f"model.vocab_size={len(tokenizer)}",
        f"train_micro_batch_size_per_gpu={MICRO_BATCH}", f"train_batch_size={GLOBAL_BATCH}",
        "schedule.batch.start=4", "data.split=\"1\"", "training.eval_iters=0",
        f"data.blend=[[1.0, \"{prefix}_text_document\"]]", f"data.cache_dir=\"{directory / 'index-cache'}\"",
        f"data.eod_token_id={tokenizer.eos_token_id}", "data.packing=\"bfd\"", "training.loss_normalization=\"tokens\""])


def _steps(variants: dict) -> dict:
    """For each style: save the initial weights, then one training step; the step's loss and, on the last stage,
    every micro-batch's per-token losses (b, s)."""
    from model.layers import vocab_parallel_cross_entropy
    from runconfig.run import parse_run_config
    from training.checkpoint import save_checkpoint
    from training.engine import build_engine
    from training.loss_normalization import set_step_tokens

    results = {}
    for style, (directory, raw_config, micro_batches) in variants.items():
        config = parse_run_config(raw_config)
        ds_config = {**deepspeed_config("fp32"), "train_batch_size": GLOBAL_BATCH,
                     "train_micro_batch_size_per_gpu": MICRO_BATCH}
        engine, ctx = build_engine(config.model, config.parallelism, ds_config, SEED)
        save_checkpoint(engine, directory, 0, {"run_config": raw_config, "train_state": {
            "step": 0, "consumed_samples": 0, "consumed_tokens": 0, "global_batch": GLOBAL_BATCH}})
        objective, per_token = engine.module.loss_fn, []

        def recording(logits, labels, objective=objective, per_token=per_token, ctx=ctx):
            vocab_start = ctx.tensor_parallel_rank * logits.shape[-1]
            per_token.append(vocab_parallel_cross_entropy(logits, labels[0], ctx.tensor_parallel_group,
                                                          vocab_start).detach())
            return objective(logits, labels)

        engine.module.loss_fn = recording
        set_step_tokens(engine.module.objective, micro_batches, engine.grid.get_data_parallel_group(), 1)
        results[style] = {"loss": engine.train_batch(data_iter=iter(micro_batches)).item(),
                          "per_token": per_token if engine.is_last_stage() else None}
        del engine
    return results


def conversations_of(config, micro_batches: list) -> list[list[tuple[int, int, list[int]]]]:
    """For each sample of the step: (document, offset in the sample, its tokens) of each conversation in it, read
    from the pack index's pieces (data/packing.py) and the dataset, independently of how the loader tells the
    documents apart; checked against the tokens the loader yields."""
    from training.data import build_datasets

    train, _ = build_datasets(config)
    samples = torch.cat([torch.cat([tokens[:, :1], labels], dim=1) for (tokens, *_), (labels, _) in micro_batches])
    layout = []
    for index, sample in enumerate(samples):
        pieces = train.pieces[train.pack_offsets[index]:train.pack_offsets[index + 1]]
        assert (pieces[:, 1] == 0).all()  # whole conversations: none longer than a sample
        offset, found = 0, []
        for document, _, length in pieces.tolist():
            start = train.indexed.document_start(document)
            tokens = train.indexed.tokens[start:start + length].tolist()
            assert sample[offset:offset + length].tolist() == tokens
            found.append((document, offset, tokens))
            offset += length
        layout.append(found)
    return layout


def transformers_alone(model, tokenizer, messages: list[dict], tokens: list[int]) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """transformers' per-token losses over one conversation alone, positions from 0, and TRL's assistant mask
    (label-aligned: the label of position j is token j + 1)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    assert tokens == [*rendered["input_ids"], tokenizer.eos_token_id]  # the record, and the end token appended
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(len(tokens))[None], use_cache=False).logits[0]
    losses = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[0, 1:], reduction="none")
    return losses, torch.tensor([*rendered["assistant_masks"], 0])[1:].bool()


@pytest.mark.distributed
def test_packed_conversations_stay_whole_with_an_end_of_turn_eos(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = [json.loads(line)["messages"] for line in CHAT_DEMO.read_text().splitlines()]
    variants, configs, tokenizers = {}, {}, {}
    for style in END_OF_TURN:
        directory = tmp_path / style
        chat_tokenizer(style, directory / "tokenizer")
        tokenizers[style] = AutoTokenizer.from_pretrained(str(directory / "tokenizer"), local_files_only=True)
        configs[style] = run_config(style, directory, tokenizers[style])
        variants[style] = (str(directory / "checkpoints"), configs[style].to_dict(), the_batch(configs[style]))
    ranks = run_distributed(4, _steps, variants)
    for style, (checkpoints, _, micro_batches) in variants.items():
        hf_dir, tokenizer = tmp_path / style / "hf", tokenizers[style]
        assert convert_to_hf.main(["--checkpoint", checkpoints, "--output", str(hf_dir), "--tokenizer",
                                   str(tmp_path / style / "tokenizer"), "--no-progress"]) == 0
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa")
        ours = torch.cat(next(rank[style]["per_token"] for rank in ranks if rank[style]["per_token"] is not None))
        sums, targets, worst, turns = 0.0, 0, 0.0, []
        for sample, pieces in zip(ours, conversations_of(configs[style], micro_batches), strict=True):
            assert len(pieces) >= 2  # conversations packed together
            for document, offset, tokens in pieces:
                theirs, is_target = transformers_alone(model, tokenizer, records[document], tokens)
                mine = sample[offset:offset + len(tokens) - 1]  # the predictions inside the conversation
                worst = max(worst, ((mine - theirs).abs() / theirs.abs()).max().item())
                sums, targets = sums + theirs[is_target].double().sum().item(), targets + int(is_target.sum())
                turns.append(sum(message["role"] == "assistant" for message in records[document]))
        step_losses = {rank[style]["loss"] for rank in ranks}
        print(json.dumps({"style": style, "worst_per_token_relative": worst, "step_losses": sorted(step_losses),
                          "transformers_target_mean": sums / targets, "targets": targets, "turns": turns}))
        assert max(turns) > 1  # multi-turn conversations among them
        assert worst < TOLERANCE, (style, worst)
        assert len(step_losses) == 1 and step_losses.pop() == pytest.approx(sums / targets, rel=TOLERANCE), style
