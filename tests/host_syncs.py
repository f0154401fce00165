"""What would stop a CUDA stream, counted on a CPU: the device-to-host reads and host-to-device copies of a step.

A GPU runs ahead of the host only while the host keeps queueing kernels. Each operation below makes the host wait
until the stream has drained (a read of a device value), or copies pageable host memory, which waits for the stream
too. On a CPU nothing waits and every tensor is on the "device", so ``HostSyncAudit`` counts what each would do on
CUDA, with the tensors placed as a GPU machine places them:

    event  operation                                                                        syncs on CUDA
    read   .item(), bool(t), int(t), float(t) (aten._local_scalar_dense), torch.equal;        1
           .tolist(), .numpy(), .cpu() of a device tensor
           torch.bincount (it reads its input's min and max to size the output)              2
           nonzero / argwhere, unique, masked_select, indexing or index_put with a bool      1
           mask, repeat_interleave without output_size: outputs sized by the data
    copy   torch.tensor / as_tensor / new_tensor of host data onto the device; .to(device),  1
           .cuda(), copy_ of a host tensor (non_blocking ones excepted: pinned memory, the
           data loader's prefetch); a host tensor of more than one value in an op on device
           tensors (an error on CUDA, or a hidden copy)

Placement. A tensor is on the host when it was made with ``device=HOST`` (common/device.py) or with no device (torch's
default device: the host on a GPU machine), when it is a plain tensor attribute of a watched module (neither parameter
nor buffer, so ``module.to(device)`` leaves it behind), when it comes from ``.cpu()``, or when an op made it from host
tensors alone. Every other tensor is on the device; a ``torch.device`` other than HOST, and any device string, count
as the device (DeepSpeed names its CPU accelerator "cpu").

Who. Each event is charged to a scope:

    scope                            when
    block <n> <dense|sparse> forward  inside a watched TransformerLayer's forward (module hooks)
    block <n> <dense|sparse> backward from the moment the gradient of its output arrives until that of its input
                                      does (tensor hooks): its ops, a recompute included
    model, training, data, ...        otherwise, the project package of the innermost frame that is not torch's
    deepspeed                         DeepSpeed's own code (an op of the autograd graph that its backward call runs
                                      belongs to the model: the block running, or "model")
    harness                           the tests' and scripts' own code

The kernels are those CUDA runs, where the CPU would choose others: every Experts of a watched module runs torch's
grouped GEMM with the CUDA alignment (model/moe.py ``Experts.kernel``, ``Experts.alignment``), not the per-expert
loop the CPU prefers. Document masks (model.attention_backend "auto") are FlexAttention on CUDA, whose backward does
not run on a CPU; the audit runs SDPA's masked reference in its place, which reads nothing either, not the CPU's
blockwise kernel (model/document_attention.py), which reads its plan of blocks on the host by design.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.device import HOST
from model.grouped_gemm import GROUPED_GEMM_ALIGNMENT_BYTES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "data", "model", "hf", "planner", "evaluation", "training", "lab", "tools")
SKIPPED = (os.path.dirname(torch.__file__), os.path.dirname(os.__file__), __file__)

READ_OPS = {"_local_scalar_dense": 1, "equal": 1, "bincount": 2, "nonzero": 1, "_unique": 1, "_unique2": 1,
            "unique_dim": 1, "unique_consecutive": 1, "masked_select": 1}
MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
FACTORIES = ("empty", "zeros", "ones", "full", "arange", "randn", "rand", "randint", "randperm", "linspace",
             "logspace", "eye", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices")
FROM_DATA = ("tensor", "as_tensor", "asarray")


@dataclass(frozen=True)
class Event:
    kind: str
    """"read" (device to host) or "copy" (host to device)."""
    op: str
    syncs: int
    scope: str
    where: str
    """The innermost frame that is not torch's: path:line function."""
    step: int | None


