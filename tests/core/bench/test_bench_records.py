"""Policy specs, the record store and what a resumed run still has to do (no models)."""

from __future__ import annotations

import json

import pytest

from specdec.bench.peer import _peer_stats, peer_mode
from specdec.bench.records import RECORDS_FILE, RecordStore, record_key, stats_from_dict
from specdec.bench.runner import BenchConfig, BenchRun
from specdec.bench.specs import DEFAULT_POLICIES, PolicySpec, parse_spec, parse_specs, with_baseline
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.metrics import RequestStats


def test_specs_parse_to_canonical_keys_and_policy_flags():
    assert parse_spec("fixed:4") == PolicySpec("fixed", 4)
    assert parse_spec("svip:0.50").key == "svip:0.5"
    assert parse_spec("specdec++:0.3").policy_config().threshold == 0.3
    assert parse_spec("heuristic:8").policy_config().k == 8
    assert parse_spec("oracle").greedy_only and parse_spec("hf-dynamic").is_peer
    assert parse_spec("hf-heuristic:5").family == "hf"
    assert [s.key for s in parse_specs(["fixed:4", "fixed:04", "svip"])] == ["fixed:4", "svip"]
    on_feature = parse_spec("fixed:4@feature")  # another of the engine's drafts
    assert on_feature == PolicySpec("fixed", 4, "feature") and on_feature.key == "fixed:4@feature"
    assert on_feature.family == "fixed@feature" and on_feature.policy_config().k == 4
    assert parse_spec("specdec++cost@feature").key == "specdec++cost@feature"
    assert parse_spec("fixed:4@default") == PolicySpec("fixed", 4)  # the first draft keeps its plain key


