"""What the ranks of run_distributed find imported already (tests/distributed.py): the heavy modules only.

Importing them must start no thread and touch no device: torch, DeepSpeed with the CPU accelerator, torch._dynamo
(which every torch optimizer imports on first use), and the project's model and training modules, train.py's
(tests/warm_launch.py's ranks run it) with what they import.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401
from deepspeed.runtime.pipe import PipelineModule  # noqa: E402, F401

import model.gpt  # noqa: E402, F401
import training.engine  # noqa: E402, F401
import training.run  # noqa: E402, F401
import training.trainer  # noqa: E402, F401
