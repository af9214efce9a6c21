"""`specdec bench` end to end on the tiny pair, in process: records, results.json, summary.md,
PNGs, the greedy lossless check, the HF peer, skips, resume and --report-only."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdec.bench.records import RECORDS_FILE
from specdec.bench.runner import BenchConfig
from specdec.builder import EngineConfig
from specdec.cli import main
from specdec.head import AcceptanceHead, HeadConfig
from specdec.models.sources import model_identity

PROMPTS = ["def add(a, b):", "Write hello world."]
POLICIES = ["target-only", "fixed:3", "svip:0.3", "oracle", "specdec++:0.5", "hf-dynamic", "hf-heuristic:4"]


@pytest.fixture
def one_thread():
    """The smoke runs use one torch thread (fast on a busy 2-core machine); put the count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def bench_args(tiny_pair, prompt_file, out, policies=POLICIES, *extra) -> list[str]:
    draft, target = tiny_pair
    return ["bench", "--draft", str(draft), "--target", str(target), "--threads", "1", "--prompts", str(prompt_file),
            "--max-new-tokens", "8", "--temperatures", "0", "1", "--policies", *policies, "--out", str(out),
            "--forward-ks", "1", "2", "--forward-repeats", "1", "--no-progress", *extra]


def record_lines(out) -> int:
    return len((out / RECORDS_FILE).read_text().splitlines())


def test_bench_end_to_end_then_resume(tiny_pair, prompt_file, tmp_path, capsys, one_thread):
    out = tmp_path / "run"
    assert main(bench_args(tiny_pair, prompt_file, out)) == 0
    summary = capsys.readouterr().out
    assert "## Greedy (2 prompts)" in summary and "## Goals" in summary and "hf-dynamic" in summary

    results = json.loads((out / "results.json").read_text())
    for name in ("summary.md", "plane-t0.png", "plane-t1.png", "tokens-per-s.png", "cost-model.png",
                 "forward-times.png", "live-profile.png"):
        assert (out / name).stat().st_size > 0, name
    live = results["live_profile"]  # what the budget planned with, measured in the run
    assert live["source"].startswith("measured in the loop") and live["t_target_ms"] and live["t_draft_rows_ms"]
    assert "## Live cost profile" in summary and "target pass, ms by tokens" in summary
    # 2 prompts x (5 runnable policies at t=0 + 4 at t=1: no head for specdec++, oracle greedy only)
    assert len(results["records"]) == record_lines(out) == 2 * (6 + 5)
    assert "no acceptance head" in results["skipped_specs"]["specdec++:0.5"]
    assert "greedy only" in results["skipped_specs"]["oracle@t=1"]

    greedy = results["by_temperature"]["0"]["policies"]
    assert set(greedy) == {"target-only", "fixed:3", "svip:0.3", "oracle", "hf-dynamic", "hf-heuristic:4"}
    assert results["lossless"]["ours_equal"] is True and results["lossless"]["mismatched"] == {}
    assert all(p["lossless"]["equal"] and p["lossless"]["compared"] == 2 for p in greedy.values())
    assert greedy["oracle"]["discard_rate"] == 0.0
    peer = greedy["hf-heuristic:4"]
    assert peer["rounds"] == peer["target_forward_passes"] > 0 and peer["generated_tokens"] == 16
    assert peer["draft_forward_passes"] > 0 and peer["wall_time_s"] > 0
    assert results["by_temperature"]["0"]["cost_model"]["points"] == 6  # fixed, svip, oracle x 2 prompts
    assert set(results["forward_times"]["draft_s"]) == {"1", "2"}
    assert all(g["met"] is None for g in results["goals"])  # nothing to compare without specdec++

    # Resume: the same run again generates nothing; one more policy adds only its own records.
    assert main(bench_args(tiny_pair, prompt_file, out)) == 0
    assert record_lines(out) == 22
    assert main(bench_args(tiny_pair, prompt_file, out, [*POLICIES, "fixed:2"])) == 0
    assert record_lines(out) == 22 + 4
    capsys.readouterr()

    # Other settings in the same directory are refused; --report-only rewrites the files only.
    assert main(bench_args(tiny_pair, prompt_file, out, POLICIES, "--seed", "7")) == 2
    assert "pass another --out" in capsys.readouterr().err
    assert main(bench_args(tiny_pair, prompt_file, out, POLICIES, "--kv-cache", "reference")) == 2  # (was resumed)
    assert "records made with kv_cache='auto', not 'reference'" in capsys.readouterr().err
    (out / "summary.md").unlink()
    assert main(bench_args(tiny_pair, prompt_file, out, POLICIES, "--report-only")) == 0
    assert (out / "summary.md").is_file() and record_lines(out) == 26


