"""lm-evaluation-harness tasks on the live model during training (training.eval_tasks every eval_tasks_interval).

The tasks run through the same adapter as tools/evaluate.py (evaluation/lm.py) on the engine's own stage: its
layers, its TP group, its topology, forward only, no gradient. Training continues exactly as without it:

    what                                  why it is untouched
    weights, gradients, optimizer         forward passes under no_grad; nothing is stepped
    the dropout streams                   eval mode (no dropout is drawn); torch's, numpy's and Python's global
                                          random states are saved before lm-eval (which seeds them) and restored
    the data position                     the tasks read their own files, not the training loader
    DeepSpeed's pipeline state            its engine is not called: the pipeline is evaluation/pipeline.py's

Metrics (acc, acc_norm, perplexities, ...) go to the console, metrics.jsonl (kind "tasks") and TensorBoard as
``tasks/<task>/<metric>``, from rank 0.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from model.config import GPT2_VOCAB_SIZE
from runconfig.run import RunConfig


def task_tokenizer(config: RunConfig):
    """The tokenizer the run's data was made with: training.eval_tasks_tokenizer, else the HF tokenizer the run
    started from (training.init_from's, model.from_hf's), else GPT-2's for its vocabulary; else a ValueError."""
    from pathlib import Path

    from hf.tokenizer import TOKENIZER_DIRECTORY, TOKENIZER_FILES, gpt2_tokenizer, load_tokenizer

    training = config.training
    candidates = [training.eval_tasks_tokenizer] if training.eval_tasks_tokenizer else []
    if training.init_from:
        candidates.append(str(Path(training.init_from) / TOKENIZER_DIRECTORY))
    if config.from_hf:
        candidates.append(config.from_hf)
    for directory in candidates:
        if any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            return load_tokenizer(directory)
    if config.model.vocab_size == GPT2_VOCAB_SIZE:
        return gpt2_tokenizer(config.model.max_position_embeddings)
    raise ValueError(f"training.eval_tasks needs the tokenizer of the training data and none is known (the vocabulary "
                     f"is {config.model.vocab_size:,}, not GPT-2's): set training.eval_tasks_tokenizer to a Hugging "
                     f"Face tokenizer directory")


class TaskEvaluation:
    """Runs the configured tasks on the live engine and logs their metrics."""

    def __init__(self, config: RunConfig, engine: Any, ctx, logger) -> None:
        from evaluation.lm import ParallelLM
        from evaluation.pipeline import Pipeline, Stage

        self.config, self.logger = config, logger
        self.lm = ParallelLM(Pipeline(Stage.of_engine(engine, ctx, config.model)), task_tokenizer(config),
                             batch_size=config.micro_batch_size)

    def run(self, step: int, consumed_tokens: int) -> dict[str, float]:
        from evaluation.harness import evaluate, metric_values

        training = self.config.training
        states = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        try:
            results = evaluate(self.lm, list(training.eval_tasks),
                               [training.eval_tasks_include_path] if training.eval_tasks_include_path else [],
                               num_fewshot=training.eval_tasks_num_fewshot, limit=training.eval_tasks_limit)
        finally:
            torch.set_rng_state(states[0])
            np.random.set_state(states[1])
            random.setstate(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])
        metrics = metric_values(results) if results else {}
        self.logger.log("tasks", {"step": step, "consumed_tokens": consumed_tokens, **metrics})
        return metrics
