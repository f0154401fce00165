"""The stability lab's learning-rate arithmetic: LR sensitivity, best LR per size, the power law, the references,
and the projection of tools/project_lr.py (lab/projection_report.py) on a synthetic sweep.

Exact: the sensitivity (sums of a few floats), the parabola's vertex and a noiseless power law (a planted law is
recovered to rounding). Tolerant: the exponent of a noisy planted law, within 3 standard errors of the least-squares
slope, sigma / sqrt(sum (ln N - mean)^2) = 0.0069 for sigma = 0.05 over 5 sizes a decade apart.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from lab import (
    CONSTANTS_DO_NOT_CARRY_OVER,
    DEFAULT_LR_GRID,
    best_learning_rate,
    bootstrap,
    deepseek_flops_per_token,
    deepseek_learning_rate,
    fit_power_law,
    gpt3_power_law,
    lr_sensitivity,
    non_embedding_parameters,
)
from lab.projection_report import project
from lab.results import LR_COLUMN, PROJECTION_COLUMNS, RESULT_COLUMNS
from model.config import preset
from tools.project_lr import main as project_main

# ------------------------------------------------------------------------------------------------ sensitivity


def test_lr_sensitivity_of_the_worked_example():
    # capped (4.5, 4.0, 7.0), best 4.0: mean of (0.5, 0, 3.0) = 7/6
    assert lr_sensitivity((4.5, 4.0, 9.0), loss_0=7.0) == pytest.approx(1.1667, abs=1e-4)
    assert lr_sensitivity((4.5, 4.0, 9.0), loss_0=7.0) == pytest.approx(7 / 6, rel=1e-12)


def test_equal_losses_have_no_sensitivity():
    assert lr_sensitivity([3.2] * len(DEFAULT_LR_GRID), loss_0=10.8) == 0.0


@pytest.mark.parametrize("diverged", [None, math.nan, math.inf, 50.0])
def test_a_diverged_run_counts_as_the_loss_at_initialisation(diverged):
    # (4.0, L_0 = 7.0): terms (0, 3.0), mean 1.5
    assert lr_sensitivity((4.0, diverged), loss_0=7.0) == 1.5


@pytest.mark.parametrize("losses, loss_0, message", [
    ((), 7.0, "at least one run"),
    ((4.0,), 0.0, "loss_0, the loss at initialisation, must be a positive"),
    ((4.0,), -1.0, "must be a positive"),
])
def test_lr_sensitivity_refuses_bad_input(losses, loss_0, message):
    with pytest.raises(ValueError, match=message):
        lr_sensitivity(losses, loss_0)


# ------------------------------------------------------------------------------------------------ best LR of a size


def parabola(lrs, best_lr: float, best_loss: float = 2.5, curvature: float = 0.3) -> list[float]:
    """A planted loss curve: best_loss + curvature (ln lr - ln best_lr)^2."""
    return [best_loss + curvature * (math.log(lr) - math.log(best_lr)) ** 2 for lr in lrs]


def test_best_learning_rate_recovers_the_vertex_of_a_planted_parabola():
    losses = parabola(DEFAULT_LR_GRID, best_lr=4e-3)
    losses[-1] = None  # 3e-1 diverged: left out, the vertex is unchanged
    best = best_learning_rate(DEFAULT_LR_GRID, losses)
    assert best.fitted and best.lr == pytest.approx(4e-3, rel=1e-9) and best.loss == pytest.approx(2.5, rel=1e-9)
    assert best.reason == "parabola in ln(lr) through 0.001, 0.003, 0.01"


def test_best_learning_rate_at_the_edge_returns_the_grid_minimum():
    best = best_learning_rate(DEFAULT_LR_GRID, parabola(DEFAULT_LR_GRID, best_lr=1.0))
    assert (best.lr, best.fitted) == (3e-1, False)
    assert best.reason == "the lowest loss is at the grid's largest learning rate 0.3: extend the grid upward"
    losses = [*parabola(DEFAULT_LR_GRID[:4], best_lr=1.0), None, None, math.nan]  # the lowest finite one, then NaN
    best = best_learning_rate(DEFAULT_LR_GRID, losses)
    assert (best.lr, best.fitted) == (1e-2, False) and "next to a diverged run" in best.reason
    best = best_learning_rate(DEFAULT_LR_GRID, parabola(DEFAULT_LR_GRID, best_lr=1e-5))
    assert (best.lr, best.fitted) == (3e-4, False) and "extend the grid downward" in best.reason


def test_best_learning_rate_refuses_a_grid_that_all_diverged():
    with pytest.raises(ValueError, match="every run diverged"):
        best_learning_rate([1e-3, 1e-2], [None, math.inf])


# ------------------------------------------------------------------------------------------------ the power law


SIZES = np.geomspace(1e6, 1e10, 5)
PLANTED_A, PLANTED_B, SIGMA = 0.02, -0.35, 0.05


def test_a_noiseless_power_law_is_recovered_exactly():
    a, b = fit_power_law(SIZES, PLANTED_A * SIZES**PLANTED_B)
    assert (a, b) == (pytest.approx(PLANTED_A, rel=1e-9), pytest.approx(PLANTED_B, rel=1e-9))


def test_a_noisy_power_law_is_recovered_within_its_standard_error():
    noisy = PLANTED_A * SIZES**PLANTED_B * np.exp(np.random.default_rng(0).normal(0, SIGMA, len(SIZES)))
    log_n = np.log(SIZES)
    tolerance = 3 * SIGMA / math.sqrt(((log_n - log_n.mean()) ** 2).sum())  # 3 standard errors: 0.0206
    _, b = fit_power_law(SIZES, noisy)
    assert abs(b - PLANTED_B) < tolerance  # b = -0.3524
    spread = bootstrap(SIZES, noisy, target_x=5.3e11, samples=1000, seed=0, level=0.9)
    low, high = spread.exponent
    assert low < PLANTED_B < high and high - low < 4 * tolerance  # [-0.3626, -0.3444]
    truth = PLANTED_A * 5.3e11**PLANTED_B
    assert spread.prediction[0] < truth < spread.prediction[1]  # 1.58e-6 in [1.46e-6, 1.68e-6]
    assert len(spread.log_coefficients) + spread.skipped == 1000 and spread.skipped < 10


def test_bootstrap_skips_resamples_with_one_size():
    # 2 points: a resample draws the same point twice with probability 1/2
    spread = bootstrap([1e6, 1e7], [1e-3, 5e-4], target_x=1e8, samples=1000, seed=0)
    assert 400 < spread.skipped < 600 and spread.exponent == pytest.approx((math.log10(0.5),) * 2)


def test_a_power_law_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match="at least 2 distinct x"):
        fit_power_law([1e6, 1e6], [1e-3, 2e-3])


# ------------------------------------------------------------------------------------------------ the references


def test_gpt3_table_gives_an_exponent_of_about_minus_0_30():
    a, b = gpt3_power_law()
    assert abs(b - (-0.30)) < 0.03
    assert (a, b) == (pytest.approx(0.1325, rel=1e-3), pytest.approx(-0.3051, abs=1e-4))  # measured


def test_deepseek_learning_rate_at_1e20_flops():
    assert deepseek_learning_rate(1e20) == pytest.approx(9.86e-4, rel=1e-3)
    assert deepseek_flops_per_token(num_layers=2, hidden_size=10, seq_length=5) == 72 * 2 * 100 + 6 * 2 * 10 * 5


def test_non_embedding_parameters_of_the_530b_recipe():
    # 105 blocks x (12 h^2 + 13 h) at h = 20480, and the final LayerNorm's 2h
    assert non_embedding_parameters(preset("530b")) == 105 * (12 * 20480**2 + 13 * 20480) + 2 * 20480


# ------------------------------------------------------------------------------------------------ the projection


PLANTED_SIZES = (1e6, 4e6, 1.6e7)
COLUMNS = [LR_COLUMN, "model.hidden_size", *RESULT_COLUMNS]  # the sweep's own header, one axis besides the lr


def write_sweep(path, sizes=PLANTED_SIZES, columns=COLUMNS, extra: dict | None = None) -> None:
    """5 learning rates per size, a half-decade apart around the planted best 0.02 N^-0.35, losses on a parabola
    in ln(lr) (the largest one diverged for the smallest size)."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns + list(extra or {}), extrasaction="ignore")
        writer.writeheader()
        for index, n in enumerate(sizes):
            best = PLANTED_A * n**PLANTED_B
            lrs = [best * 10 ** (k / 2 + 0.1) for k in range(-2, 3)]
            for lr, loss in zip(lrs, parabola(lrs, best, best_loss=4 - index), strict=True):
                diverged = index == 0 and lr == lrs[-1]
                writer.writerow({"schedule.lr": lr, "model.hidden_size": 64 * 2**index, "parameters": int(n),
                                 "tokens": 1e6 if diverged else 2e7, "final_loss": "nan" if diverged else loss,
                                 "min_loss": loss, "diverged": str(diverged).lower(), "spikes": 0,
                                 "status": "diverged" if diverged else "finished", "max_attention_logit": 10.0,
                                 "min_log_z": -1.0, **(extra or {})})