def test_a_generation_timed_while_the_cpu_was_shared_is_generated_again(tiny_pair, prompt_file, tmp_path,
                                                                           monkeypatch, capsys, one_thread):
    """The runner reruns, once, the records of its run that the report would name as contended; the
    new record replaces the old one (records.jsonl keeps both lines, the last counts)."""
    import specdec.bench.report as report

    flagged = []

    def contended(records, threads):
        flagged.append(len(records))
        return ["fixed:3@0#1"] if len(flagged) == 1 else []  # the run's check; the report's finds it fine

    monkeypatch.setattr(report, "contended_records", contended)
    out = tmp_path / "run"
    assert main(bench_args(tiny_pair, prompt_file, out, ["target-only", "fixed:3"])) == 0
    assert "rerunning 1 generation(s)" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert len(results["records"]) == 2 * 2 * 2 and record_lines(out) == len(results["records"]) + 1  # prompts, policies, T


def test_bench_with_a_head_measures_the_goals(tiny_pair, prompt_file, tmp_path, capsys, one_thread):
    head_dir = tmp_path / "head"
    torch.manual_seed(0)
    AcceptanceHead(HeadConfig(hidden_size=16, depth=1, draft_identity=model_identity(tiny_pair[0]),
                              threshold=0.4)).save(head_dir)
    out = tmp_path / "run"
    policies = ["target-only", "fixed:2", "fixed:4", "specdec++:0.2", "svip:0.3", "oracle", "hf-dynamic"]
    assert main(bench_args(tiny_pair, prompt_file, out, policies, "--head", str(head_dir), "--forward-ks")) == 0
    results = json.loads((out / "results.json").read_text())
    greedy = results["by_temperature"]["0"]["policies"]
    assert "specdec++:0.4" in greedy  # the head's own h joined the sweep and is the chosen point
    assert results["chosen"]["specdec++"]["spec"] == "specdec++:0.4"
    assert greedy["specdec++:0.2"]["lossless"]["equal"] and greedy["specdec++:0.4"]["lossless"]["equal"]
    goals = results["goals"]
    assert len(goals) == 6 and all(g["measured"] is not None for g in goals), goals
    assert "chosen on validation prompts" in goals[0]["detail"]
    oracle, baseline = greedy["oracle"], greedy["target-only"]  # predicted speedups share the measured baseline
    assert oracle["predicted_speedup"] == pytest.approx(oracle["predicted_tokens_per_s"] / baseline["tokens_per_s"])
    assert results["forward_times"] is None and not (out / "forward-times.png").exists()
    assert "specdec++" in results["by_temperature"]["1"]["frontiers"]

    # The same head's weights at another path (a run resumed from a clone) keep every record.
    before = record_lines(out)
    moved = tmp_path / "moved-head"
    shutil.copytree(head_dir, moved)
    assert main(bench_args(tiny_pair, prompt_file, out, policies, "--head", str(moved), "--forward-ks")) == 0
    assert record_lines(out) == before

    # A new head redoes the specdec++ records (2 specs x 2 prompts x 2 temperatures) and keeps the rest.
    AcceptanceHead(HeadConfig(hidden_size=16, depth=1, draft_identity=model_identity(tiny_pair[0]),
                              threshold=0.4)).save(head_dir)
    assert main(bench_args(tiny_pair, prompt_file, out, policies, "--head", str(head_dir), "--forward-ks")) == 0
    assert record_lines(out) == before + 8


