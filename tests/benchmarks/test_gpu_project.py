"""The GPU projection (benchmarks/gpu/project.py) on the committed H200 results: survival rates are
cumulative, and `--json` prints one object per row with the keys a reader filters on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.project import expected_tokens, speedup

ROOT = Path(__file__).resolve().parents[2]
H200 = ROOT / "docs" / "results" / "gpu" / "2026-11-28-h200"


def test_expected_tokens_add_cumulative_survival_rates():
    """S_j is already the chance that positions 1..j all pass: E(K) = 1 + sum S_j, no products."""
    assert expected_tokens([0.9, 0.8, 0.5]) == 1 + 0.9 + 0.8 + 0.5
    # a round of K candidates costs K draft steps and a (K + 1)-token pass
    assert speedup([0.9, 0.8], 2, 1.0, {1: 10.0, 3: 12.0}) == (1 + 0.9 + 0.8) * 10.0 / (2 * 1.0 + 12.0)


def test_json_rows_carry_what_a_reader_filters_on():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu.project", str(H200), "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows and all({"draft", "target", "temperature", "concurrency", "policy", "speedup"} <= set(r) for r in rows)
    seven = next(r for r in rows if (r["draft"], r["target"], r["temperature"], r["concurrency"])
                 == ("qwen2.5-0.5b", "qwen2.5-7b", 0.0, 1))
    assert 1.55 < seven["speedup"] < 1.7 and seven["k"] >= 4  # not 1.45x at K = 3, as the products said
    assert {r["draft_cost"] for r in rows if r["draft"] == "feature"} == {"estimated"}


def test_a_target_shape_no_run_timed_is_estimated_from_the_7b_passes_by_weight_bytes():
    """The H200 run timed no 32B pass: its rows scale the 7B's by the weights' bytes and say so;
    the shapes it timed say `measured`."""
    from benchmarks.gpu.project import load_results, pass_curve, weight_bytes, with_estimated_targets

    passes, *_ = load_results(H200)
    assert "qwen2.5-32b" not in passes
    filled = with_estimated_targets(passes)
    seven, big = pass_curve(filled["qwen2.5-7b"], 1, "captured"), pass_curve(filled["qwen2.5-32b"], 1, "captured")
    ratio = weight_bytes("qwen2.5-32b") / weight_bytes("qwen2.5-7b")
    assert 4.0 < ratio < 4.6 and big.keys() == seven.keys()
    assert all(big[k] == pytest.approx(seven[k] * ratio) for k in seven)
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu.project", str(H200), "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["target_cost"] for r in rows if r["target"] == "qwen2.5-32b"} == {"estimated"}
    assert {r["target_cost"] for r in rows if r["target"] != "qwen2.5-32b"} == {"measured"}


def test_a_later_run_of_the_day_fills_in_the_32b_passes_and_the_static_loop_prices_the_host():
    """2026-12-04's H200 run: results.json and a second, short run (results-32b-transport.json) with
    only the 32B passes and the transport. The 32B rows are measured; the host work is the static
    cache's loop's; a served row pays the transport's ms per step on the speculative side."""
    from benchmarks.gpu.project import load_results, project, transport_per_step

    passes, loop, feature, transport = load_results(H200.parent / "2026-12-04-h200")
    assert "B=1,k=1" in passes["qwen2.5-32b"] and "estimated" not in passes["qwen2.5-32b"]["B=1,k=1"]
    assert loop["target-only@1"]["host_ms_per_target_pass"] == pytest.approx(1.15, abs=0.01)  # the static loop's
    assert transport_per_step(transport, 1) == pytest.approx(5.84, abs=0.01)
    rows = project(passes, loop, feature, {("feature", 0.0): [0.6, 0.4, 0.3]}, "captured", transport)
    one = next(r for r in rows if (r["target"], r["concurrency"]) == ("qwen2.5-7b", 1))
    assert one["speedup_served"] < one["speedup_with_host"] < one["speedup"]


def test_the_transport_rows_of_paired_steps_price_a_served_step_by_their_greedy_median():
    """benchmarks/transport.py's rows (what bench.py writes since): the greedy cells' median of
    paired steps, at the nearest concurrency; a sampled cell prices nothing."""
    from benchmarks.gpu.project import transport_per_step

    transport = {"bare_call_ms": {"median": 0.4}, "T=0@1": {"added": {"median": 3.0, "n": 200}},
                 "T=0@8": {"added": {"median": 4.0, "n": 200}}, "T=1@1": {"added": {"median": 90.0, "n": 200}}}
    assert transport_per_step(transport, 1) == 3.0
    assert transport_per_step(transport, 16) == 4.0