def _on_host(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and getattr(tensor, "_on_host", False)


def _place(tensor: Any, host: bool) -> Any:
    if isinstance(tensor, torch.Tensor):
        tensor._on_host = host
    return tensor


def _host_target(device: Any) -> bool | None:
    """Whether a ``device=`` or ``.to()`` target is the host (None: no device named)."""
    if device is None:
        return None
    if isinstance(device, torch.Tensor):
        return _on_host(device)
    return device is HOST


class _Wrappers:
    """The Python-level reads and copies, which dispatch no op on a CPU (.tolist, .cpu, .to(device)), and where
    factories put their tensors: wrappers on torch's functions and Tensor methods while the audit runs (a torch
    function mode would not see the backward pass, where recomputes run)."""

    def __init__(self, audit: HostSyncAudit) -> None:
        self.audit = audit
        self._originals: list[tuple[Any, str, Any]] = []
        self._inside = False

    def install(self) -> None:
        for name in FACTORIES:
            self._wrap(torch, name, self._factory)
        for name in FROM_DATA:
            self._wrap(torch, name, self._from_data)
        methods = {"tolist": self._read, "numpy": self._read, "cpu": self._to_host, "cuda": self._to_device,
                   "to": self._to, "new_tensor": self._new_tensor}
        for name, handler in methods.items():
            self._wrap(torch.Tensor, name, handler)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()

    def _wrap(self, owner: Any, name: str, handler) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, owner.__dict__.get(name)))

        def wrapper(*args, **kwargs):
            if self._inside:  # called again from inside a wrapper (a torch function mode re-enters the method)
                return original(*args, **kwargs)
            self._inside = True
            try:
                return handler(original, args, kwargs)
            finally:
                self._inside = False
        wrapper.__name__ = name
        setattr(owner, name, wrapper)

    def _factory(self, func, args, kwargs):
        return _place(func(*args, **kwargs), kwargs.get("device") is None or kwargs["device"] is HOST)

    def _from_data(self, func, args, kwargs):
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        target = _host_target(kwargs.get("device"))
        if isinstance(data, torch.Tensor):  # as_tensor(t, device=...): a .to()
            return self._move(func(*args, **kwargs), data, target, False, func.__name__)
        if target is False:
            self.audit.record("copy", f"{func.__name__} of host data", 1)
        return _place(func(*args, **kwargs), target is not False)

    def _new_tensor(self, func, args, kwargs):
        target = _host_target(kwargs.get("device"))
        host = _on_host(args[0]) if target is None else target
        if not host:
            self.audit.record("copy", "new_tensor of host data", 1)
        return _place(func(*args, **kwargs), host)

    def _read(self, func, args, kwargs):
        if not _on_host(args[0]):
            self.audit.record("read", func.__name__, 1)
        return func(*args, **kwargs)

    def _to_host(self, func, args, kwargs):
        return self._move(func(*args, **kwargs), args[0], True, kwargs.get("non_blocking", False), "cpu")

    def _to_device(self, func, args, kwargs):
        return self._move(func(*args, **kwargs), args[0], False, kwargs.get("non_blocking", False), "cuda")

    def _to(self, func, args, kwargs):
        target = kwargs.get("device", kwargs.get("other"))
        if target is None and len(args) > 1 and isinstance(args[1], (torch.device, str, int, torch.Tensor)):
            target = args[1]
        return self._move(func(*args, **kwargs), args[0], _host_target(target), kwargs.get("non_blocking", False),
                          "to")

    def _move(self, result, source, host: bool | None, non_blocking: bool, name: str):
        """``result`` of moving ``source`` to the host (True), the device (False) or where it is (None). On a CPU
        a move returns the tensor itself: a copy then carries the new placement."""
        if host is None or host == _on_host(source):
            return result
        if not non_blocking:
            self.audit.record("read" if host else "copy", f"{name} of a {'device' if host else 'host'} tensor", 1)
        if result is source:
            result = source.clone()
        return _place(result, host)