def test_several_drafts_run_side_by_side_in_one_bench(tiny_pair, prompt_file, tmp_path, capsys, one_thread):
    """`POLICY@NAME` runs on the draft `--also-draft NAME=SRC` loads, with that draft's own head,
    interleaved with the first draft's points and one target-only per prompt."""
    import shutil

    second = tmp_path / "second"
    shutil.copytree(tiny_pair[0], second)
    torch.manual_seed(0)
    AcceptanceHead(HeadConfig(hidden_size=16, depth=1, draft_identity=model_identity(second))).save(second / "head")
    out = tmp_path / "run"
    policies = ["target-only", "fixed:2", "fixed:2@second", "specdec++cost", "specdec++cost@second"]
    args = bench_args(tiny_pair, prompt_file, out, policies, "--head", "none", "--also-draft", f"second={second}",
                      "--forward-ks")
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    # The first draft has no head: its specdec++cost is skipped; the second's runs on its own head.
    assert "no acceptance head" in results["skipped_specs"]["specdec++cost"]
    greedy = results["by_temperature"]["0"]["policies"]
    assert set(greedy) == {"target-only", "fixed:2", "fixed:2@second", "specdec++cost@second"}
    assert all(p["lossless"]["equal"] and p["lossless"]["compared"] == 2 for p in greedy.values())
    assert greedy["fixed:2@second"]["family"] == "fixed@second"  # its own family: not in the first's frontier
    assert greedy["specdec++cost@second"]["rounds"] > 0
    heads = {r["head"] for r in results["records"] if r["spec"] == "specdec++cost@second"}
    assert len(heads) == 1 and heads.pop().startswith(str(second / "head"))
    assert len(results["records"]) == record_lines(out) == 2 * 2 * 4  # prompts x temperatures x specs
    capsys.readouterr()

    # A spec naming a draft the engine does not load fails in one line, before any model loads.
    assert main(bench_args(tiny_pair, prompt_file, tmp_path / "x", ["fixed:2@third"])) == 2
    assert "no draft named 'third'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bench_runs_on_the_suffix_draft_alone(tiny_pair, prompt_file, tmp_path, capsys, one_thread):
    """`--draft suffix` times the target's passes and reads the draft's as free: it runs none (the
    forward-time curve timed a pass of it and failed before)."""
    args = bench_args(tiny_pair, prompt_file, tmp_path / "run", ["target-only", "specdec++cost", "svip:0.3"])
    args[args.index("--draft") + 1] = "suffix"
    assert main(args) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    # (svip stops on q, one-hot here: skipped before any generation, not refused after the baseline's)
    assert "one-hot" in results["skipped_specs"]["svip:0.3"] and "svip:0.3" not in results["by_temperature"]["0"]["policies"]
    forward = results["forward_times"]
    assert forward["draft_s"] == {"1": 0.0, "2": 0.0} and all(t > 0 for t in forward["target_s"].values())
    assert results["by_temperature"]["0"]["policies"]["specdec++cost"]["lossless"]["equal"]
    capsys.readouterr()


def test_a_suffix_drafts_records_name_its_targets_runtime():
    """The runtime a run's records were made on, for a model-free draft, is its target's (it named
    the torch runtime for a GGUF target on llama.cpp, and let the other runtime's run resume them)."""
    def runtime(**engine) -> str:
        return BenchConfig(engine=EngineConfig(draft="suffix", **engine)).settings()["runtime"]

    assert runtime(target="/models/t.gguf", runtime="auto", device="cpu") == "llamacpp"
    assert runtime(target="/models/t.gguf", runtime="torch") == "torch"


def test_a_bench_that_measured_nothing_says_so(tiny_pair, prompt_file, tmp_path, capsys, one_thread):
    args = bench_args(tiny_pair, prompt_file, tmp_path / "run", ["fixed:2"])
    args[args.index("--max-new-tokens") + 1] = "100000"  # past every prompt's context: each is skipped
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: nothing was measured: 2 prompts or policies skipped") and err.count("\n") == 1, err


def test_bench_rejects_bad_flags_before_loading(tiny_pair, prompt_file, tmp_path, capsys):
    assert main(bench_args(tiny_pair, prompt_file, tmp_path / "x", ["fixed:zero"])) == 2
    assert "is not an integer K" in capsys.readouterr().err
    assert main(bench_args(tiny_pair, prompt_file, tmp_path / "x", ["fixed:2"], "--limit", "0")) == 2
    assert capsys.readouterr().err.startswith("error: limit")
    assert not (tmp_path / "x").exists()


