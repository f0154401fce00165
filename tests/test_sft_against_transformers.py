"""The supervised fine-tuning loss of packed conversations equals transformers' and TRL's on the exported model.

The batch: the shipped chat set, tokenised with a Qwen-style template whose {% generation %} blocks mark the replies
(tools/preprocess_data.py, loss masks beside the tokens, each conversation closed by the end-of-document token),
packed whole into samples of 257 tokens as fine-tuning packs them (data.packing "bfd": best-fit decreasing, end-token
padding, document masks and reset positions by default), four samples in two micro-batches.

- Ours: one training step at TP 2 x PP 2 through DeepSpeed's pipeline engine with training.loss_normalization
  "tokens" (the step's summed token losses over its N target tokens), from weights saved just before the step.
- transformers: those weights exported (tools/convert_to_hf.py) and loaded by AutoModelForCausalLM, the same samples
  with packed ``position_ids`` (no attention mask: transformers then masks each packed sequence off from the others),
  labels -100 where the mask is 0, and transformers' own ForCausalLMLoss with ``num_items_in_batch`` = N.
- TRL: SFTTrainer itself, fed the conversations (the pieces of the samples between end tokens) pre-tokenised with
  their masks (completion_only_loss), padding-free: its own collator flattens them with restarting positions, and its
  compute_loss gives the first step's loss; then one real ``train()`` step (fp32: TRL's default is bf16), whose
  logged loss and gradient norm are compared too.

Measured: ours 11.029531 (norm 3.8200109) over 345 targets, transformers 11.029531 (3.8200109), TRL 11.029530
(3.8200109); the loss TRL's train() logged is its compute_loss's to the last bit (11.042449 before the appended end
token stopped being a target, as it is none in TRL's mask). Loss and gradient norm are checked within 1e-5 (fp32).
"""

from __future__ import annotations

import json

import pytest
import torch

from data.loader import documents
from runconfig.run import load_run_config, parse_run_config
from tests.distributed import run_distributed
from tests.test_data_loss_mask import CHAT_DEMO, EOD, preprocess
from tests.test_model_parallel import LR, SEED, deepspeed_config
from tools import convert_to_hf

SEQ_LENGTH, MICRO_BATCH, GLOBAL_BATCH = 256, 2, 4
TOLERANCE = 1e-5


def sft_run_config(tokens_prefix: str, cache: str):
    """The tiny GPT-2 at TP 2 x PP 2 on the chat set, packed whole, with token normalisation."""
    return load_run_config("ds_configs/tiny-cpu.json", [
        f"model.seq_length={SEQ_LENGTH}",
        f"train_micro_batch_size_per_gpu={MICRO_BATCH}", f"train_batch_size={GLOBAL_BATCH}",
        "schedule.batch.start=4", "data.split=\"1\"", "training.eval_iters=0",
        f"data.blend=[[1.0, \"{tokens_prefix}\"]]", f"data.cache_dir=\"{cache}\"", f"data.eod_token_id={EOD}",
        "data.packing=\"bfd\"", "training.loss_normalization=\"tokens\""])


