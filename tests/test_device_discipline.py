"""Every run-time tensor is made on its device (common/device.py), checked two ways on a CPU-only machine.

    check                               what it sees                                       where
    static: every tensor factory call   a call in common/, model/, evaluation/, training/   test_every_tensor_factory_...
    (torch.empty, zeros, full, arange,  that names no device, is no *_like form nor a
    tensor, randn, Generator, ...)      build-time parameter, and is not marked host
                                        (device=HOST with "# host: <reason>")
    run time: torch's default device    a tensor made without a device becomes a meta      test_evaluation_generation_...
    set to "meta" around the code       tensor; the first op that mixes it with a real
                                        one, or a send/receive into it, raises

The run-time check runs one 4-process world at TP 2 x PP 2: one training step (train_batch of an engine built as
training/engine.py builds it), the log-likelihoods of a few requests through the forward-only pipeline and a greedy
generation, each inside the meta default (the models built outside it), and each equal, bitwise, to the same work
without it. DeepSpeed's engine code runs inside the window too, but for one method that makes a host tensor on
purpose (DEEPSPEED_DEVICE_LESS: a shape list copied into its device buffer, legal on a GPU, not into a meta one),
which runs with the host default. A forgotten device either raises at once or makes a result differ; both fail.
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.device import HOST, device_of
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "model", "evaluation", "training")

FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "arange", "range", "tensor", "as_tensor", "asarray", "randn", "rand",
    "randint", "randperm", "normal", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor",
    "tril_indices", "triu_indices", "from_numpy", "frombuffer", "Generator",
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "LongTensor", "IntTensor", "BoolTensor", "ByteTensor",
})
INHERITING = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                        "randint_like"})  # the device of the tensor they copy
HOST_BY_NATURE = frozenset({"from_numpy", "frombuffer"})  # no device argument: host memory, marked
MARKER = re.compile(r"#\s*host:\s*\S")
# The files that hold a host-by-design tensor (common/device.py lists why); a new one is a decision, made here.
HOST_FILES = {"model/layers.py", "model/init.py", "evaluation/generation.py", "training/faults.py",
              "training/checkpoint.py", "training/checkpoint_engine.py", "training/checkpoint_writer.py",
              "training/preference_data.py", "training/muon.py"}


@dataclass(frozen=True)
class FactoryCall:
    path: str
    line: int
    name: str
    kind: str
    """"device" (names one), "inherits" (*_like), "parameter" (inside nn.Parameter at build time), "host" (marked),
    or "violation"."""
    why: str = ""


def _factory_name(call: ast.Call, imported: set[str]) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch":
        name = func.attr
    elif isinstance(func, ast.Name) and func.id in imported:  # from torch import zeros
        name = func.id
    else:
        return None
    return name if name in FACTORIES | INHERITING else None


def _names_host(value: ast.expr) -> bool:
    return (isinstance(value, ast.Name) and value.id == "HOST") or (
        isinstance(value, ast.Attribute) and value.attr == "HOST")


def _is_cpu_literal(value: ast.expr) -> bool:
    if isinstance(value, ast.Constant):
        return value.value == "cpu"
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "device"
            and bool(value.args) and isinstance(value.args[0], ast.Constant) and value.args[0].value == "cpu")


def _marked(call: ast.Call, lines: list[str]) -> bool:
    """``# host: <reason>`` on one of the call's lines, or on a comment line just above it."""
    span = lines[call.lineno - 1:call.end_lineno]
    above = lines[call.lineno - 2].strip() if call.lineno > 1 else ""
    return any(MARKER.search(line) for line in span) or (above.startswith("#") and bool(MARKER.search(above)))


def _classify(call: ast.Call, name: str, in_parameter: bool, lines: list[str]) -> tuple[str, str]:
    device = next((keyword.value for keyword in call.keywords if keyword.arg == "device"), None)
    if name in INHERITING:
        return "inherits", ""
    if in_parameter and device is None:
        return "parameter", ""
    if device is None and name not in HOST_BY_NATURE:
        return "violation", "no device: name the device of what it meets (common/device.py)"
    if device is not None and _is_cpu_literal(device):
        return "violation", 'spell the host device=HOST (common.device), with "# host: <reason>"'
    if device is None or _names_host(device):
        if _marked(call, lines):
            return "host", ""
        return "violation", 'a host tensor without its reason: add "# host: <reason>"'
    return "device", ""