def test_bench_with_concurrency_decodes_prompts_together(tiny_pair, prompt_file, tmp_path, capsys, one_thread):
    out = tmp_path / "together"
    policies = ["fixed:3", "oracle", "hf-dynamic"]  # target-only joins them: the baseline at the same load
    assert main(bench_args(tiny_pair, prompt_file, out, policies, "--concurrency", "2", "--forward-ks")) == 0
    summary = capsys.readouterr().out
    assert "| aggregate tok/s | vs target-only |" in summary
    results = json.loads((out / "results.json").read_text())
    assert results["policies"][0] == "target-only"
    records = [r for r in results["records"] if r["family"] != "hf"]
    assert {r["spec"] for r in records} == {"target-only", "fixed:3", "oracle"}
    assert all(r["group"] == 0 and r["group_wall_s"] > 0 for r in records)  # both prompts in one group
    for temperature in ("0", "1"):
        rows = results["by_temperature"][temperature]["policies"]
        base = rows["target-only"]["aggregate_tokens_per_s"]
        assert base > 0 and rows["target-only"]["aggregate_speedup"] == pytest.approx(1.0)
        assert rows["fixed:3"]["aggregate_speedup"] == pytest.approx(rows["fixed:3"]["aggregate_tokens_per_s"] / base)
        row = next(line for line in summary.splitlines() if line.startswith("| fixed:3 |")
                   and f"| {rows['fixed:3']['tokens_per_s']:.2f} |" in line)
        assert f"| {rows['fixed:3']['aggregate_tokens_per_s']:.2f} | {rows['fixed:3']['aggregate_speedup']:.2f}x |" in row
    greedy = results["by_temperature"]["0"]["policies"]
    assert greedy["fixed:3"]["lossless"]["equal"] and greedy["oracle"]["discard_rate"] == 0.0
    assert greedy["hf-dynamic"]["aggregate_tokens_per_s"] is None and greedy["hf-dynamic"]["aggregate_speedup"] is None

    lines = record_lines(out)  # resumed with the same flags: nothing to redo, target-only included
    assert main(bench_args(tiny_pair, prompt_file, out, policies, "--concurrency", "2", "--forward-ks")) == 0
    assert record_lines(out) == lines == 2 * (3 + 2 + 2)  # 2 prompts x (3 of ours at t=0, 2 at t=1, hf-dynamic x 2)
    assert main(bench_args(tiny_pair, prompt_file, out, policies, "--forward-ks")) == 2  # concurrency 1 != 2
    assert "concurrency=2" in capsys.readouterr().err


def test_a_first_divergence_carries_the_target_gap_where_the_outputs_part(tiny_engine):
    from specdec.bench.runner import NEAR_TIE_LOGIT_GAP, first_divergence
    from specdec.params import GenerationParams
    from specdec.policies import PolicyConfig

    prompt = tiny_engine.encode_prompt(PROMPTS[0])
    params = GenerationParams(max_new_tokens=6, policy=PolicyConfig(name="target-only"))
    reference = tiny_engine.generate_ids(prompt, params).completions[0].token_ids
    target = tiny_engine.target
    logits = target.score([target.new_session()], [prompt + reference[:3]], [[]])[0][-1]  # [V] before token 3
    (top1, top2), (first, second) = torch.topk(logits, 2)
    assert int(first) == reference[3]
    runner_up = first_divergence(target, prompt, reference, reference[:3] + [int(second)])
    assert runner_up["position"] == 3 and runner_up["target_only"] == reference[3] and runner_up["token"] == int(second)
    assert runner_up["gap"] == pytest.approx(float(top1 - top2), abs=1e-4)
    assert runner_up["near_tie"] == (runner_up["gap"] <= NEAR_TIE_LOGIT_GAP["torch"])
    worst = first_divergence(target, prompt, reference, reference[:3] + [int(logits.argmin())])
    assert worst["gap"] > 1.0 and worst["near_tie"] is False
    shorter = first_divergence(target, prompt, reference, reference[:3])
    assert shorter == {"position": 3, "target_only": reference[3], "token": None, "gap": None, "near_tie": False}
