"""MFU's denominator: every listed device name maps to its product's dense bf16 peak; an unknown GPU says so once.

The names are what ``torch.cuda.get_device_name()`` returns on each product. The peaks are the vendors' dense
figures (half the sparsity figure NVIDIA prints with an asterisk); training/metrics.py cites the data sheet of each.
"""

from __future__ import annotations

import pytest

from planner.hardware import GPU_PRESETS
from training import metrics
from training.metrics import GPU_PEAKS, UNKNOWN_GPU_MESSAGE, match_gpu, resolve_peak_tflops

DEVICE_NAMES = [
    ("NVIDIA A100-SXM4-40GB", "A100 SXM (40 or 80 GB)", 312.0),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM (40 or 80 GB)", 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe (40 or 80 GB)", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe (40 or 80 GB)", 312.0),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0),
    ("NVIDIA H200", "H200 SXM", 989.0),
    ("NVIDIA H200 NVL", "H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", "GH200", 989.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L40", "L40", 181.05),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA H800", "H800 SXM", 989.0),
    ("NVIDIA H800 PCIe", "H800 PCIe", 756.0),
    ("NVIDIA A800-SXM4-80GB", "A800", 312.0),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", 125.0),
    ("Tesla V100-PCIE-16GB", "V100 PCIe", 112.0),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe", 130.0),
]


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    """Each test starts with nothing said yet (the messages are once per process)."""
    monkeypatch.setattr(metrics, "_REPORTED", set())


@pytest.mark.parametrize("name, product, peak", DEVICE_NAMES)
def test_device_name_maps_to_its_product_and_peak(name, product, peak):
    gpu = match_gpu(name)
    assert gpu is not None and (gpu.product, gpu.dense_bf16_tflops) == (product, peak)
    messages = []
    assert resolve_peak_tflops(None, name, messages.append) == peak
    assert len(messages) == 1 and gpu.product in messages[0] and f"{peak:g} TFLOP/s" in messages[0]


def test_l4_is_not_an_l40s_nor_an_h200_a_gh200():
    """Substring matching gave "NVIDIA L4" nothing, and would give it the L40S's peak if the table were reordered;
    word boundaries make each product's rule match its own name only."""
    assert match_gpu("NVIDIA L4").dense_bf16_tflops == 121.0
    assert match_gpu("NVIDIA L40S").dense_bf16_tflops == 362.05
    assert match_gpu("NVIDIA GH200 480GB").product == "GH200"
    assert match_gpu("NVIDIA H200").product == "H200 SXM"
    assert match_gpu("NVIDIA H20") is None  # a different product (148 TFLOP/s), not an H200


def test_every_rule_is_reached_by_one_of_the_listed_names():
    """No rule is shadowed by an earlier, broader one (most specific first), and every product is tested above."""
    assert {gpu.product for gpu in GPU_PEAKS} == {product for _, product, _ in DEVICE_NAMES}
    for gpu in GPU_PEAKS:
        assert gpu.datasheet and gpu.dense_bf16_tflops > 0


def test_unknown_gpu_gives_no_peak_and_says_so_once():
    messages = []
    for _ in range(3):  # the trainer may be built several times in one process
        assert resolve_peak_tflops(None, "NVIDIA RTX PRO 9000", messages.append) is None
    assert messages == [UNKNOWN_GPU_MESSAGE.format(name="NVIDIA RTX PRO 9000")]
    assert messages[0].startswith("MFU n/a: set training.peak_tflops_per_gpu")


def test_configured_peak_wins_and_cpu_has_none():
    messages = []
    assert resolve_peak_tflops(500.0, "NVIDIA H100 80GB HBM3", messages.append) == 500.0
    assert resolve_peak_tflops(500.0, "NVIDIA RTX PRO 9000", messages.append) == 500.0
    assert resolve_peak_tflops(None, None, messages.append) is None  # CPU: nothing to say, the log shows MFU n/a
    assert messages == []


def test_default_report_prints_on_rank_zero_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    assert resolve_peak_tflops(None, "NVIDIA RTX PRO 9000") is None
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(metrics, "_REPORTED", set())
    monkeypatch.setenv("RANK", "0")
    assert resolve_peak_tflops(None, "NVIDIA RTX PRO 9000") is None
    assert capsys.readouterr().out.startswith("MFU n/a: set training.peak_tflops_per_gpu")