def after(out: str, label: str) -> list[str]:
    """The words after ``label`` on the one output line that holds it."""
    lines = [line for line in out.splitlines() if label in line]
    assert len(lines) == 1, f"{label!r} on {len(lines)} lines of:\n{out}"
    return lines[0].split(label, 1)[1].split()


def test_the_projection_columns_are_results_columns():
    assert PROJECTION_COLUMNS == (LR_COLUMN, "parameters", "tokens", "final_loss", "diverged")
    assert set(PROJECTION_COLUMNS) - set(RESULT_COLUMNS) == {LR_COLUMN}  # the lr is an axis, the rest results


def test_project_lr_recovers_the_planted_law_and_plots(tmp_path, capsys):
    results, picture = tmp_path / "results.csv", tmp_path / "lr.png"
    write_sweep(results)
    status = project_main(["--results", str(results), "--target", "ds_configs/530b.json", "--plot", str(picture)])
    out, err = capsys.readouterr()
    assert status == 0 and err == ""
    assert "fit over 3 sizes: lr = 0.02 N^-0.3500" in out
    assert "90% bootstrap interval of the exponent: [-0.3500, -0.3500]" in out  # noiseless: every resample agrees
    for n in PLANTED_SIZES:
        assert f"{n:>12.4g}     5 " in out and f"{PLANTED_A * n**PLANTED_B:>10.3e}" in out
    target_n = 105 * (12 * 20480**2 + 13 * 20480) + 2 * 20480
    projection = PLANTED_A * target_n**PLANTED_B  # 1.577e-06; noiseless: the interval is the point
    assert after(out, "this sweep's fit at N = 5.285e+11") == [f"{projection:.3e}", "90%", "interval",
                                                             f"[{projection:.3e},", f"{projection:.3e}]"]
    assert after(out, "the recipe's own schedule.lr") == ["5.000e-05", f"{5e-5 / projection:.3g}", "x", "the",
                                                          "projection"]  # 31.7
    gpt3_a, gpt3_b = gpt3_power_law()
    assert after(out, "GPT-3's Table 2.1 fit at N = 5.285e+11")[0] == f"{gpt3_a * target_n**gpt3_b:.3e}"  # 3.508e-05
    # M = 72 l h^2 + 6 l h s at l = 105, h = 20480, s = 2048; D = 2.7e11 tokens: C = 8.633e23
    deepseek_c = (72 * 105 * 20480**2 + 6 * 105 * 20480 * 2048) * 2.7e11
    deepseek = after(out, f"DeepSeek LLM at C = M D = {deepseek_c:.4g}")[0]
    assert deepseek == f"{0.3118 * deepseek_c**-0.125:.3e}" == "3.176e-04"
    assert CONSTANTS_DO_NOT_CARRY_OVER in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_project_lr_by_compute_uses_the_most_tokens_a_size_trained(tmp_path):
    results = tmp_path / "results.csv"
    write_sweep(results)  # D = 2e7 for every size (the diverged run's 1e6 aside): C = 6 N D keeps the exponent
    out = project([results], by="compute")
    assert f"lr = {PLANTED_A * (6 * 2e7) ** -PLANTED_B:.4g} C^-0.3500" in out