def factory_calls(path: Path, root: Path = ROOT) -> list[FactoryCall]:
    """Every tensor factory call of one file, classified (FactoryCall.kind)."""
    source = path.read_text()
    tree, lines = ast.parse(source), source.splitlines()
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "torch" for alias in node.names if alias.name in FACTORIES | INHERITING}
    parameters = {id(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
                  and ((isinstance(node.func, ast.Attribute) and node.func.attr == "Parameter")
                       or (isinstance(node.func, ast.Name) and node.func.id == "Parameter"))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _factory_name(node, imported)) is not None:
            kind, why = _classify(node, name, id(node) in parameters, lines)
            found.append(FactoryCall(str(path.relative_to(root)), node.lineno, name, kind, why))
    return sorted(found, key=lambda call: (call.path, call.line))


def project_factory_calls() -> list[FactoryCall]:
    return [call for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            for call in factory_calls(path)]


def test_every_tensor_factory_call_names_its_device_or_is_marked_host():
    calls = project_factory_calls()
    counts = Counter(call.kind for call in calls)
    print(f"\ntensor factory calls in {', '.join(PACKAGES)}: {len(calls)} ({counts['device']} name their device, "
          f"{counts['inherits']} *_like, {counts['parameter']} build-time parameters, {counts['host']} host by design, "
          f"{counts['violation']} violations)")
    for call in calls:
        if call.kind == "host":
            print(f"  host by design: {call.path}:{call.line} torch.{call.name}")
    violations = [f"{call.path}:{call.line} torch.{call.name}: {call.why}" for call in calls if call.kind == "violation"]
    assert violations == [], "\n".join(violations)
    assert counts["device"] >= 20 and counts["parameter"] >= 5  # the scan sees the code (21 and 7 when written)
    assert {call.path for call in calls if call.kind == "host"} == HOST_FILES


VIOLATIONS = '''import numpy as np
import torch
from torch import nn, zeros

from common.device import HOST


def run(x, module, array):
    a = torch.zeros(3)
    b = torch.zeros(3, device=x.device)
    c = torch.empty_like(x)
    d = nn.Parameter(torch.empty(2, 2))
    e = torch.tensor([1], device=HOST)  # host: the reason
    f = torch.arange(4, device=HOST)
    g = torch.ones(2, device="cpu")  # host: spelled as a literal
    h = torch.from_numpy(array)
    # host: numpy's memory, copied by the caller
    i = torch.from_numpy(array)
    j = torch.Generator()
    k = zeros(2)
    m = torch.nn.functional.pad(x, (1, 1))
    n = torch.full((2,), 0.0,
                   device=HOST)  # host: a call over two lines
    return a, b, c, d, e, f, g, h, i, j, k, m, n
'''


def test_the_rule_sees_each_kind_of_call(tmp_path):
    path = tmp_path / "module.py"
    path.write_text(VIOLATIONS)
    calls = factory_calls(path, tmp_path)
    assert {call.line: call.kind for call in calls} == {
        9: "violation", 10: "device", 11: "inherits", 12: "parameter", 13: "host", 14: "violation",
        15: "violation", 16: "violation", 18: "host", 19: "violation", 20: "violation", 22: "host"}
    assert "HOST" in next(call.why for call in calls if call.line == 15)
    assert "reason" in next(call.why for call in calls if call.line == 14)


@contextlib.contextmanager
def default_device(device: str | None) -> Iterator[None]:
    """torch's default device for the factories inside (None: left as it is), restored after. A default of the host
    is restored as no default at all: ``set_default_device("cpu")`` would leave torch's device mode on the
    function-mode stack for the rest of the process, where it calls every Tensor method a second time through its
    Python attribute (tests/host_syncs.py's wrappers then count each read twice) and slows every op."""
    if device is None:
        yield
        return
    before = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None if before == torch.device("cpu") else before)