@pytest.mark.parametrize("preset, name", [("a100-80gb", "NVIDIA A100-SXM4-80GB"), ("a100-40gb", "NVIDIA A100-SXM4-40GB"),
                                          ("h100-80gb", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200")])
def test_planner_presets_use_the_same_peaks(preset, name):
    assert GPU_PRESETS[preset].peak_tflops == match_gpu(name).dense_bf16_tflops


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b", "1.3b"])
def test_flops_count_every_matmul_weight_of_the_real_block(name):
    """Without recomputation the model FLOPs are 6 per token per matmul weight (forward 2, backward 4) of the blocks
    and of the head, plus the attention core 3 x 4 s h per token and layer: the weights counted from a block built on
    the meta device, so GQA's smaller K/V and SwiGLU's third matrix are what the model really has."""
    import torch

    from model.config import preset
    from model.flops import flops_per_iteration
    from model.gpt import TransformerLayer
    from model.parallel import ParallelContext

    config = preset(name)
    with torch.device("meta"):
        block = TransformerLayer(config, ParallelContext(), seed=0, layer_number=1)
    matmul_weights = sum(p.numel() for p in block.parameters() if p.ndim == 2)
    s, h, layers, vocab = config.seq_length, config.hidden_size, config.num_layers, config.padded_vocab_size(1)
    per_token = 6 * (layers * matmul_weights + h * vocab) + 3 * 4 * s * h * layers
    assert flops_per_iteration(config, 16, 1, recompute=False) == pytest.approx(16 * s * per_token, rel=1e-12)


# 530B (Smith et al. 2022): B 1920, s 2048, l 105, h 20480, V 51200 (padded at TP 8), TP 8 x PP 35 (3 blocks a stage)
B, S, L, H, V = 1920, 2048, 105, 20480, 51200
MODEL_FLOPS = 72 * B * S * L * H**2 * (1 + S / (6 * H) + V / (12 * L * H))  # 1.2697e19
BLOCK_FORWARD = B * S * (24 * H**2 + 4 * S * H)  # one forward of one block, the whole batch
CORE_FORWARD = B * S * 4 * S * H  # the attention core of one block: QK^T and the weighted sum of V


@pytest.mark.parametrize("recompute, recomputed", [("none", 0), ("selective", L * CORE_FORWARD),
                                                   ("full", L * BLOCK_FORWARD)])
def test_hardware_flops_add_what_each_mode_recomputes(recompute, recomputed):
    from model.config import preset
    from model.flops import flops_per_iteration, model_flops_per_iteration

    config = preset("530b", recompute=recompute)
    assert model_flops_per_iteration(config, B, 8) == pytest.approx(MODEL_FLOPS, rel=1e-12)
    assert flops_per_iteration(config, B, 8, pipeline_parallel_size=35) == pytest.approx(MODEL_FLOPS + recomputed,
                                                                                          rel=1e-12)


def test_full_recompute_is_narayanans_96():
    from model.config import preset
    from model.flops import flops_per_iteration

    expected = 96 * B * S * L * H**2 * (1 + S / (6 * H) + V / (16 * L * H))
    assert flops_per_iteration(preset("530b"), B, 8) == pytest.approx(expected, rel=1e-12)
    # the old booleans still mean full and none
    assert flops_per_iteration(preset("530b"), B, 8, recompute=True) == pytest.approx(expected, rel=1e-12)
    assert flops_per_iteration(preset("530b"), B, 8, recompute=False) == pytest.approx(MODEL_FLOPS, rel=1e-12)


@pytest.mark.parametrize("recompute, block", [("selective", CORE_FORWARD), ("full", BLOCK_FORWARD)])
def test_recompute_num_layers_scales_the_recomputed_flops(recompute, block):
    """n blocks of each of the 35 stages recompute: 35 n of the 105."""
    from model.config import preset
    from model.flops import flops_per_iteration

    for n in (1, 2, 3):
        config = preset("530b", recompute=recompute, recompute_num_layers=n)
        assert flops_per_iteration(config, B, 8, pipeline_parallel_size=35) == pytest.approx(
            MODEL_FLOPS + 35 * n * block, rel=1e-12)
    with pytest.raises(ValueError, match="pass pipeline_parallel_size"):
        flops_per_iteration(preset("530b", recompute=recompute, recompute_num_layers=1), B, 8)


@pytest.mark.parametrize("recompute, hfu_over_mfu", [("none", 1.0), ("selective", 1.00545), ("full", 1.33268)])
def test_hfu_and_mfu_by_mode(recompute, hfu_over_mfu):
    """At 60 s per iteration on 4480 A100s: MFU from model FLOPs (15.1%, whatever is recomputed), HFU from what the
    GPUs computed (selective: + 4 s h of 24 h^2 + 4 s h per block forward, full: a whole forward more)."""
    from model.config import preset
    from model.flops import flops_per_iteration, model_flops_per_iteration, tflops_per_gpu
    from training.metrics import mfu

    config = preset("530b", recompute=recompute)
    model = mfu(tflops_per_gpu(model_flops_per_iteration(config, B, 8), 60.0, 4480), 312.0)
    hardware = mfu(tflops_per_gpu(flops_per_iteration(config, B, 8), 60.0, 4480), 312.0)
    assert model == pytest.approx(MODEL_FLOPS / (60 * 4480 * 312e12), rel=1e-12) == pytest.approx(0.1514, abs=1e-4)
    assert hardware / model == pytest.approx(hfu_over_mfu, rel=1e-5)


def test_the_console_line_shows_progress_and_the_eta_in_two_units():
    from training.metrics_log import duration, format_record

    assert [duration(s) for s in (42.4, 450, 7500, 273600)] == ["42s", "7m 30s", "2h 05m", "3d 04h"]
    line = format_record("train", {"step": 3, "tokens_per_second": 1000.0, "tokens_per_second_per_gpu": 250.0,
                                   "fraction_done": 0.123, "eta_seconds": 7500.0})
    assert line.startswith("[train] step 3 | 1,000 tokens/s | 250 tokens/s/GPU | 12.3% done | ETA 2h 05m")
