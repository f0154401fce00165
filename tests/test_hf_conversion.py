"""Hugging Face interop (hf/, tools/convert_{to,from}_hf.py).

- A tiny GPT trained 2 steps at TP 2 x PP 2 and saved by the trainer's save_checkpoint, exported: the HF model's
  logits equal the DeepSpeed engine's on the same batch (fp32, max abs difference <= 1e-4: the engine sums TP
  partial products and HF runs one unsplit matmul, so the rounding differs), its embedding equals the engine's
  parameter exactly, and generate() runs with the exported tokenizer.
- A random GPT2LMHeadModel -> this project (TP 2 x PP 2) -> HF gives back every tensor bit for bit (the conversion
  only copies, slices and permutes), and the DeepSpeed engine loads the imported checkpoint (fresh optimizer) and
  computes the HF model's logits (<= 1e-4, as above), then trains.
- The slicing itself, single-process, on arange tensors; the layer indices against gpt_layer_specs.
- Bad input gives a ValueError naming the file or field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf.checkpoint_reader import open_checkpoint
from hf.export import export_to_hf
from hf.importer import IMPORT_RECORD, import_from_hf, read_import_record
from hf.safetensors_writer import SafetensorsShardWriter, parse_size
from hf.tables import HF_ARCHITECTURE, full_shape, layer_maps
from hf.transforms import merge_to_hf, split_from_hf
from model.checkpoint_files import layer_file
from model.config import ParallelConfig
from model.parallel import ParallelContext
from runconfig.run import parse_run_config
from tests.distributed import run_distributed
from tests.test_model_parallel import LR, deepspeed_config, micro_batches
from tools import convert_from_hf, convert_to_hf

SEED = 1234
TP, PP = 2, 2
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16)
VOCAB = 50257
LOGITS_TOLERANCE = 1e-4


def run_config(**model_overrides) -> dict:
    """A full run config, as the trainer stores it in every checkpoint (RunConfig.to_dict)."""
    raw = {**deepspeed_config("fp32"), "model": {"preset": "tiny", **MODEL, **model_overrides},
           "parallelism": {"tensor_parallel_size": TP, "pipeline_parallel_size": PP},
           "schedule": {"lr": LR, "warmup_tokens": 0, "decay_tokens": 1e6, "train_tokens": 1e6},
           "training": {"seed": SEED}}
    return parse_run_config(raw).to_dict()


def probe_batch():
    """One micro-batch over the whole vocabulary (every embedding row can be hit), as the engine takes it."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, MODEL["seq_length"] + 1), generator=generator)
    positions = torch.arange(MODEL["seq_length"]).expand(2, -1)
    return (tokens[:, :-1], positions), (tokens[:, 1:], torch.ones(2, MODEL["seq_length"]))


def engine_logits(engine, ctx) -> torch.Tensor | None:
    """This rank's vocabulary slice of the logits on the probe batch (last stage only)."""
    _, logits = engine.eval_batch(iter([probe_batch()]), return_logits=True, num_micro_batches=1)
    return logits.detach().clone() if ctx.is_last_stage else None


def gather_vocab(ranks: list[dict]) -> torch.Tensor:
    """Ranks are global-rank ordered; the last stage's TP ranks come last, in TP order."""
    return torch.cat([r["logits"] for r in ranks if r["logits"] is not None], dim=-1)


def _train_and_save(directory: str, raw_config: dict) -> dict:
    from training.checkpoint import save_checkpoint
    from training.engine import build_engine

    config = parse_run_config(raw_config)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, SEED)
    for step in range(2):
        engine.train_batch(data_iter=micro_batches(step, config.model.seq_length, ctx.data_parallel_rank,
                                                   ctx.data_parallel_size))
    save_checkpoint(engine, directory, 2, {"run_config": config.to_dict(),
                                           "train_state": {"step": 2, "consumed_samples": 16,
                                                           "consumed_tokens": 256, "global_batch": 8}})
    embedding = engine.module.tied_modules.word_embeddings.weight.detach().clone() if ctx.is_first_stage else None
    return {"logits": engine_logits(engine, ctx), "embedding": embedding}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("trained") / "checkpoints"
    ranks = run_distributed(TP * PP, _train_and_save, str(directory), run_config())
    embedding = torch.cat([r["embedding"] for r in ranks if r["embedding"] is not None])[:VOCAB]
    return {"directory": directory, "logits": gather_vocab(ranks), "embedding": embedding}


