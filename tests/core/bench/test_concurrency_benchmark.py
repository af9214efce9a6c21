"""benchmarks/concurrency.py: target-only joins every mode and level, and the table divides each row
by target-only's aggregate tokens/s at the same mode and level (`--tiny`, in process)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import concurrency


def row(mode: str, policy: str, level: int, tps: float) -> dict:
    return {"mode": mode, "policy": policy, "concurrency": level, "requests": 2, "tokens": 100, "wall_s": 1.0,
            "tokens_per_s": tps, "latency_p50_s": 1.0, "latency_p99_s": 1.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.1,
            "drafted": 0, "accepted": 0}


def cells(table: str) -> dict[tuple[str, str, str], dict[str, str]]:
    """(mode, policy, C) -> {column: cell}."""
    header, _, *lines = table.splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in line.strip("|").split("|")))) for line in lines]
    return {(r["mode"], r["policy"], r["C"]): r for r in rows}


def test_table_divides_by_target_only_at_the_same_mode_and_level():
    rows = [row("in-process", "target-only", 1, 4.0), row("in-process", "target-only", 4, 10.0),
            row("in-process", "fixed:8", 1, 8.0), row("in-process", "fixed:8", 4, 5.0),
            row("served", "target-only", 4, 8.0), row("served", "fixed:8", 4, 4.0),
            row("served", "fixed:8", 8, 4.0)]
    table = cells(concurrency.table(rows))
    assert table[("in-process", "fixed:8", "1")]["vs target-only"] == "2.00x"
    assert table[("in-process", "fixed:8", "4")]["vs target-only"] == "0.50x"  # slower than plain decoding at C=4
    assert table[("in-process", "target-only", "4")]["vs target-only"] == "1.00x"
    assert table[("served", "fixed:8", "4")]["vs target-only"] == "0.50x"  # served target-only, not in-process
    assert table[("served", "fixed:8", "8")]["vs target-only"] == "-"  # no target-only at that level
    assert table[("served", "fixed:8", "4")]["served / in process"] == "0.800"


def test_tiny_run_adds_target_only_at_every_level(monkeypatch, tmp_path, capsys):
    out = tmp_path / "concurrency.json"
    monkeypatch.setattr(sys, "argv", ["concurrency.py", "--tiny", "--modes", "in-process", "--policies", "fixed:2",
                                      "--concurrency", "1", "2", "--requests-per-client", "1", "--prompts", "2",
                                      "--max-new-tokens", "4", "--out", str(out)])
    assert concurrency.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["concurrency"]) for r in rows] == [("target-only", 1), ("target-only", 2),
                                                               ("fixed:2", 1), ("fixed:2", 2)]
    printed = capsys.readouterr().out
    table = cells("\n".join(line for line in printed.splitlines() if line.startswith("|")))
    for r in rows:
        base = next(b["tokens_per_s"] for b in rows if b["policy"] == "target-only"
                    and b["concurrency"] == r["concurrency"])
        ratio = table[("in-process", r["policy"], str(r["concurrency"]))]["vs target-only"]
        assert float(ratio.rstrip("x")) == pytest.approx(r["tokens_per_s"] / base, abs=0.006)
    assert "greedy outputs identical across every mode and level: True" in printed  # target-only is the reference
    drafted = {(r["policy"], r["concurrency"]): (r["drafted"], r["accepted"]) for r in rows}
    assert drafted[("target-only", 2)] == (0, 0) and drafted[("fixed:2", 2)][0] > 0  # fixed K drafts
    assert table[("in-process", "fixed:2", "2")]["drafted / accepted"] == "{} / {}".format(*drafted[("fixed:2", 2)])
    # where the time went, in process: target-only alone runs one target pass a token (the prefill's gives
    # the first), nothing of the warm-ups counted; at C = 2 the sessions share passes; the draft's time
    # only where it drafts; the rest is the wall's
    for r in rows:
        assert r["rest_s"] == pytest.approx(r["wall_s"] - r["target_s"] - r["draft_s"] - r["probe_s"])
        assert r["target_s"] > 0 and r["target_tokens"] > r["target_passes"]
    plain = {r["concurrency"]: r for r in rows if r["policy"] == "target-only"}
    assert plain[1]["target_passes"] == plain[1]["tokens"] and plain[2]["target_passes"] < plain[2]["tokens"]
    assert plain[1]["draft_s"] == plain[2]["draft_s"] == 0
    assert all(r["draft_s"] > 0 for r in rows if r["policy"] == "fixed:2")


def test_merged_rounds_keep_each_runs_own_figure():
    runs = []
    for wall in (10, 20, 25):  # as closed_loop fills a run in
        run = concurrency.Run("in-process", "target-only", 1)
        run.requests, run.tokens, run.wall_s = 2, 100, wall
        runs.append(run)
    merged = runs[0].merge(runs[1]).merge(runs[2])
    assert merged.per_round == pytest.approx([10.0, 5.0, 4.0])
    assert merged.tokens_per_s == pytest.approx(300 / 55)
