"""What the ranks of run_distributed find imported already (tests/distributed.py): the heavy modules only.

Importing them must start no thread and touch no device: torch, DeepSpeed with the CPU accelerator, torch._dynamo
(which every torch optimizer imports on first use), DeepSpeed's Muon module (its engine imports it when it configures
any optimizer; its torch.compile decorators import inductor: 1.2 s of CPU per rank), TensorBoard's writer, and the
project's model and training modules, train.py's (tests/warm_launch.py's ranks run it) with what they import: what a
rank of train.py imported after this list, counted with ``python -X importtime``, was 1.4 s; now it is under 0.1 s.
The imports' objects are then frozen (gc.freeze): a collection in a rank skips them.
"""

import gc
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401
import torch.utils.tensorboard  # noqa: E402, F401
from deepspeed.runtime.pipe import PipelineModule  # noqa: E402, F401
from deepspeed.runtime.zero.muon import original_muon  # noqa: E402, F401

import hf.tokenizer  # noqa: E402, F401
import model.gpt  # noqa: E402, F401
import training.checkpoint_engine  # noqa: E402, F401
import training.engine  # noqa: E402, F401
import training.run  # noqa: E402, F401
import training.trainer  # noqa: E402, F401

# What the imports made lives as long as the process: out of the collector's sight, a full collection in a rank (a
# test's gc.collect(), or the collector's own) walks the rank's objects, not these 400,000 (0.26 s a collection).
gc.freeze()
