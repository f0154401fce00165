"""DPO (training.dpo, training/dpo.py) at TP 2 x PP 2 x DP 2 equals TRL's DPOTrainer, and does not depend on the split.

The model: a random Llama built by transformers (tests/test_hf_llama.py's), imported twice (tools/convert_from_hf.py),
at TP 2 x PP 2 and at TP 1 x PP 1. The pairs: eight plain-string (prompt, chosen, rejected) triples, tokenised by TRL
itself (GPT-2's tokenizer, an end token appended to each completion); its reference log-probs (precompute_ref_log_probs,
from a reference model of its own: the same Llama with every weight moved by N(0, 0.02^2), so that the first step's
rewards, margins and accuracies are not all zero) travel with our batch. Our global batch: the 16 rows, pair i at rows 2i (chosen) and 2i + 1
(rejected), micro-batches of 4 rows (2 pairs).

- TRL: DPOTrainer, the whole set as one batch, learning rate 0, loss_type ["sigmoid"], then ["ipo"]; max_grad_norm
  1e9 (no clipping, but the Trainer still computes and logs the norm). Its first logged step: loss, grad_norm,
  rewards/* and logps/*.
- Ours, in one 8-process launch (TP 2 x PP 2 x DP 2, two micro-batches per replica) and one 1-process launch (four
  micro-batches): one step at learning rate 0 with sigmoid, one with ipo (the weights do not move), then three steps
  at learning rate 1e-3 of sigmoid with rpo_alpha 0.5 and label_smoothing 0.1.

Loss within 1e-5 and the norm within 1e-4 of TRL's (relative); the 1- and 8-process runs within 1e-5 at every step.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf.config_map import model_fields_from_hf, read_hf_config
from runconfig.dpo import DPOConfig
from runconfig.run import parse_run_config
from tests.distributed import run_distributed
from tests.test_hf_llama import random_hf_model
from tests.test_model_parallel import SEED, deepspeed_config
from tools import convert_from_hf

SEQ, MICRO_BATCH, ROWS = 32, 4, 16
BETA, LR = 0.1, 1e-3
TRAINED = dict(beta=BETA, loss_type="sigmoid", rpo_alpha=0.5, label_smoothing=0.1)
TRAINED_STEPS = 3
TOLERANCE = 1e-5
PAIRS = [
    ("The cat sat on", " the mat.", " a dog."),
    ("Two plus two is", " four.", " five, or so I heard."),
    ("Paris is the capital of", " France.", " Spain"),
    ("Water boils at", " one hundred degrees Celsius.", " ten degrees."),
    ("The sun rises in the", " east.", " west, every single morning."),
    ("Bees make", " honey.", " steel"),
    ("Ice is", " cold.", " hot and dry."),
    ("A week has", " seven days.", " nine days and a half."),
]


def raw_config(hf_dir, tensor_parallel_size: int, pipeline_parallel_size: int) -> dict:
    model = {**model_fields_from_hf(read_hf_config(hf_dir)), "seq_length": SEQ, "precision": "fp32"}
    optimizer = deepspeed_config("fp32")["optimizer"]
    optimizer = {**optimizer, "params": {**optimizer["params"], "lr": LR}}
    raw = {**deepspeed_config("fp32"), "optimizer": optimizer, "train_batch_size": ROWS, "train_micro_batch_size_per_gpu": MICRO_BATCH,
           "gradient_clipping": 0.0, "model": model,
           "parallelism": {"tensor_parallel_size": tensor_parallel_size,
                           "pipeline_parallel_size": pipeline_parallel_size},
           "schedule": {"lr": LR, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6},
           "training": {"seed": SEED, "dpo": TRAINED}}
    return parse_run_config(raw).to_dict()


def perturbed(hf_dir, directory):
    """The reference: the model with every weight moved by N(0, 0.02^2)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    model.save_pretrained(str(directory))
    return directory


