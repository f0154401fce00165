"""Where a run-time tensor is made: on the device of what it meets, or on the host by design, and then marked.

A tensor made without a device lands on torch's default device, the CPU, while the stage it meets lives on the
GPU; the CPU test suite cannot see the difference. So every tensor factory call (``torch.empty``, ``zeros``,
``full``, ``arange``, ``tensor``, ``randn``, ``Generator``, ...) in common/, model/, evaluation/ and training/ names
its device, in one of four ways (tests/test_device_discipline.py checks every call, and runs evaluation,
generation and a training step under ``torch.set_default_device("meta")``, where a forgotten device fails at once):

    what                                where it is made                        why
    a tensor that meets a module        ``device=device_of(module)``             the module's parameters say where
    (receive buffers, token windows,    or ``device=device_of(tensor)`` /        it runs; a tensor beside another
    positions, masks)                   ``device=tensor.device``                 goes where that one is
    a tensor that meets no module       ``device=accelerator_device()``          NCCL reduces GPU tensors only;
    (a flag or a norm to all-reduce)                                             gloo on CPU takes the CPU
    a copy of a tensor's device         ``torch.*_like(x)``, ``x.new_*(...)``    inherits x's device: accepted as is
    a parameter at build time           ``nn.Parameter(torch.empty(...))``       the default device on purpose: the
                                                                                 meta-device count (model/summary.py)
                                                                                 sets it, the engine moves the module
    host by design                      ``device=HOST`` and ``# host: why`` on   the reason is read where the call
                                        the call's lines                         is (list below)

Host by design, today: seeded initialisation draws (model/init.py: the same values at any split and on any
device), sampling draws (evaluation/generation.py: a seed gives the same tokens on every device), the checkpoint
commit's agreement (training/checkpoint.py: a gloo group of its own), fault-injection draws (training/faults.py),
the AdamW groups' step counts under Muon (training/muon.py: torch's AdamW reads them on the host).
The data loader's batches (data/loader.py, and training.dpo's pairs with their reference log-probs,
training/preference_data.py: both moved by the DevicePrefetcher) and checkpoint snapshots
(training/checkpoint_engine.py, and their views in the writer process, training/checkpoint_writer.py) are host-side
too; data/ is outside the rule, and the snapshots copy tensors with ``*_like``/``new_*`` forms or carry the marker.
"""

from __future__ import annotations

import torch
from torch import nn

HOST = torch.device("cpu")
"""The host. A factory call naming it carries ``# host: <reason>`` on one of its lines (module docstring)."""


def device_of(owner: nn.Module | torch.Tensor) -> torch.device:
    """The device a tensor meeting ``owner`` must be made on: a tensor's own, or a module's first parameter's (its
    first buffer's when it has no parameter)."""
    if isinstance(owner, torch.Tensor):
        return owner.device
    for tensor in owner.parameters():
        return tensor.device
    for tensor in owner.buffers():
        return tensor.device
    raise ValueError(f"{type(owner).__name__} holds no parameter and no buffer: it has no device; pass a tensor "
                     f"or a module that holds one")


def accelerator_device() -> torch.device:
    """This process's accelerator (``cuda:<LOCAL_RANK>`` once model/parallel.py's init_distributed has set it, the CPU
    under DeepSpeed's CPU accelerator): for the few tensors that meet no module, e.g. a scalar to all-reduce, which
    NCCL takes on the GPU only."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