def hf_logits(hf_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    (tokens, _), _ = probe_batch()
    with torch.no_grad():
        return model.eval()(tokens).logits


# -- export of a trained checkpoint ----------------------------------------------------------------------------------

def test_export_equals_engine_logits_and_generates(trained, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert convert_to_hf.main(["--checkpoint", str(trained["directory"]), "--output", str(tmp_path / "hf"),
                               "--no-progress"]) == 0
    hf_dir = tmp_path / "hf"
    # tensors only as safetensors; everything else is JSON or text (nothing a loader would unpickle)
    assert {p.suffix for p in hf_dir.iterdir()} <= {".safetensors", ".json", ".txt"}
    ours = trained["logits"]  # (b, s, V padded), the padded ids at -inf
    assert ours.shape[-1] == 50432 and torch.isneginf(ours[..., VOCAB:]).all()
    theirs = hf_logits(hf_dir)
    assert theirs.shape[-1] == VOCAB  # the padding rows are dropped
    assert (theirs - ours[..., :VOCAB]).abs().max().item() <= LOGITS_TOLERANCE
    assert torch.equal(load_file(hf_dir / "model.safetensors")["transformer.wte.weight"], trained["embedding"])

    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["architectures"], config["activation_function"], config["n_positions"], config["vocab_size"],
            config["layer_norm_epsilon"], config["eos_token_id"]) == ([HF_ARCHITECTURE], "gelu", 16, VOCAB, 1e-5, 50256)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tokenizer("Hello world").input_ids == [15496, 995]
    prompt = tokenizer("Hello world", return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    generated = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                               pad_token_id=tokenizer.eos_token_id)
    assert generated.shape == (1, prompt.shape[1] + 6) and generated.max().item() < VOCAB
    assert generated[0, prompt.shape[1]].item() == theirs_next_token(model, prompt)


def theirs_next_token(model, prompt: torch.Tensor) -> int:
    with torch.no_grad():
        return model(prompt).logits[0, -1].argmax().item()


# -- import, round trip, and training from an imported checkpoint ----------------------------------------------------

def random_hf_model(directory: Path) -> Path:
    """A GPT2LMHeadModel of the tiny shape with every tensor random (biases and LayerNorms too)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MODEL["seq_length"], n_embd=MODEL["hidden_size"],
                        n_layer=MODEL["num_layers"], n_head=MODEL["num_attention_heads"], activation_function="gelu_new")
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("imported")
    hf_dir = random_hf_model(root / "hf")
    config_file = root / "run.json"
    config_file.write_text(json.dumps(run_config(activation="gelu_tanh")))
    status = convert_from_hf.main(["--model", str(hf_dir), "--ds_config", str(config_file), "--output",
                                   str(root / "checkpoint"), "--start-tokens", "123456", "--no-progress"])
    assert status == 0
    return {"hf": hf_dir, "checkpoint": root / "checkpoint", "config": json.loads(config_file.read_text())}


def test_hf_to_ours_to_hf_is_bit_identical(imported, tmp_path):
    from safetensors.torch import load_file

    original = load_file(imported["hf"] / "model.safetensors")
    export_to_hf(imported["checkpoint"], tmp_path / "hf", max_shard_size="100KB", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3  # sharded: the embedding alone, then a block or so per file
    back = {name: tensor for file in files for name, tensor in load_file(tmp_path / "hf" / file).items()}
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    before, after = (json.loads((d / "config.json").read_text()) for d in (imported["hf"], tmp_path / "hf"))
    for key in ("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "vocab_size", "activation_function",
                "layer_norm_epsilon", "tie_word_embeddings"):
        assert after[key] == before[key], key
    assert torch.equal(hf_logits(tmp_path / "hf"), hf_logits(imported["hf"]))  # the sharded export loads too


def test_import_record(imported):
    record = read_import_record(imported["checkpoint"])
    assert record["start_tokens"] == 123456 and record["tag"] == "global_step0"
    assert (record["tensor_parallel_size"], record["pipeline_parallel_size"]) == (TP, PP)
    assert (imported["checkpoint"] / "latest").read_text() == "global_step0"
    assert read_import_record(imported["hf"]) is None


def _load_imported_and_train(directory: str, raw_config: dict) -> dict:
    from training.engine import build_engine

    config = parse_run_config(raw_config)
    engine, ctx = build_engine(config.model, config.parallelism, config.deepspeed, SEED + 1)  # init != import
    load_path, client_state = engine.load_checkpoint(directory, tag=None, load_module_only=True,
                                                     load_optimizer_states=False, load_lr_scheduler_states=False)
    logits = engine_logits(engine, ctx)
    losses = [engine.train_batch(data_iter=micro_batches(step, config.model.seq_length, ctx.data_parallel_rank,
                                                         ctx.data_parallel_size)).item() for step in range(2)]
    return {"loaded": load_path is not None, "start_tokens": client_state["hf_import"]["start_tokens"],
            "logits": logits, "losses": losses}


@pytest.mark.distributed
def test_engine_loads_import_and_trains(imported):
    ranks = run_distributed(TP * PP, _load_imported_and_train, str(imported["checkpoint"]), imported["config"])
    assert all(r["loaded"] and r["start_tokens"] == 123456 for r in ranks)
    ours = gather_vocab(ranks)
    assert (hf_logits(imported["hf"]) - ours[..., :VOCAB]).abs().max().item() <= LOGITS_TOLERANCE
    losses = ranks[0]["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]  # a fresh optimizer trains


# -- the slicing, single-process -------------------------------------------------------------------------------------

def tiny_config():
    """The tiny shape with a 1000-token vocabulary (padded to 1024 at TP 1, 2 and 4)."""
    from model.config import ModelConfig, preset

    return ModelConfig(**{**preset("tiny", **MODEL).to_dict(), "vocab_size": 1000})


def test_layer_indices_and_names_match_the_model():
    from model.gpt import FinalLayerNorm, PositionEmbedding, TransformerLayer, WordEmbedding, gpt_layer_specs

    config, ctx = tiny_config(), ParallelContext()
    specs = gpt_layer_specs(config, ctx, SEED)
    maps = layer_maps(config)
    modules = {0: WordEmbedding(config, ctx, SEED), 1: PositionEmbedding(config, ctx, SEED),
               2: TransformerLayer(config, ctx, SEED, 1), config.num_layers + 2: FinalLayerNorm(config, ctx, SEED)}
    assert [m.index for m in maps] == list(range(config.num_layers + 3))  # the tied head (L + 3) is layer 0
    assert specs[-1].typename is WordEmbedding
    for layer in maps:
        module = modules[layer.index] if layer.index in modules else modules[2]
        assert specs[layer.index].typename is type(module)
        state = module.state_dict()
        assert {t.ours: full_shape(t, config, 1) for t in layer.tensors} == {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("tensor_parallel_size", [1, 2, 4])
def test_split_then_merge_is_exact_for_every_tensor(tensor_parallel_size):
    config = tiny_config()
    for layer in layer_maps(config):
        for tensor in layer.tensors:
            shape = tuple(reversed(full_shape(tensor, config, 1))) if tensor.transposed else full_shape(tensor, config, 1)
            if tensor.layout == "vocab":
                shape = (config.vocab_size, shape[1])
            value = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
            shards = split_from_hf(tensor, value, config, tensor_parallel_size)
            assert all(s.shape == shards[0].shape for s in shards)
            assert torch.equal(merge_to_hf(tensor, shards, config), value), tensor.hf


def test_qkv_columns_are_q_k_v_of_all_heads():
    """HF c_attn output column s*h + n*d + j is q/k/v (s) of head n, dim j: our row n*3d + s*d + j."""
    config = tiny_config()
    h, heads, d = config.hidden_size, config.num_attention_heads, config.head_dim
    qkv = next(t for t in layer_maps(config)[2].tensors if t.ours == "attention.qkv.weight")
    rows = torch.arange(3 * h, dtype=torch.float32).unsqueeze(1).expand(3 * h, h)  # our row index in every column
    hf = merge_to_hf(qkv, list(rows.chunk(2)), config)  # [h, 3h], from 2 TP shards of whole heads
    for s in range(3):
        for n in range(heads):
            for j in (0, d - 1):
                assert hf[0, s * h + n * d + j].item() == n * 3 * d + s * d + j


def test_vocab_padding_is_dropped_and_zero_filled():
    config = tiny_config()  # vocabulary 1000, padded to 1024 at TP 2
    embedding = layer_maps(config)[0].tensors[0]
    shards = split_from_hf(embedding, torch.ones(1000, config.hidden_size), config, 2)
    assert [tuple(s.shape) for s in shards] == [(512, 64), (512, 64)]
    assert shards[1][488:].abs().sum() == 0 and shards[1][:488].min() == 1
    assert merge_to_hf(embedding, shards, config).shape == (1000, 64)


def test_safetensors_writer_shards_and_checks_order(tmp_path):
    from safetensors.torch import load_file

    shapes = {"a": (4, 4), "b": (8,), "c": (64,), "d": (2,)}
    writer = SafetensorsShardWriter(tmp_path, shapes, torch.bfloat16, max_shard_bytes=100)
    values = {name: torch.randn(shape) for name, shape in shapes.items()}
    with pytest.raises(RuntimeError, match="expected a"):
        writer.write("b", values["b"])
    for name in shapes:
        writer.write(name, values[name])
    files = writer.close()
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # a+b | c (128 B alone) | d
    loaded = {k: v for f in files for k, v in load_file(tmp_path / f).items()}
    assert all(torch.equal(loaded[n], values[n].to(torch.bfloat16)) for n in shapes)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["c"] == files[1] and index["metadata"]["total_size"] == 2 * (16 + 8 + 64 + 2)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(123) == 123


# -- bad input -------------------------------------------------------------------------------------------------------

@pytest.fixture
def checkpoint_copy(trained, tmp_path) -> Path:
    """A copy to damage; the large ZeRO files (only read, never damaged) are linked."""
    def copy_or_link(source: str, destination: str) -> None:
        if source.endswith("optim_states.pt"):
            Path(destination).symlink_to(source)
        else:
            shutil.copy2(source, destination)

    copy = tmp_path / "checkpoints"
    shutil.copytree(trained["directory"], copy, copy_function=copy_or_link)
    return copy


def test_directory_without_latest(checkpoint_copy, tmp_path):
    (checkpoint_copy / "latest").unlink()
    with pytest.raises(ValueError, match="no `latest` file"):
        export_to_hf(checkpoint_copy, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
    assert convert_to_hf.main(["--checkpoint", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")]) == 2


def test_missing_shard_is_named(checkpoint_copy, tmp_path):
    layer_file(checkpoint_copy / "global_step2", 3, 1).unlink()
    with pytest.raises(ValueError, match=r"missing 1 shard file.*layer_03-model_01-model_states.pt"):
        open_checkpoint(checkpoint_copy)


def test_files_of_another_split_are_refused(checkpoint_copy, tmp_path):
    tag_directory = checkpoint_copy / "global_step2"
    shutil.copy(layer_file(tag_directory, 3, 1), layer_file(tag_directory, 3, 2))  # a TP rank 2 that TP 2 lacks
    with pytest.raises(ValueError, match=r"layer_03-model_02.*another TP size"):
        open_checkpoint(checkpoint_copy)
    layer_file(tag_directory, 3, 2).unlink()
    state = torch.load(layer_file(tag_directory, 3, 1), weights_only=True)
    state["attention.qkv.weight"] = torch.zeros(192, 64)  # an unsplit (TP 1) shard under a TP 2 name
    torch.save(state, layer_file(tag_directory, 3, 1))
    with pytest.raises(ValueError, match=r"layer_03-model_01.*attention.qkv.weight has shape \(192, 64\).*\(96, 64\)"):
        export_to_hf(checkpoint_copy, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))  # nothing half-written
    (tag_directory / "mp_rank_03_model_states.pt").unlink()
    with pytest.raises(ValueError, match=r"3 mp_rank_\*_model_states.pt files but .* means 4"):
        open_checkpoint(checkpoint_copy)


def test_other_architectures_and_mismatched_configs_are_refused(imported, tmp_path):
    model_config = parse_run_config(imported["config"]).model
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*only GPT2LMHeadModel"):
        import_from_hf(llama, model_config, ParallelConfig(TP, PP), tmp_path / "out", progress=False)

    deeper = model_config.__class__(**{**model_config.to_dict(), "num_layers": 8, "activation": "gelu"})
    with pytest.raises(ValueError, match=r"model.num_layers is 8 .* has 4(.|\n)*model.activation is 'gelu'"):
        import_from_hf(imported["hf"], deeper, ParallelConfig(TP, PP), tmp_path / "out", progress=False)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(imported["hf"] / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin.*safetensors"):
        import_from_hf(pickled, model_config, ParallelConfig(TP, PP), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out" / IMPORT_RECORD).exists()


# -- the export's bytes are pinned -----------------------------------------------------------------------------------

def patterned_hf_model(kind: str, directory: Path) -> Path:
    """A GPT-2 or a Llama (grouped KV, untied, llama3 RoPE) whose every tensor is an integer pattern: no random
    generator, no transcendental function, so its values are the same bits on every CPU and torch version."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf.tokenizer import gpt2_tokenizer

    if kind == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                                      architectures=["GPT2LMHeadModel"])
    else:
        config = AutoConfig.for_model(
            "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
            rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for index, (_, tensor) in enumerate(sorted(model.state_dict().items())):
            pattern = (torch.arange(tensor.numel(), dtype=torch.int64) * 7919 + 104729 * index) % 2003
            tensor.copy_((pattern.to(torch.float32) / 2003 - 0.5).reshape(tensor.shape) * 0.04)
    model.save_pretrained(str(directory))
    gpt2_tokenizer(64).save_pretrained(str(directory))
    return directory


def export_digests(directory: Path) -> dict:
    """sha256 of every safetensors file; config.json and generation_config.json as values (less the transformers
    version, which is not the export's)."""
    import hashlib

    digests = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".safetensors":
            digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.name in ("config.json", "generation_config.json"):
            digests[path.name] = {k: v for k, v in json.loads(path.read_text()).items() if k != "transformers_version"}
    return digests


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_export_bytes_are_pinned(kind, tmp_path):
    """HF (an integer pattern) -> here at TP 2 x PP 2 -> HF, fp32: the export's bytes equal those recorded in
    tests/golden/export_digests.json when the conversion still lived in one module (model/hf_conversion.py). A
    change to what an export writes must be deliberate: regenerate that file and say why."""
    from hf.config_map import model_fields_from_hf, read_hf_config
    from model.config import ModelConfig

    source = patterned_hf_model(kind, tmp_path / "hf")
    model = ModelConfig(**model_fields_from_hf(read_hf_config(source)), seq_length=64)
    import_from_hf(source, model, ParallelConfig(TP, PP), tmp_path / "checkpoint", progress=False)
    export_to_hf(tmp_path / "checkpoint", tmp_path / "export", progress=False)
    golden = json.loads((Path(__file__).parent / "golden" / "export_digests.json").read_text())[kind]
    assert export_digests(tmp_path / "export") == golden