def the_batch(config) -> list:
    """The step's micro-batches as training reads them (training/data.py's loader, DP rank 0 of 1)."""
    from model.parallel import ParallelContext
    from training.data import build_loader_factories

    train, _ = build_loader_factories(config, ParallelContext())
    loader = train(0)
    return [next(loader) for _ in range(GLOBAL_BATCH // MICRO_BATCH)]


def _step(directory: str, raw_config: dict, micro_batches: list) -> dict:
    """Save the initial weights, then one training step; the step's loss and gradient norm."""
    from training.checkpoint import save_checkpoint
    from training.engine import build_engine
    from training.loss_normalization import set_step_tokens

    config = parse_run_config(raw_config)
    ds_config = {**deepspeed_config("fp32"), "train_batch_size": GLOBAL_BATCH,
                 "train_micro_batch_size_per_gpu": MICRO_BATCH}
    engine, ctx = build_engine(config.model, config.parallelism, ds_config, SEED)
    save_checkpoint(engine, directory, 0, {"run_config": raw_config,
                                           "train_state": {"step": 0, "consumed_samples": 0, "consumed_tokens": 0,
                                                           "global_batch": GLOBAL_BATCH}})
    targets = set_step_tokens(engine.module.objective, micro_batches, engine.grid.get_data_parallel_group(), 1)
    loss = engine.train_batch(data_iter=iter(micro_batches)).item()
    return {"loss": loss, "norm": float(engine.get_global_grad_norm()), "targets": int(targets.item())}


def norm_of_gradients(model: torch.nn.Module) -> float:
    return torch.stack([p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None]).sum() \
        .sqrt().item()


def transformers_step(hf_dir, micro_batches: list, targets: int) -> dict:
    """transformers' loss over the whole batch at once: packed position_ids, labels -100, num_items_in_batch."""
    from transformers import AutoModelForCausalLM
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa").train()
    tokens = torch.cat([inputs[0] for inputs, _ in micro_batches])
    positions = torch.cat([inputs[1] for inputs, _ in micro_batches])
    labels = torch.cat([torch.where(mask.bool(), labels, -100) for _, (labels, mask) in micro_batches])
    logits = model(input_ids=tokens, position_ids=positions, use_cache=False).logits
    loss = ForCausalLMLoss(logits, None, model.config.vocab_size, num_items_in_batch=torch.tensor(targets),
                           shift_labels=labels)
    loss.backward()
    return {"loss": loss.item(), "norm": norm_of_gradients(model)}


def conversations(micro_batches: list) -> list[dict]:
    """Each sample cut at its end tokens into pieces, pre-tokenised for TRL: input_ids and completion_mask (the
    mask bit of each token; a sample's first token is no one's label, so its bit does not matter)."""
    pieces = []
    for (tokens, _, _), (labels, loss_mask) in micro_batches:
        samples = torch.cat([tokens[:, :1], labels], dim=1)  # the seq_length + 1 tokens of each sample
        bits = torch.cat([torch.zeros_like(loss_mask[:, :1]), loss_mask], dim=1).long()
        segment_ids, _ = documents(samples, EOD)
        for sample, sample_bits, segments in zip(samples, bits, segment_ids, strict=True):
            for segment in segments.unique_consecutive():
                where = segments == segment
                pieces.append({"input_ids": sample[where].tolist(), "completion_mask": sample_bits[where].tolist()})
    return pieces


def trl_step(hf_dir, pieces: list[dict], output_dir) -> dict:
    """TRL's SFTTrainer on the pieces, all in one padding-free batch: its collator and compute_loss on the first
    batch, then one real train() step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    def trainer() -> SFTTrainer:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa")
        args = SFTConfig(output_dir=str(output_dir), per_device_train_batch_size=len(pieces), max_steps=1,
                         learning_rate=LR, logging_steps=1, report_to="none", use_cpu=True, padding_free=True,
                         completion_only_loss=True, max_length=None, save_strategy="no", seed=SEED,
                         dataloader_drop_last=False, disable_tqdm=True, bf16=False)  # TRL defaults to bf16
        return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(pieces),
                          processing_class=AutoTokenizer.from_pretrained(str(hf_dir)))

    first = trainer()
    batch = next(iter(first.get_train_dataloader()))
    targets = (batch["labels"][..., 1:] != -100).sum()
    loss = first.compute_loss(first.model.train(), batch, num_items_in_batch=targets)
    loss.backward()
    exact = {"loss": loss.item(), "norm": norm_of_gradients(first.model), "targets": int(targets),
             "sequences": int((batch["position_ids"] == 0).sum())}
    logged = trainer()
    logged.train()
    exact["logged_loss"] = next(entry["loss"] for entry in logged.state.log_history if "loss" in entry)
    exact["logged_norm"] = next(entry["grad_norm"] for entry in logged.state.log_history if "grad_norm" in entry)
    return exact


@pytest.mark.distributed
def test_sft_loss_equals_transformers_and_trl(tmp_path):
    prefix = preprocess(CHAT_DEMO, tmp_path / "chat")
    config = sft_run_config(prefix, str(tmp_path / "index-cache"))
    micro_batches = the_batch(config)
    for (tokens, _, segment_ids), (_, loss_mask) in micro_batches:
        assert (segment_ids.amax(dim=1) > 0).all()  # conversations (and padding) packed together in every sample
        assert not loss_mask[tokens == EOD].any()  # no target crosses from one conversation into the next
    ours = run_distributed(4, _step, str(tmp_path / "checkpoints"), config.to_dict(), micro_batches)[0]
    assert convert_to_hf.main(["--checkpoint", str(tmp_path / "checkpoints"), "--output", str(tmp_path / "hf"),
                               "--no-progress"]) == 0
    targets = int(sum(mask.sum() for _, (_, mask) in micro_batches).item())
    assert ours["targets"] == targets > 0

    theirs = transformers_step(tmp_path / "hf", micro_batches, targets)
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=TOLERANCE)
    assert theirs["norm"] == pytest.approx(ours["norm"], rel=TOLERANCE)

    trl = trl_step(tmp_path / "hf", conversations(micro_batches), tmp_path / "trl")
    assert trl["targets"] == targets and trl["sequences"] == len(conversations(micro_batches))
    assert trl["loss"] == pytest.approx(ours["loss"], rel=TOLERANCE)
    assert trl["norm"] == pytest.approx(ours["norm"], rel=TOLERANCE)
    assert trl["logged_loss"] == pytest.approx(ours["loss"], rel=TOLERANCE)
    # the Trainer's norm is torch's clip_grad_norm_, which sums the squares of the 3.2M embedding gradients in fp32:
    # 1.0e-5 below the fp64 sum here (tests/test_model_parallel.py saw 1.4e-5 on another batch)
    assert trl["logged_norm"] == pytest.approx(ours["norm"], rel=5e-5)
    (tmp_path / "figures.json").write_text(json.dumps({"ours": ours, "transformers": theirs, "trl": trl}))
    print(json.dumps({"ours": ours, "transformers": theirs, "trl": trl}))