class _Ops(TorchDispatchMode):
    """The dispatched reads (item, bool, data-dependent output sizes), host tensors in device ops, and placement of
    every op's outputs."""

    def __init__(self, audit: HostSyncAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # a 0-d tensor not made on the host is a scalar (a Python number wrapped by torch): it sides with either
        tensors = [t for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and (_on_host(t) or t.dim() > 0)]
        self._inspect(func, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if tensors and all(_on_host(t) for t in tensors):
            for tensor in tree_flatten(out)[0]:
                _place(tensor, True)
        return out

    def _inspect(self, func, args, kwargs, tensors) -> None:
        name = func.overloadpacket.__name__
        if name in READ_OPS:  # a 0-d device tensor's item() too
            if not _on_host(args[0]):
                self.audit.record("read", name, READ_OPS[name])
            return
        host = [_on_host(t) for t in tensors]
        if all(host):
            return  # host work, or no tensor: nothing waits for the device
        if name in MASK_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                          for i in args[1] if i is not None):
            self.audit.record("read", f"{name} with a bool mask", 1)
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.audit.record("read", "repeat_interleave without output_size", 1)
        elif name == "copy_":
            if _on_host(args[1]) != _on_host(args[0]) and not kwargs.get("non_blocking", False):
                self.audit.record("copy" if _on_host(args[1]) else "read", "copy_ across host and device", 1)
        elif any(h and t.numel() > 1 for h, t in zip(host, tensors, strict=True)):
            self.audit.record("copy", f"{name} with a host tensor", 1)


def origin(frame) -> tuple[str, str, bool]:
    """Who asked, from ``frame`` outwards: (owner, where, whether an autograd backward call was on the way) of the
    innermost frame that is neither torch's, the standard library's nor this module's. The owner is "deepspeed", a
    project package (PACKAGES; train.py is "training"), "harness" (tests/, scripts/, benchmarks/) or "other"."""
    from_autograd = False
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(SKIPPED):
            from_autograd |= frame.f_code.co_name in ("backward", "_engine_run_backward")
            frame = frame.f_back
            continue
        where, resolved = f"{path}:{frame.f_lineno} {frame.f_code.co_name}", Path(path).resolve()
        if "deepspeed" in resolved.parts:
            return "deepspeed", where, from_autograd
        if "site-packages" in resolved.parts or not resolved.is_relative_to(ROOT):
            return "other", where, from_autograd
        relative = resolved.relative_to(ROOT)
        top = relative.parts[0].removesuffix(".py")
        owner = "training" if top == "train" else top if top in PACKAGES else "harness"
        return owner, f"{relative}:{frame.f_lineno} {frame.f_code.co_name}", from_autograd
    return "other", "?", from_autograd


class HostSyncAudit:
    """Inside, every read and copy (module docstring) is an Event in ``events``; ``modules`` are the watched ones
    (their plain tensor attributes are host tensors, their TransformerLayers scopes, their experts run the CUDA
    kernel). ``step`` labels the events (the caller sets it)."""

    def __init__(self, *modules: nn.Module) -> None:
        self.modules, self.events, self.step = modules, [], None
        self._scope: str | None = None
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._wrappers, self._ops = _Wrappers(self), _Ops(self)

    # -- recording -----------------------------------------------------------------------------------------------
    def record(self, kind: str, op: str, syncs: int) -> None:
        owner, where, from_autograd = origin(sys._getframe(1))
        if self._scope is not None and (owner in PACKAGES or from_autograd):
            scope = self._scope
        elif owner == "deepspeed" and from_autograd:
            scope = "model"
        else:
            scope = owner
        self.events.append(Event(kind, op, syncs, scope, where, self.step))

    # -- summaries -----------------------------------------------------------------------------------------------
    def table(self) -> dict[str, dict[str, int]]:
        """{scope: {"read": syncs, "copy": syncs}}."""
        found: dict[str, Counter] = {}
        for event in self.events:
            found.setdefault(event.scope, Counter())[event.kind] += event.syncs
        return {scope: dict(counts) for scope, counts in sorted(found.items())}

    def where(self, scope_prefix: str = "") -> Counter:
        return Counter(f"{e.kind} {e.op} @ {e.where}" for e in self.events if e.scope.startswith(scope_prefix))

    # -- scopes and placement --------------------------------------------------------------------------------------
    def __enter__(self) -> HostSyncAudit:
        from model.attention import SelfAttention
        from model.gpt import TransformerLayer
        from model.moe import Experts, MoEMLP

        for module in {m for root in self.modules for m in root.modules()}:
            for value in vars(module).values():
                if isinstance(value, torch.Tensor):
                    _place(value, True)  # not a parameter nor a buffer: left on the host by module.to(device)
            if isinstance(module, SelfAttention) and module.backend == "auto":
                self._set(module, "backend", "sdpa")  # in FlexAttention's place (module docstring)
            if isinstance(module, Experts):
                self._set(module, "kernel", "grouped")
                self._set(module, "alignment", GROUPED_GEMM_ALIGNMENT_BYTES // module.gate_up.element_size())
            if isinstance(module, TransformerLayer):
                name = f"block {module.layer_number} {'sparse' if isinstance(module.mlp, MoEMLP) else 'dense'}"
                self._handles += [module.register_forward_pre_hook(self._entering(name)),
                                  module.register_forward_hook(self._leaving(name))]
        self._wrappers.install()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ops.__exit__(*exc)
        self._wrappers.uninstall()
        for handle in self._handles:
            handle.remove()
        for owner, name, value in reversed(self._restore):
            setattr(owner, name, value)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _entering(self, name: str):
        def hook(module, inputs):
            hidden = inputs[0][0] if isinstance(inputs[0], tuple) else inputs[0]
            self._scope = f"{name} forward"
            if hidden.requires_grad:  # its gradient arrives last in the block's backward: the scope ends
                hidden.register_hook(lambda grad: self._end_backward(f"{name} backward"))
        return hook

    def _leaving(self, name: str):
        def hook(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._scope = None
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: self._begin_backward(f"{name} backward"))
        return hook

    def _begin_backward(self, scope: str) -> None:
        self._scope = scope

    def _end_backward(self, scope: str) -> None:
        if self._scope == scope:  # the block below may have begun already (its output is this block's input)
            self._scope = None


class CudaSyncCounter:
    """The same count on a GPU, by torch itself: inside, ``torch.cuda.set_sync_debug_mode("warn")`` makes every
    synchronising CUDA call warn, and each warning is an event (owner, where) charged as HostSyncAudit charges its
    own (``origin``; an op of the graph that DeepSpeed's backward call runs is the model's). A backward's warnings
    are raised on the calling thread when it returns, so they carry its caller."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        """(owner, where) of each synchronisation."""

    def __enter__(self) -> CudaSyncCounter:
        import warnings

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{self.MESSAGE}")
        self._show, warnings.showwarning = warnings.showwarning, self._warned
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)

    def _warned(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self.MESSAGE not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        owner, where, from_autograd = origin(sys._getframe(1))
        self.events.append(("model" if owner == "deepspeed" and from_autograd else owner, where))
