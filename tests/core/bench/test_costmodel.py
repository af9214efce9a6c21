"""The cost-model fit (paper eq. 2.1) and eq. 2.3's predictions, on synthetic generations."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.bench.costmodel import CostFit, fit_cost_model, fit_round_costs, fit_standalone, r_squared, speedup_share

T_DRAFT, T_TARGET = 0.03, 0.35


def synthetic(points: int = 40, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    n_target = rng.integers(5, 130, points)
    n_draft = n_target * rng.integers(1, 12, points) + rng.integers(0, 20, points)
    wall = T_DRAFT * n_draft + T_TARGET * n_target + rng.normal(0.0, noise, points)
    return n_draft, n_target, wall


def test_exact_data_recovers_the_forward_times():
    fit = fit_cost_model(*synthetic())
    assert fit.t_draft == pytest.approx(T_DRAFT, rel=1e-9)
    assert fit.t_target == pytest.approx(T_TARGET, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.points == 40


def test_noise_lowers_r2_but_keeps_the_estimates_close():
    fit = fit_cost_model(*synthetic(400, noise=0.5, seed=1))
    assert fit.t_draft == pytest.approx(T_DRAFT, rel=0.1)
    assert fit.t_target == pytest.approx(T_TARGET, rel=0.05)
    assert 0.9 < fit.r2 < 1.0


def test_r_squared_definition():
    observed = np.array([1.0, 2.0, 3.0, 4.0])
    assert r_squared(observed, observed) == 1.0
    assert r_squared(observed, np.full(4, observed.mean())) == 0.0  # no better than the mean
    assert r_squared(observed, observed + 1.0) == pytest.approx(1 - 4 / 5)


def test_undetermined_fits_are_none():
    assert fit_cost_model([1, 2], [1, 1], [0.5, 0.6]) is None  # fewer points than MIN_POINTS
    assert fit_cost_model([2, 4, 6], [1, 2, 3], [1, 2, 3]) is None  # N_draft = 2 N_target: collinear
    assert fit_standalone([], []) is None


def test_eq_2_3_worked_example():
    fit = CostFit(T_DRAFT, T_TARGET, r2=1.0, points=1)
    assert fit.latency(verification_rate=0.1, discard_rate=0.2) == pytest.approx(0.068)
    assert fit.throughput(0.1, 0.2) == pytest.approx(1 / 0.068)
    assert fit.speedup(0.1, 0.2) == pytest.approx(0.35 / 0.068)
    assert fit.speedup(1.0, 0.0) == pytest.approx(1.0)  # target-only
    assert fit.predict(n_draft=10, n_target=2) == pytest.approx(1.0)


def test_eq_2_3_agrees_with_eq_2_1_when_every_draft_pass_drafts_a_candidate():
    # N_draft = N + N_discarded - N_target when a round of K candidates costs K draft passes.
    n, n_target, n_discarded = 128, 20, 30
    fit = CostFit(T_DRAFT, T_TARGET, 1.0, 1)
    total = fit.predict(n + n_discarded - n_target, n_target)
    assert fit.latency(n_target / n, n_discarded / n) == pytest.approx(total / n)


def test_standalone_fit_and_speedup_share():
    fit = fit_standalone([10, 20, 40], [3.5, 7.0, 14.0])
    assert fit.t_target == pytest.approx(0.35) and fit.t_draft == 0.0 and fit.r2 == pytest.approx(1.0)
    assert speedup_share(2.55, 3.0) == pytest.approx(0.85)
    assert speedup_share(2.0, 0.0) == 0.0


def test_round_costs_recover_the_loops_draft_step_and_verification_line():
    per_pass, per_candidate, t_draft = 400.0, 23.0, 0.056  # ms, ms, s
    records = []
    for rounds in ({"0": 3, "4": 10}, {"8": 7, "2": 5}, {"12": 6, "20": 2}, {"1": 30}):
        candidates = sum(int(k) * n for k, n in rounds.items())
        records.append({"stats": {"k_histogram": rounds, "draft_forward_passes": candidates + 2,
                                  "draft_time_s": t_draft * (candidates + 2),
                                  "target_time_s": (per_pass * sum(rounds.values()) + per_candidate * candidates) / 1000}})
    records.append({"stats": {"k_histogram": {"0": 50}, "draft_forward_passes": 0, "draft_time_s": 0.0,
                              "target_time_s": 99.0}})  # target-only: no draft, left out
    profile = fit_round_costs(records)
    assert profile.t_draft_ms == pytest.approx(56.0)
    assert profile.t_target(0) == pytest.approx(400.0) and profile.t_target(10) == pytest.approx(630.0)
    assert profile.t_target(30) == pytest.approx(400.0 + 23.0 * 30)  # past the longest round: the same line
    assert fit_round_costs(records[:2]) is None  # too few generations
    same_k = [{"stats": {**r["stats"], "k_histogram": {"4": 10}}} for r in records[:4]]
    assert fit_round_costs(same_k) is None  # rounds and candidates collinear: a and b not separable