def trl_first_step(hf_dir, reference_dir, loss_type: str, output_dir) -> tuple[dict, list[dict]]:
    """TRL's first logged step on all the pairs at once, and its tokenised rows with their reference log-probs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    args = TRLConfig(output_dir=str(output_dir), per_device_train_batch_size=len(PAIRS), max_steps=1,
                     learning_rate=0.0, logging_steps=1, report_to=[], use_cpu=True, precompute_ref_log_probs=True,
                     loss_type=[loss_type], beta=BETA, max_grad_norm=1e9, max_length=None, save_strategy="no",
                     bf16=False, disable_tqdm=True, seed=SEED)
    rows = [{"prompt": prompt, "chosen": chosen, "rejected": rejected} for prompt, chosen, rejected in PAIRS]
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa"),
                         ref_model=AutoModelForCausalLM.from_pretrained(str(reference_dir), attn_implementation="sdpa"),
                         args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(hf_dir)))
    tokenised = list(trainer.train_dataset)
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    return logged, tokenised


def global_batch(tokenised: list[dict]) -> list[tuple]:
    """The 16 rows as micro-batches of 4: ((tokens, positions), (labels, loss_mask, reference_logps)) each; a row's
    mask is TRL's completion mask shifted to the labels, padding masked."""
    tokens, masks, references = [], [], []
    for pair in tokenised:
        for side in ("chosen", "rejected"):
            ids = pair["prompt_ids"] + pair[f"{side}_ids"]
            assert len(ids) <= SEQ + 1, f"pair too long for the test's seq_length: {len(ids)}"
            bits = [0] * len(pair["prompt_ids"]) + [1] * len(pair[f"{side}_ids"])
            tokens.append(ids + [0] * (SEQ + 1 - len(ids)))
            masks.append(bits + [0] * (SEQ + 1 - len(bits)))
            references.append(pair[f"ref_{side}_logps"])
    tokens, masks = torch.tensor(tokens), torch.tensor(masks, dtype=torch.float)
    references = torch.tensor(references, dtype=torch.float)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
    return [((tokens[i:i + MICRO_BATCH, :-1], positions),
             (tokens[i:i + MICRO_BATCH, 1:], masks[i:i + MICRO_BATCH, 1:], references[i:i + MICRO_BATCH]))
            for i in range(0, ROWS, MICRO_BATCH)]


def _steps(checkpoint: str, raw: dict, micro_batches: list) -> dict | None:
    """On every rank: the two lr-0 steps (sigmoid, ipo), then the trained steps; the record of the last stage's
    first rank (others None). Metrics are reduced over the world at each step, as at a logged step."""
    from training.dpo import CHOSEN_ROWS
    from training.engine import build_engine
    from training.loss_normalization import set_step_tokens

    config = parse_run_config(raw)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, SEED,
                               dpo=DPOConfig(beta=BETA, loss_type="sigmoid"))
    engine.load_checkpoint(checkpoint, tag=None, load_module_only=True, load_optimizer_states=False,
                           load_lr_scheduler_states=False)
    per_replica = len(micro_batches) // ctx.data_parallel_size
    mine = micro_batches[ctx.data_parallel_rank * per_replica:(ctx.data_parallel_rank + 1) * per_replica]
    objective, record = engine.module.objective, {}

    def step(lr: float) -> dict:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        set_step_tokens(objective, mine, engine.grid.get_data_parallel_group(), ctx.data_parallel_size, CHOSEN_ROWS)
        loss = engine.train_batch(data_iter=iter(mine)).item()
        return {"loss": loss, "grad_norm": float(engine.get_global_grad_norm()),
                **objective.take_metrics(torch.device("cpu"))}

    for loss_type in ("sigmoid", "ipo"):
        objective.config = DPOConfig(beta=BETA, loss_type=loss_type)
        record[loss_type] = step(0.0)
    objective.config = DPOConfig(**TRAINED)
    record["trained"] = [step(LR) for _ in range(TRAINED_STEPS)]
    first_of_last_stage = ctx.is_last_stage and ctx.tensor_parallel_rank == 0 and ctx.data_parallel_rank == 0
    return record if first_of_last_stage else None


def imported(hf_dir, raw: dict, directory) -> str:
    (directory.parent / f"{directory.name}.json").write_text(json.dumps(raw))
    assert convert_from_hf.main(["--model", str(hf_dir), "--ds_config", str(directory.parent / f"{directory.name}.json"),
                                 "--output", str(directory), "--no-progress"]) == 0
    return str(directory)


@pytest.mark.distributed
def test_dpo_equals_trl_and_does_not_depend_on_the_split(tmp_path):
    hf_dir = random_hf_model("LlamaForCausalLM", tmp_path / "hf")
    reference_dir = perturbed(hf_dir, tmp_path / "reference")
    trl, tokenised = {}, None
    for loss_type in ("sigmoid", "ipo"):
        trl[loss_type], tokenised = trl_first_step(hf_dir, reference_dir, loss_type, tmp_path / f"trl-{loss_type}")
    micro_batches = global_batch(tokenised)

    split = raw_config(hf_dir, 2, 2)
    whole = raw_config(hf_dir, 1, 1)
    ours = next(r for r in run_distributed(8, _steps, imported(hf_dir, split, tmp_path / "tp2pp2"), split,
                                           micro_batches) if r is not None)
    single = run_distributed(1, _steps, imported(hf_dir, whole, tmp_path / "tp1pp1"), whole, micro_batches)[0]
    differences = {kind: {name: abs(ours[kind][name] - trl[kind][name]) for name in ours[kind]} for kind in trl}
    print(json.dumps({"trl": trl, "ours_tp2_pp2_dp2": ours, "ours_1_process": single,
                      "|ours - trl|": differences}, indent=1))

    for loss_type in ("sigmoid", "ipo"):
        theirs, mine = trl[loss_type], ours[loss_type]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=TOLERANCE, abs=1e-7), loss_type
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4), loss_type
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                     "logps/chosen", "logps/rejected"):
            assert mine[name] == pytest.approx(theirs[name], rel=TOLERANCE, abs=1e-7), (loss_type, name)
    assert 0 < ours["sigmoid"]["rewards/accuracies"] < 1  # a reference apart from the model: rewards of both signs

    for whole_step, split_step in zip(single["trained"], ours["trained"], strict=True):
        for name, value in whole_step.items():
            assert split_step[name] == pytest.approx(value, rel=TOLERANCE, abs=1e-6), name
    assert ours["trained"][-1]["rewards/margins"] > 0  # the preference moved