@pytest.mark.parametrize("text, reason", [
    ("bogus", "unknown policy spec"), ("fixed:x", "is not an integer K"), ("svip:1.5", "must be in (0, 1)"),
    ("fixed:0", "at least 1"), ("oracle:3", "takes no value"), ("fixed:2@", "name a draft after '@'"),
    ("target-only@feature", "target-only drafts nothing"), ("hf-dynamic@feature", "runs the first draft"),
])
def test_bad_specs_fail_in_one_line(text, reason):
    with pytest.raises(InvalidRequestError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(text)


def test_the_baseline_joins_specs_that_leave_it_out_once():
    assert [s.key for s in with_baseline(parse_specs(["fixed:4", "oracle"]))] == ["target-only", "fixed:4", "oracle"]
    assert [s.key for s in with_baseline(parse_specs(["fixed:4", "target-only"]))] == ["fixed:4", "target-only"]


def test_default_policies_are_the_issue_sweep():
    keys = [s.key for s in parse_specs(DEFAULT_POLICIES)]
    assert [k for k in keys if k.startswith("fixed:")] == [f"fixed:{k}" for k in (2, 4, 6, 8, 10, 12, 14)]
    assert [k for k in keys if k.startswith("specdec++:")] == [f"specdec++:{h}" for h in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert {"target-only", "heuristic", "oracle", "hf-heuristic", "hf-dynamic"} <= set(keys)
    assert any(k.startswith("svip:") for k in keys) and any(k.startswith("confidence:") for k in keys)


def record(spec: str, temperature: float, prompt: int) -> dict:
    stats = RequestStats(generated_tokens=4, wall_time_s=1.0)
    stats.record_round(3, 2)
    return {"spec": spec, "family": spec.split(":")[0], "temperature": temperature, "prompt": prompt,
            "token_ids": [1, 2, 3, 4], "stats": stats.to_dict()}


def test_store_round_trip_and_a_torn_last_line(tmp_path, capsys):
    store = RecordStore(tmp_path)
    store.append(record("fixed:4", 0.0, 0))
    store.append(record("fixed:4", 1.0, 0))
    with (tmp_path / RECORDS_FILE).open("a") as f:
        f.write('{"spec": "fixed:4", "temp')  # killed mid-write
    again = RecordStore(tmp_path)
    assert len(again) == 2 and record_key("fixed:4", 1, 0) in again
    assert "unreadable record skipped" in capsys.readouterr().err
    again.append(record("fixed:4", 0.0, 1))  # the next record is not written onto the end of the cut one
    third = RecordStore(tmp_path)
    assert len(third) == 3 and record_key("fixed:4", 0.0, 1) in third
    assert "unreadable" not in capsys.readouterr().err  # (warned once: the file was mended)
    stats = stats_from_dict(again.get(record_key("fixed:4", 0.0, 0))["stats"])
    assert (stats.rounds, stats.accepted_tokens, stats.discarded_tokens, stats.k_histogram[3]) == (1, 2, 1, 1)


def test_settings_mismatch_is_refused(tmp_path):
    store = RecordStore(tmp_path)
    store.check_settings({"max_new_tokens": 128})
    store.append(record("fixed:4", 0.0, 0))
    store.check_settings({"max_new_tokens": 128})  # the same settings resume
    with pytest.raises(SpecDecError, match="max_new_tokens=128, not 64"):
        RecordStore(tmp_path).check_settings({"max_new_tokens": 64})


def test_a_run_file_cut_short_is_a_one_line_refusal(tmp_path):
    store = RecordStore(tmp_path)
    store.check_settings({"max_new_tokens": 128})
    store.append(record("fixed:4", 0.0, 0))
    (tmp_path / "run.json").write_text('{"max_new_tok')
    with pytest.raises(SpecDecError, match="run.json is not a JSON object \\(cut short\\?\\): delete it"):
        RecordStore(tmp_path).check_settings({"max_new_tokens": 128})


def test_a_prompts_file_is_recorded_by_its_content(tmp_path):
    """An edited prompt file is another prompt set: its records must not mix with the old ones'."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    first = BenchConfig(prompts=str(prompts)).settings()["prompts"]
    assert first.startswith(str(prompts.resolve()) + "#")
    prompts.write_text("one\nthree\n")
    assert BenchConfig(prompts=str(prompts)).settings()["prompts"] != first
    assert BenchConfig(prompts="humaneval").settings()["prompts"] == "humaneval"  # (a set by its name, as before)


def test_a_temperature_given_twice_runs_once():
    assert BenchConfig(temperatures=[0, 1, 0.0, 0.5, 1.0]).temperatures == [0.0, 1.0, 0.5]


def test_a_setting_newer_than_the_run_reads_as_its_old_value(tmp_path):
    store = RecordStore(tmp_path)
    store.check_settings({"max_new_tokens": 128})
    store.append(record("fixed:4", 0.0, 0))
    added = {"draft_vocab": "full"}
    RecordStore(tmp_path).check_settings({"max_new_tokens": 128, "draft_vocab": "full"}, added=added)
    with pytest.raises(SpecDecError, match="draft_vocab='full', not 'ascii'"):
        RecordStore(tmp_path).check_settings({"max_new_tokens": 128, "draft_vocab": "ascii"}, added=added)


def test_resume_leaves_only_missing_records(tmp_path):
    config = BenchConfig(out=tmp_path, temperatures=[0.0, 1.0])
    specs = parse_specs(["target-only", "fixed:4", "oracle"])
    store = RecordStore(tmp_path)
    for spec, temperature, prompt in (("target-only", 0.0, 0), ("fixed:4", 0.0, 0), ("oracle", 0.0, 0),
                                      ("fixed:4", 1.0, 1)):
        store.append(record(spec, temperature, prompt))
    run = BenchRun(config, specs, ["a", "b", "c"], RecordStore(tmp_path), progress=False)
    todo = {(t, i, s.key) for t, i, s in run._todo([[1], [2], None])}  # prompt 2 could not be encoded
    assert todo == {(0.0, 1, "target-only"), (0.0, 1, "fixed:4"), (0.0, 1, "oracle"),
                    (1.0, 0, "target-only"), (1.0, 0, "fixed:4"), (1.0, 1, "target-only")}
    assert "oracle@t=1" in run.notes["skipped_specs"]


def test_peer_rounds_from_target_passes_and_committed_tokens():
    # prompt 10 tokens; pass 1 feeds the prompt + 4 candidates and commits 3 tokens (2 accepted);
    # pass 2 feeds the last token + 5 candidates and commits all 5 + the bonus token.
    stats = _peer_stats(10, [14, 6], [[7, 8, 9], [1, 2, 3, 4, 5, 6]])
    assert (stats.rounds, stats.draft_tokens, stats.accepted_tokens, stats.discarded_tokens) == (2, 9, 7, 2)
    assert peer_mode("hf-dynamic").confidence_threshold == 0.4
    assert peer_mode("hf-heuristic", 5).num_assistant_tokens == 5 and peer_mode("hf-heuristic").schedule == "heuristic"
    json.dumps(stats.to_dict())


def test_the_oracle_takes_target_only_tokens_from_the_run(tmp_path):
    store = RecordStore(tmp_path)
    store.append(record("target-only", 0.0, 0))
    run = BenchRun(BenchConfig(out=tmp_path), parse_specs(["target-only", "oracle"]), ["a", "b"], store, progress=False)
    assert run._oracle_reference(PolicySpec("oracle"), 0.0, 0) == [1, 2, 3, 4]
    assert run._oracle_reference(PolicySpec("oracle"), 0.0, 1) is None  # not there yet: the engine decodes it
    assert run._oracle_reference(PolicySpec("fixed", 4), 0.0, 0) is None


def test_a_stopped_run_drops_the_prompt_in_flight(tmp_path):
    store = RecordStore(tmp_path)
    for spec, temperature, prompt in (("target-only", 0.0, 0), ("oracle", 0.0, 0), ("target-only", 0.0, 1),
                                      ("target-only", 1.0, 0)):  # t=1 has no oracle: one record is whole
        store.append(record(spec, temperature, prompt))
    assert store.drop_incomplete_prompts() == [("0", 1)]
    again = RecordStore(tmp_path)
    assert len(again) == 3 and record_key("target-only", 0.0, 1) not in again


def test_an_out_that_is_a_file_and_an_infinite_temperature_are_refused_in_one_line(tmp_path):
    from pydantic import ValidationError

    taken = tmp_path / "a-file"
    taken.write_text("")
    with pytest.raises(SpecDecError, match="--out") as caught:
        RecordStore(taken).check_settings({"max_new_tokens": 4})
    assert "\n" not in str(caught.value)
    with pytest.raises(ValidationError, match="finite"):
        BenchConfig(temperatures=[float("inf")], out=tmp_path / "out")
