"""Data: Megatron-compatible indexed datasets, tokenizers, GPT samples, blending, and the loader the model reads.

- ``data.indexed_dataset``: the MMIDIDX v1 ``.bin``/``.idx`` writer and memory-mapped reader.
- ``data.tokenizers``: GPT-2 BPE, SentencePiece and Hugging Face tokenizers behind one interface.
- ``data.tiktoken_bpe``: when a byte-level BPE vocabulary converts exactly to tiktoken (the fast backend), and how.
- ``data.sharding``: several inputs, the K-th of N shards of them, and merging the shards' datasets.
- ``data.preprocess``: corpus -> indexed datasets (under ``tools/preprocess_data.py``).
- ``data.chat``, ``data.chat_preprocess``: chat and prompt/completion records -> tokens and a loss mask (TRL's masks).
- ``data.loss_mask``: the loss-mask dataset beside a token dataset, read as (tokens, mask) per document.
- ``data.gpt_dataset``: samples of seq_length + 1 tokens, splits, ``build_gpt_datasets`` from --data-path.
- ``data.blended_dataset``: blending by weights within one sample of the exact proportions.
- ``data.index_cache``: the sample-index arrays, cached beside each dataset and built once per node.
- ``data.loader``: ``MicroBatchLoader``, micro-batches for one data-parallel rank, resumable; on CUDA pinned and
  prefetched.
"""
