"""Evaluate and generate where the model lives: at any TP x PP x DP, with no Hugging Face export.

    module       what
    loading      this rank's stage of a checkpoint at a layout (the training model's layers), weights resliced
                 through the HF tables when TP differs; the checkpoint's tokenizer
    pipeline     forward only, stage to stage by point-to-point sends; vocabulary-parallel scores; results on
                 every rank
    generation   greedy and sampled generation with a KV cache on every stage
    lm           ParallelLM, the lm-evaluation-harness model: HFLM's tokenisation, truncation and scores
    harness      task folders (data files resolved against each YAML), names, lm-eval's simple_evaluate
    tasks/       the offline tasks shipped with the project (alice/: last word, next sentence, pages)

tools/evaluate.py and tools/generate.py run them from a checkpoint; training/task_evaluation.py on the live engine.
"""