def test_the_meta_default_turns_a_device_less_tensor_into_an_error():
    """What the run-time check relies on: a forgotten device raises at its first use beside a real tensor."""
    real = torch.ones(3)
    with default_device("meta"):
        forgotten = torch.zeros(3)
        with pytest.raises(RuntimeError, match="meta"):
            forgotten + real  # noqa: B018 (the raise is the point)
        named = torch.zeros(3, device=device_of(real))
        host = torch.zeros(3, device=HOST)  # host: the test's own
        assert (named + real).tolist() == (host + real).tolist() == [1.0, 1.0, 1.0]
    assert forgotten.is_meta and torch.zeros(1).device == HOST


# -- the run-time check: TP 2 x PP 2, 4 processes ------------------------------------------------------------------

REQUESTS = [(None, [11, 12, 13, 14, 15], [16, 17]), (None, [21, 22], [23, 24, 25]), (None, [5], [6])]
PROMPTS = [[11, 12, 13], [7]]
NEW_TOKENS = 4
# DeepSpeed 0.19.8's pipeline engine methods that make a tensor without a device, run outside the window:
# _send_tensor_meta copies torch.tensor(shape list) (host) into its device buffer (engine.py:954 and :972).
DEEPSPEED_DEVICE_LESS = ["_send_tensor_meta"]


def _outside_meta(method):
    """``method`` run with torch's default device back on the host: for DeepSpeed's own device-less tensors."""
    def run(*args, **kwargs):
        with default_device("cpu"):
            return method(*args, **kwargs)
    return run


def _one_step(meta: bool):
    """A fresh engine (outside the window), then one train_batch inside it; (engine, context, loss)."""
    from model.config import ParallelConfig
    from tests.test_model_parallel import SEED, deepspeed_config, micro_batches, model_config
    from training.engine import build_engine

    config = model_config()
    engine, ctx = build_engine(config, ParallelConfig(2, 2), deepspeed_config("fp32"), SEED)
    for name in DEEPSPEED_DEVICE_LESS:
        setattr(engine, name, _outside_meta(getattr(engine, name)))
    data = list(micro_batches(0, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size))
    with default_device("meta" if meta else None):
        loss = engine.train_batch(data_iter=iter(data))
    return engine, ctx, config, loss.item()


def _evaluate_and_generate(engine, ctx, config, meta: bool) -> dict:
    from evaluation.generation import Generator
    from evaluation.lm import ParallelLM
    from evaluation.pipeline import Pipeline, Stage

    pipeline = Pipeline(Stage.of_engine(engine, ctx, config))
    lm = ParallelLM(pipeline, SimpleNamespace(eos_token_id=0), batch_size=2)  # the ids are given: no tokenizer
    engine.module.eval()
    with default_device("meta" if meta else None):
        scores = lm._loglikelihood_tokens(REQUESTS)
        generated = Generator(pipeline, end_of_text=None).generate_all(PROMPTS, NEW_TOKENS)
    return {"scores": scores, "generated": generated}


def _with_and_without_meta() -> dict:
    engine, ctx, config, reference_loss = _one_step(meta=False)
    reference = _evaluate_and_generate(engine, ctx, config, meta=False)
    del engine
    engine, ctx, config, loss = _one_step(meta=True)
    return {"loss": (reference_loss, loss), "reference": reference,
            "meta": _evaluate_and_generate(engine, ctx, config, meta=True)}


@pytest.mark.distributed
def test_evaluation_generation_and_a_training_step_run_under_the_meta_default():
    ranks = run_distributed(4, _with_and_without_meta)
    for rank in ranks:
        reference_loss, loss = rank["loss"]
        assert loss == reference_loss and 4.0 < loss < 12.0, rank["loss"]  # bitwise; about ln(vocab) after 1 step
        assert rank["meta"] == rank["reference"] == ranks[0]["reference"]  # bitwise, and the same on every rank
        scores = rank["meta"]["scores"]
        assert len(scores) == len(REQUESTS) and all(score < 0.0 for score, _ in scores), scores
        assert [len(tokens) for tokens in rank["meta"]["generated"]] == [NEW_TOKENS] * len(PROMPTS)