def test_project_lr_errors_name_the_file_and_the_fix(tmp_path, capsys):
    one_size, no_loss = tmp_path / "one.csv", tmp_path / "no_loss.csv"
    write_sweep(one_size, sizes=(1e6,))
    assert project_main(["--results", str(one_size)]) == 1
    err = capsys.readouterr().err
    assert f"{one_size}: 1 size (parameters 1e+06): a power law needs at least 2 sizes; add sizes" in err
    write_sweep(no_loss, columns=[c for c in COLUMNS if c != "final_loss"])
    assert project_main(["--results", str(no_loss)]) == 1
    err = capsys.readouterr().err
    assert f"{no_loss}: no column final_loss" in err and "give the results.csv the sweep wrote" in err


def test_project_lr_refuses_a_second_axis_until_where_chooses(tmp_path):
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    write_sweep(first, extra={"model.init_method_std": 0.02})
    write_sweep(second, extra={"model.init_method_std": 0.01})
    with pytest.raises(ValueError) as refused:
        project([first, second])
    assert str(refused.value) == (
        f"the runs differ in model.init_method_std (0.02 ({first} line 2), 0.01 ({second} line 2)), which is not "
        f"a model size: the fit is over sizes of one recipe; choose one with --where model.init_method_std=0.02")
    assert "fit over 3 sizes: lr = 0.02 N^-0.3500" in project([first, second], where=["model.init_method_std=1e-2"])


def test_project_lr_refuses_an_option_that_only_looks_like_another_size(tmp_path):
    """qk_layernorm adds 2 d per block: its runs have another parameter count, but are not another model size."""
    plain, normed = tmp_path / "plain.csv", tmp_path / "normed.csv"
    write_sweep(plain, extra={"model.qk_layernorm": "false"})
    write_sweep(normed, extra={"model.qk_layernorm": "true"})
    with pytest.raises(ValueError, match="differ in model.qk_layernorm"):
        project([plain, normed])


def test_a_diverged_rate_inside_the_bracket_is_not_fitted_across():
    best = best_learning_rate([1e-3, 3e-3, 1e-2, 3e-2, 1e-1], [5.0, 3.6, None, 3.5, 4.5])
    assert (best.lr, best.fitted) == (3e-2, False) and "enclose the diverged 0.01" in best.reason
