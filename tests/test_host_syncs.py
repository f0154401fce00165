"""No host synchronisation inside the step: tests/host_syncs.py's audit counts, on CPU, the device-to-host reads and
host-to-device copies a CUDA run would make, per block and per step.

    what                                                   target                   test
    the audit itself, on each kind of read and copy        each counted, with its   test_the_audit_counts_...
                                                           syncs; host work not
    a dense block, forward and backward                    0                        test_blocks_of_one_process_...,
    a sparse block at EP 1 (the CUDA kernel: grouped GEMM) 0                        test_a_training_step_at_tp2_...
    a sparse block at EP 2                                 1 read per forward (the
                                                           all-to-all's split
                                                           sizes), a recompute's
                                                           once more
    the model outside its blocks (embedding, head, loss)   0
    DeepSpeed's engine                                     counted apart, printed

The step runs at TP 2 x PP 2 x DP 2 on 8 processes (DeepSpeed's engine as training/engine.py builds it, a second
step audited after a first one), with recomputation, sequence parallelism and packed documents in some variants.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from common.device import HOST
from tests.distributed import run_distributed
from tests.host_syncs import HostSyncAudit

# -- the audit on known code -----------------------------------------------------------------------------------------


class _HostTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.arange(4.0, device=HOST)  # host: a plain attribute, left behind by module.to(device)
        self.register_buffer("moved", torch.arange(4.0, device=HOST))  # host: moved with the module


def test_the_audit_counts_each_kind_of_read_and_copy():
    module = _HostTable()
    x = torch.arange(8)  # made before the audit: a device tensor
    with HostSyncAudit(module) as audit:
        x.sum().item()
        bool(x[0])
        x.tolist()
        torch.bincount(x)
        x.nonzero()
        x[x > 3]
        x.repeat_interleave(x)
        torch.tensor([1, 2], device=x.device)
        module.table.to(x.device)
        torch.tensor([1.0], device=HOST).to(x.device)  # host: made on the host, then copied
        x.cpu()
        x[:4] * module.table  # a host tensor in a device op
        # nothing waits for these:
        x.repeat_interleave(x, output_size=28)
        torch.zeros(3, device=x.device)
        torch.full((), 1.0, device=x.device)
        module.moved.to(x.device)
        module.table.sum().item()  # host work
        torch.tensor([3, 4]).tolist()  # host data (no device: torch's default, the host)
        x.to(torch.float64).cumsum(0)
    assert [(e.kind, e.op, e.syncs, e.scope) for e in audit.events] == [
        ("read", "_local_scalar_dense", 1, "harness"),
        ("read", "_local_scalar_dense", 1, "harness"),
        ("read", "tolist", 1, "harness"),
        ("read", "bincount", 2, "harness"),
        ("read", "nonzero", 1, "harness"),
        ("read", "index with a bool mask", 1, "harness"),
        ("read", "repeat_interleave without output_size", 1, "harness"),
        ("copy", "tensor of host data", 1, "harness"),
        ("copy", "to of a host tensor", 1, "harness"),
        ("copy", "to of a host tensor", 1, "harness"),
        ("read", "cpu of a device tensor", 1, "harness"),
        ("copy", "mul with a host tensor", 1, "harness"),
    ]
    assert "to" not in torch.Tensor.__dict__ and torch.zeros.__module__ != __name__  # the wrappers are gone


# -- the blocks of one process -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("packed", [False, True], ids=["positions", "packed"])
def test_blocks_of_one_process_read_and_copy_nothing(recompute, packed):
    """The unsplit model (TP 1, EP 1: the blocks' own code, no communication), forward and backward of two
    micro-batches: no read and no copy in a dense or a sparse block, nor in the embedding, the head or the loss."""
    from model.config import preset
    from model.gpt import GPT
    from tests.test_model_parallel import micro_batches

    config = preset("llama-tiny", **MODEL, recompute=recompute, moe=MOE)
    model = GPT(config).train()
    batches = list(micro_batches(0, config.seq_length, 0, 1))[:2]
    batches = list(_packed(batches)) if packed else batches
    with HostSyncAudit(model) as audit:
        for inputs, (labels, loss_mask) in batches:
            model.loss(*inputs[:2], labels, loss_mask, segment_ids=inputs[2] if packed else None).backward()
    assert audit.events == [], audit.where()
    assert {layer.layer_number: layer.mlp.__class__.__name__ for layer in model.layers} == {
        1: "SwiGLUMLP", 2: "MoEMLP", 3: "SwiGLUMLP", 4: "MoEMLP"}
    assert all(layer.mlp.block.experts.kernel == "auto" for layer in model.layers[1::2])  # the audit restored it


# -- a training step at TP 2 x PP 2 x DP 2 --------------------------------------------------------------------------

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
             seq_length=16)
MOE = dict(num_experts=4, top_k=2, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=32, sparse_every=2,
           aux_loss_coeff=0.01, router_z_loss_coeff=0.001)  # blocks 2 and 4 sparse: one of each kind per stage
VARIANTS = {  # name: (model fields, expert_parallel_size, sequence_parallel, packed documents)
    "EP 1": ({}, 1, False, False),
    "EP 2": ({}, 2, False, False),
    "EP 2, full recompute, sequence parallel": ({"recompute": "full"}, 2, True, False),
    "EP 1, selective recompute, packed documents": ({"recompute": "selective"}, 1, False, True),
}
DOCUMENT_START = 7  # packed documents: every sample holds two, the second from this position


def _packed(batches):
    """The same micro-batches as packed samples: positions restart at DOCUMENT_START, segment ids 0 then 1."""
    for (tokens, positions), labels in batches:
        segments = (positions >= DOCUMENT_START).long()
        yield (tokens, positions - DOCUMENT_START * segments, segments), labels


def _audited_step(name: str) -> dict:
    """A fresh engine, one step outside the audit, the next inside it: the audit's table and events, this rank's
    stage and micro-batches."""
    from model.config import ParallelConfig, preset
    from tests.test_model_parallel import SEED, deepspeed_config, micro_batches
    from training.engine import build_engine

    fields, expert_parallel_size, sequence_parallel, packed = VARIANTS[name]
    config = preset("llama-tiny", **MODEL, **fields, moe=MOE)
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=sequence_parallel,
                              expert_parallel_size=expert_parallel_size)
    engine, ctx = build_engine(config, parallel, deepspeed_config("fp32"), SEED)
    losses = []
    for step in range(2):
        data = micro_batches(step, config.seq_length, ctx.data_parallel_rank, ctx.data_parallel_size)
        data = _packed(data) if packed else data
        if step == 0:
            losses.append(engine.train_batch(data_iter=data))
            continue
        with HostSyncAudit(engine.module) as audit:
            losses.append(engine.train_batch(data_iter=data))
    return {"table": audit.table(), "where": dict(audit.where()), "stage": ctx.pipeline_parallel_rank,
            "micro_batches": engine.gradient_accumulation_steps(), "losses": [float(loss) for loss in losses]}


def _audited_steps() -> dict:
    return {name: _audited_step(name) for name in VARIANTS}


@pytest.fixture(scope="module")
def audited_steps() -> list[dict]:
    return run_distributed(8, _audited_steps)


@pytest.mark.distributed
def test_a_training_step_at_tp2_pp2_reads_only_the_split_sizes(audited_steps):
    """Per block and step (2 micro-batches per pipeline): dense blocks and sparse ones at EP 1 read and copy nothing,
    forward or backward; a sparse block at EP 2 reads once per forward (the all-to-all's split sizes), and once more
    in a full recompute; the model outside its blocks (embedding, head, loss) nothing. DeepSpeed's own reads and
    copies (the gradient norm's check, the pipeline's shape messages, the batch's copy to the device) are printed."""
    for name, (fields, expert_parallel_size, _, _) in VARIANTS.items():
        recomputes = fields.get("recompute") == "full"
        deepspeed = []
        for rank, ranks in enumerate(audited_steps):
            result = ranks[name]
            micro_batches, table = result["micro_batches"], result["table"]
            assert micro_batches == 2 and result["losses"][1] < result["losses"][0] + 0.5, (name, rank)
            blocks = [scope for scope in table if scope.startswith("block")]
            for scope in blocks:
                sparse_at_ep2 = "sparse" in scope and expert_parallel_size > 1
                per_forward = 1 if sparse_at_ep2 and ("forward" in scope or recomputes) else 0
                assert table[scope] == {"read": micro_batches * per_forward}, (name, rank, scope, result["where"])
            expected = {f"block {n} sparse forward" for n in (2, 4)} if expert_parallel_size > 1 else set()
            expected |= {scope.replace("forward", "backward") for scope in expected} if recomputes else set()
            stage_blocks = {n for n in (1, 2, 3, 4) if (n - 1) // 2 == result["stage"]}
            assert set(blocks) == {s for s in expected if int(s.split()[1]) in stage_blocks}, (name, rank, table)
            assert set(table) <= {*blocks, "deepspeed"}, (name, rank, table)  # no "model", "harness"
            deepspeed.append(table.get("deepspeed", {}))
        print(f"\n{name}: DeepSpeed's engine per step, by rank: {deepspeed}")


# -- the trainer ------------------------------------------------------------------------------------------------------

TRAINER_MOE = {**MOE, "router": "sigmoid_bias", "bias_update_rate": 0.01}  # the bias moves every step
LOG_INTERVAL, TRAINER_STEPS = 2, 4
# What training/ reads and copies in a step (per file and function), and what a logged step adds. The trainer does
# not read at log steps only: every step it reads the loss (the spike count's) and the agreed status and copies
# that status to the device, and on TP rank 0 the MoE monitor copies each sparse layer's forward count (one a
# stage here); pinned, so that no more come.
EVERY_STEP = {("read", "trainer.py train_step"): 1, ("copy", "trainer.py _agree_on_status"): 1,
              ("read", "trainer.py _agree_on_status"): 2}
TENSOR_PARALLEL_RANK_0 = {("copy", "moe_monitor.py after_step"): 1}
LOG_STEP = {("read", "trainer.py log_step"): 1, ("read", "moe_monitor.py take"): 4}


def _audited_trainer(data_prefix: str) -> tuple[int, list[tuple]]:
    """The real Trainer at TP 2 x PP 2 (4 processes), TRAINER_STEPS steps of a MoE model under the audit: this
    rank's TP rank, and each event labelled with the step it happened in (kind, syncs, scope, file and function,
    step)."""
    import json

    from runconfig.run import load_run_config
    from training.data import build_loader_factories
    from training.engine import build_engine
    from training.trainer import Trainer

    config = load_run_config("ds_configs/llama-tiny-cpu.json", [
        "model.num_layers=4", "model.seq_length=32", "train_micro_batch_size_per_gpu=2", "train_batch_size=8",
        "schedule.batch={}", "schedule.warmup_tokens=1024", "schedule.decay_tokens=4096",
        "schedule.train_tokens=1000000", f"data.blend=[[1.0, \"{data_prefix}\"]]", "training.save=null",
        "training.save_interval=0", f"training.log_interval={LOG_INTERVAL}", "training.eval_interval=0",
        "training.eval_iters=0", f"training.max_steps={TRAINER_STEPS}", f"model.moe={json.dumps(TRAINER_MOE)}"])
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, config.training.seed,
                               config.training.z_loss)
    trainer = Trainer(config, engine, ctx, *build_loader_factories(config, ctx))
    audit, train_step = HostSyncAudit(engine.module), trainer.train_step

    def labelled_step(loader):
        audit.step = trainer.state.step + 1  # the step's events, its log and status included, until the next
        return train_step(loader)

    trainer.train_step = labelled_step
    with audit:
        trainer.train()
    return ctx.tensor_parallel_rank, [(e.kind, e.syncs, e.scope, f"{Path(e.where.split(':')[0]).name} "
                                       f"{e.where.split()[-1]}", e.step) for e in audit.events]


@pytest.mark.distributed
def test_the_trainer_reads_what_it_is_pinned_to_and_its_model_nothing(corpus):
    ranks = run_distributed(4, _audited_trainer, str(corpus))
    for rank, (tensor_parallel_rank, events) in enumerate(ranks):
        assert {scope for _, _, scope, _, _ in events} <= {"training", "deepspeed"}, (rank, events)  # no block
        for step in range(1, TRAINER_STEPS + 1):
            found = Counter()
            for kind, syncs, scope, where, at in events:
                if scope == "training" and at == step:
                    found[(kind, where)] += syncs
            expected = Counter(EVERY_STEP) + Counter(TENSOR_PARALLEL_RANK_0 if tensor_parallel_rank == 0 else {})
            expected += Counter(LOG_STEP if step % LOG_INTERVAL == 0 else {})
            assert found == expected, (rank, step, found)
    deepspeed = [sum(syncs for _, syncs, scope, _, at in events if scope == "deepspeed" and at == TRAINER_STEPS)
                 for _, events in ranks]
    print(f"\ntraining/ per step: {sum(EVERY_STEP.values())} (+ 1 on TP rank 0, + {sum(LOG_STEP.values())} at a log step); "
          f"DeepSpeed's engine at step {TRAINER_STEPS}, by rank: {deepspeed}")