def test_a_second_folder_of_the_day_brings_its_loop_and_keeps_the_first_ones_passes():
    """2026-12-04's second H200 run (2026-12-04-h200-b) timed only the 1.5B passes, the loop and the
    transport: merged after the first, its loop prices the host and the first run's 7B and 32B
    passes stay."""
    from benchmarks.gpu.project import load_results

    first = H200.parent / "2026-12-04-h200"
    passes, loop, _, transport = load_results(first, H200.parent / "2026-12-04-h200-b")
    assert {"qwen2.5-7b", "qwen2.5-32b"} <= set(passes)
    assert loop["target-only@1"]["host_ms_per_target_pass"] == pytest.approx(0.64, abs=0.01)  # the second run's
    assert transport != load_results(first)[3]


def test_a_feature_drafts_replay_reads_each_candidate_from_its_steps_rows():
    """A feature draft's head data hold a position once per draft step (training/feature_labels.py):
    the replay reads the i-th candidate of a round from step i's row. Here step 1's candidates are
    always accepted and step 2's never, so every fixed-4 round of an 8-token response keeps one."""
    import math

    import torch

    from benchmarks.replay_rules import replay, rules, tables_of
    from specdec.cost_profile import CostProfile
    from specdec.head import AcceptanceHead, HeadConfig

    n, hidden = 8, 4
    steps = torch.tensor([1] * n + [2] * (n - 1))
    scalars = torch.zeros(len(steps), 6)
    scalars[:, 4] = torch.log(steps.float())
    features = {"hidden": torch.randn(len(steps), hidden), "scalars": scalars,
                "labels": (steps == 1).float(), "positions": torch.cat([torch.arange(n), torch.arange(1, n)]),
                "temperatures": torch.zeros(len(steps))}
    head = AcceptanceHead(HeadConfig(hidden_size=hidden, depth=0, draft_identity="x", features="hidden+distribution"))
    tables = tables_of(head.eval(), features, 0.0, label_steps=2)
    assert len(tables) == 1 and tables[0][1][:, 0].eq(1).all() and tables[0][1][1:, 1:].eq(0).all()
    profile = CostProfile(t_draft_ms=1.0, t_target_ms={1: 10.0, 8: 12.0})
    _, steps_per_token = replay(rules(head, profile)["fixed:4"], tables, profile, sampled=False)
    assert math.isclose(steps_per_token, (4 + 4 + 4 + 2) / n)  # four rounds of 2 tokens


def test_a_replayed_batch_pays_each_drafting_step_by_its_rows_and_one_pass_for_all():
    """Two sessions in lock-step, every candidate accepted, fixed:2 on 4-token responses: a step of
    two 2-candidate rounds (two drafting steps of 2 rows, a 6-token pass: 3 + 12 ms) commits 3 tokens
    each, the next of two 1-candidate rounds (one step, a 4-token pass: 1.5 + 11 ms) 1 each; the
    batch stops before it would shrink, so every step counted is a full one."""
    import torch

    from benchmarks.replay_rules import each, replay
    from specdec.cost_profile import CostProfile

    n = 4
    table = (torch.ones(n, 20), torch.ones(n, 20), torch.zeros(n, 20, 6))
    profile = CostProfile(t_draft_ms=1.0, t_draft_rows_ms={1: 1.0, 2: 1.5}, t_target_ms={2: 10.0, 6: 12.0})
    fixed2 = each(lambda acc, sc, t, n: (min(2, n - t), min(2, n - t)))
    tokens_per_s, steps_per_token = replay(fixed2, [table, table], profile, sampled=False, sessions=2)
    assert tokens_per_s == pytest.approx(8 / (3 + 12 + 1.5 + 11) * 1000)
    assert steps_per_token == pytest.approx(3 / 8)
    alone, _ = replay(fixed2, [table], profile, sampled=False)  # one session: 2 steps + a 3-token pass, then 1 + 2
    assert alone == pytest.approx(4 / (2 * 1.0 + 10.5 + 1.0 + 10.0) * 1000)
    hosted, _ = replay(fixed2, [table], profile, sampled=False, host_ms=0.5)  # the loop's own work, once a step
    assert hosted == pytest.approx(4 / (2 * 1.0 + 10.5 + 1.0 + 10.0 + 2 * 0.5) * 1000)


def test_the_replays_without_a_feature_cache_say_how_to_make_one(tmp_path, monkeypatch):
    """benchmarks.replay_rules and probe_target_features read the newest head feature cache: without
    one they printed max()'s traceback."""
    import benchmarks.replay_rules as replay_rules

    monkeypatch.setattr(replay_rules, "CACHE", tmp_path)
    with pytest.raises(SystemExit, match="no feature cache in .*specdec train-head --config"):
        replay_rules.newest_cache()