# -- single process: the formulas, the step-wide SFT divisor, the refusals ------------------------------------------

def _rows(seed: int, rows: int = 8, positions: int = 6, vocab: int = 11) -> tuple[torch.Tensor, tuple]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, positions, vocab, generator=generator, requires_grad=True)
    labels = torch.randint(vocab, (rows, positions), generator=generator)
    mask = (torch.rand(rows, positions, generator=generator) < 0.7).float()
    mask[:, 0] = 1.0  # no empty completion
    return logits, (labels, mask, -5.0 * torch.rand(rows, generator=generator))


def test_cdpo_and_the_sft_term_follow_their_formulas():
    from model.parallel import ParallelContext
    from training.dpo import DPOLoss

    logits, (labels, mask, reference) = _rows(0)
    config = DPOConfig(**TRAINED)
    token_logps = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (b, s)
    logps = (token_logps * mask).sum(dim=1)
    delta = config.beta * ((logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2]))
    smoothing = config.label_smoothing
    dpo = (-(1 - smoothing) * torch.nn.functional.logsigmoid(delta)
           - smoothing * torch.nn.functional.logsigmoid(-delta)).mean()
    sft = -(token_logps[0::2] * mask[0::2]).sum() / mask[0::2].sum()
    expected = dpo + config.rpo_alpha * sft
    torch.testing.assert_close(DPOLoss(ParallelContext(), config)(logits, (labels, mask, reference)), expected)


def test_the_sft_term_is_a_mean_over_the_whole_batch_whatever_the_split():
    """Two micro-batches with different chosen-token counts: with ``step_tokens`` = N / 2 their mean is the whole
    batch's loss; each micro-batch's own mean would not be (checked, so the test can tell)."""
    from model.parallel import ParallelContext
    from training.dpo import CHOSEN_ROWS, DPOLoss
    from training.loss_normalization import set_step_tokens

    logits, (labels, mask, reference) = _rows(1)
    mask[0, 1:] = 0.0  # the first micro-batch's chosen rows hold fewer targets
    objective = DPOLoss(ParallelContext(), DPOConfig(**TRAINED))
    whole = objective(logits, (labels, mask, reference))
    halves = [(slice(0, 4)), (slice(4, 8))]
    micro_batches = [(None, (labels[h], mask[h], reference[h])) for h in halves]
    own = sum(objective(logits[h], (labels[h], mask[h], reference[h])) for h in halves) / 2
    set_step_tokens(objective, micro_batches, None, 1, CHOSEN_ROWS)
    split = sum(objective(logits[h], (labels[h], mask[h], reference[h])) for h in halves) / 2
    torch.testing.assert_close(split, whole)
    assert abs(own.item() - whole.item()) > 1e-3


@pytest.mark.parametrize(("block", "message"), [
    ({"loss_type": "kto"}, r"training.dpo.loss_type must be one of"),
    ({"beta": 0.0}, r"training.dpo.beta must be positive"),
    ({"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
    ({"loss_type": "ipo", "label_smoothing": 0.1}, r"smooths the sigmoid loss only"),
    ({"rpo_alpha": -1.0}, r"rpo_alpha must be >= 0"),
    ({"betta": 0.1}, r"unknown key\(s\) \['betta'\] in block \"training.dpo\""),
])
def test_bad_dpo_blocks_are_refused_by_name(block, message):
    from runconfig.blocks import TrainingConfig

    with pytest.raises(ValueError, match=message):
        TrainingConfig(dpo=block)


def test_what_dpo_needs_of_the_run_is_checked_at_start_up():
    from runconfig.run import load_run_config

    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu \(1\) must be even"):
        load_run_config("ds_configs/tiny-cpu.json", ["train_micro_batch_size_per_gpu=1", "training.dpo={}"])
    with pytest.raises(ValueError, match=r"training.z_loss is a term of the next-token loss"):
        load_run_config("ds_configs/tiny-cpu.json", ["training.z_loss=1e-4", "training.dpo={}"])
