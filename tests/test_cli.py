"""`specdec generate` on tiny models: JSON shape, streaming, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from engine_backend import free_port
from specdec.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=300)


def tiny_flags(tiny_pair) -> list[str]:
    draft, target = tiny_pair
    return ["--draft", str(draft), "--target", str(target)]


def test_json_output(tiny_pair):
    proc = run_cli("generate", "hello", *tiny_flags(tiny_pair), "--policy", "fixed", "--k", "3",
                   "--max-new-tokens", "9", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (completion,) = out["completions"]
    assert set(completion) == {"text", "token_ids", "finish_reason"}
    assert len(completion["token_ids"]) == 9 and completion["finish_reason"] == "length"
    stats = out["stats"]
    for key in ("generated_tokens", "draft_forward_passes", "target_forward_passes", "discarded_tokens",
                "verification_rate", "discard_rate", "acceptance_rate", "mean_accepted_length",
                "acceptance_by_position", "k_histogram", "draft_time_s", "target_time_s", "wall_time_s",
                "tokens_per_s"):
        assert key in stats
    assert stats["generated_tokens"] == 9


def test_the_static_cache_decodes_as_the_slot_cache(tiny_pair, capsys):
    """`--kv-cache static` through the builder (the draft's default int8 weights feed a session's
    first token alone: a pass that reads no output)."""
    ids = []
    for kv in ("static", "slots"):
        assert main(["generate", "hello", *tiny_flags(tiny_pair), "--kv-cache", kv, "--policy", "fixed", "--k", "3",
                     "--max-new-tokens", "8", "--json"]) == 0
        ids.append(json.loads(capsys.readouterr().out)["completions"][0]["token_ids"])
    assert ids[0] == ids[1] and len(ids[0]) == 8


def test_streams_text_then_summary(tiny_pair, capsys):
    code = main(["generate", "hello", *tiny_flags(tiny_pair), "--policy", "svip", "--max-new-tokens", "8",
                 "--temperature", "0.7", "--seed", "3"])
    captured = capsys.readouterr()
    assert code == 0
    assert "verification rate" in captured.err and "tok/s" in captured.err
    assert captured.out.endswith("\n")


def test_a_second_draft_by_name(tiny_pair, capsys):
    """--also-draft loads another draft beside --draft and --use-draft picks it: the same output
    (the target's, greedy), drafted by it."""
    outputs = []
    for use in ("default", "second"):
        assert main(["generate", "hello", *tiny_flags(tiny_pair), "--also-draft", f"second={tiny_pair[0]}",
                     "--use-draft", use, "--policy", "fixed", "--k", "3", "--max-new-tokens", "8", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["stats"]["draft_tokens"] > 0
        outputs.append(result["completions"][0]["token_ids"])
    assert outputs[0] == outputs[1]


def test_n_samples_json(tiny_pair, capsys):
    code = main(["generate", "hello", *tiny_flags(tiny_pair), "--n", "3", "--temperature", "1", "--seed", "1",
                 "--max-new-tokens", "5", "--no-chat-template", "--json"])
    assert code == 0
    assert len(json.loads(capsys.readouterr().out)["completions"]) == 3


def test_several_prompts_run_together(tiny_pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nWrite hello world.\n")
    flags = [*tiny_flags(tiny_pair), "--policy", "fixed", "--k", "2", "--max-new-tokens", "6", "--no-chat-template"]
    assert main(["generate", "hello", "--prompts", str(prompts), *flags]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("---")] == \
        ["--- prompt 1 ---", "--- prompt 2 ---", "--- prompt 3 ---"]
    assert "3 requests together:" in captured.err and "tok/s aggregate" in captured.err
    assert [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("prompt ")] == \
        ["prompt 1", "prompt 2", "prompt 3"]
    assert main(["generate", "hello", "--prompts", str(prompts), "--limit", "1", *flags, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(1 <= len(json.loads(line)["completions"][0]["token_ids"]) <= 6 for line in lines)
    assert main(["generate", *flags]) == 2
    assert "no prompt" in capsys.readouterr().err


@pytest.mark.parametrize("flags, reason", [
    (["--policy", "bogus"], "unknown policy 'bogus'"),
    (["--policy", "svip", "--threshold", "1.2"], "must be in (0, 1)"),
    (["--policy", "specdec++", "--threshold", "0"], "needs an acceptance head"),
    (["--policy", "fixed", "--k", "0"], "k must be at least 1"),
    (["--temperature", "-0.5"], "temperature"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-p", "0"], "top-p"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--head", "/nonexistent/head"], "no acceptance head"),
    (["--device", "tpu7"], "unknown device 'tpu7'"),
    (["--use-draft", "eagle"], "unknown draft 'eagle'"),
    (["--also-draft", "feature"], "--also-draft takes NAME=SOURCE"),
    (["--also-draft", "default=x"], "'default' names the first draft"),
    (["--also-draft", "=suffix"], "--also-draft takes NAME=SOURCE"),
    (["--threads", "0"], "threads: Input should be greater than or equal to 1"),  # (pydantic's, one line)
    # (past a C int: torch.set_num_threads raised "Overflow when unpacking long", a traceback)
    (["--threads", "99999999999"], "threads: Input should be less than or equal to 4096"),
    # llama.cpp aborted the process; the reason stands alone (not "request: Value error, ...")
    (["--llamacpp-context", "32"], "error: a context and a batch of at least 64 tokens (one per sequence)"),
    # a flag's error names the flag, not the config key it sets (max-sessions-per-step, context)
    (["--llamacpp-context", "1"], "error: llamacpp-context: Input should be greater than or equal to 16"),
    # (ctypes cut it to its low 32 bits, a cache of 1,215,752,191 cells for llama.cpp to allocate)
    (["--llamacpp-context", "99999999999"], "error: llamacpp-context: Input should be less than or equal to 2147483647"),
    (["--max-batch-sessions", "0"], "error: max-batch-sessions: Input should be greater than or equal to 1"),
    (["--max-pass-tokens", "0"], "error: max-pass-tokens: Input should be greater than or equal to 1"),
    (["--stop", ""], "stop.0: String should have at least 1 character"),
    (["--prompts", "humaneval", "--limit", "-1"], "--limit must be at least 1"),
    (["--limit", "3"], "give --prompts too"),  # (it was ignored)
    (["--also-draft", "a=x", "--also-draft", "a=y"], "--also-draft: a named twice"),
    (["--llamacpp-context", "4096"], "no model of this engine runs on llama.cpp"),  # (torch models: ignored)
    (["--device", "meta"], "unknown device 'meta'"),  # (a torch device, but no runtime's: a traceback)
    (["--draft", "suffix", "--head", "/some/head"], "the suffix draft estimates acceptance from its matches"),
])
def test_bad_flags_exit_with_one_line(tiny_pair, capsys, flags, reason):
    code = main(["generate", "hello", *tiny_flags(tiny_pair), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ") and reason in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("flags, reason", [
    (["   "], "prompt is empty"),
    (["hi", "--policy", "oracle", "--temperature", "0.5"], "is defined for greedy decoding (temperature 0) only"),
    (["hi", "--draft", "suffix", "--policy", "svip"], "the suffix draft's is one-hot"),
])
def test_a_request_no_model_could_serve_is_refused_before_any_loads(tiny_pair, monkeypatch, capsys, flags, reason):
    import specdec.builder

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the request was checked")

    monkeypatch.setattr(specdec.builder, "load_model", no_load)
    draft, target = tiny_pair
    assert main(["generate", "--draft", str(draft), "--target", str(target), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and reason in err and err.count("\n") == 1, err


def test_empty_and_too_long_prompt(tiny_pair, capsys):
    assert main(["generate", "", *tiny_flags(tiny_pair)]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "y" * 400, *tiny_flags(tiny_pair), "--no-chat-template"]) == 2
    assert "context holds" in capsys.readouterr().err
    # (among several, which: the error did not say)
    assert main(["generate", "x", "y" * 400, *tiny_flags(tiny_pair), "--no-chat-template"]) == 2
    assert "error: prompt 2: prompt has 400 tokens" in capsys.readouterr().err


def test_missing_and_corrupt_models(tiny_pair, tmp_path, capsys):
    assert main(["generate", "hi", "--draft", str(tmp_path / "missing"), "--target", str(tiny_pair[1])]) == 2
    assert "error:" in capsys.readouterr().err

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_pair[1].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["generate", "hi", "--draft", str(tiny_pair[0]), "--target", str(broken)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: cannot load the target model") and "deserializing" in last


def test_head_for_another_draft(tiny_pair, tmp_path, capsys):
    from specdec.head import AcceptanceHead, HeadConfig

    AcceptanceHead(HeadConfig(hidden_size=16, depth=1, draft_identity="someone-else")).save(tmp_path / "head")
    code = main(["generate", "hi", *tiny_flags(tiny_pair), "--policy", "specdec++", "--head", str(tmp_path / "head")])
    assert code == 2
    assert "trained for another draft" in capsys.readouterr().err


def test_debug_shows_traceback(tiny_pair):
    proc = run_cli("generate", "hi", *tiny_flags(tiny_pair), "--policy", "bogus", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
    proc = run_cli("generate", "hi", *tiny_flags(tiny_pair), "--policy", "bogus")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "error: unknown policy 'bogus'; choose one of specdec++, specdec++cost, fixed, svip, heuristic, confidence, oracle, target-only"


def test_training_commands_reject_a_bad_config_in_one_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("data: {dir: d}\ntrain: {storage: s, output: o, depht: 3}\n")
    for command in ("gen-data", "train-head"):
        assert main([command, "--config", str(config)]) == 2
        assert capsys.readouterr().err == f"error: {config}: train.depht: unknown key\n"


def test_train_head_without_data_fails_before_ray(tmp_path, tiny_pair):
    config = tmp_path / "c.yaml"
    config.write_text(f"models: {{draft: {tiny_pair[0]}, target: {tiny_pair[1]}}}\n"
                      f"data: {{dir: {tmp_path / 'none'}}}\ntrain: {{storage: {tmp_path / 'runs'}, output: o}}\n")
    proc = run_cli("train-head", "--config", str(config))
    assert proc.returncode == 2 and "no dataset at" in proc.stderr and "run `specdec gen-data` first" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["head.lock"]  # the run's lock, taken first, alone


@pytest.mark.parametrize("address, reason", [("bogus", "Invalid address format"),
                                             ("auto", "Could not find any running Ray instance"),
                                             (f"127.0.0.1:{free_port()}", "nothing answers there"),
                                             ("ray://127.0.0.1:99999", "nothing answers there"),
                                             # (Ray's job docs export this one; it said "nothing answers")
                                             ("http://127.0.0.1:8265", "that is the dashboard's (Jobs) address")])
def test_a_ray_address_that_does_not_answer_is_one_line(tmp_path, monkeypatch, capsys, address, reason):
    import ray

    if ray.is_initialized():  # (a test before may have left one: nothing but its fixtures shares it)
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{dir: {tmp_path / 'data'}}}\ntrain: {{storage: {tmp_path / 'runs'}, output: o}}\n")
    assert main(["gen-data", "--config", str(config), "--address", address]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: Ray at '{address}': {reason}")


def test_workers_this_machine_can_never_place_are_refused_not_waited_for(tmp_path, monkeypatch, capsys):
    import os

    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = tmp_path / "c.yaml"
    for scaling in (f"{{num_workers: {2 * os.cpu_count()}}}", "{use_gpu: true, num_workers: 64, cpus_per_worker: 0.01}"):
        config.write_text(f"data: {{dir: {tmp_path / 'data'}}}\nscaling: {scaling}\n")
        assert main(["gen-data", "--config", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: scaling (") and "this machine has" in err[-1]
        assert not ray.is_initialized()
        assert [p.name for p in (tmp_path / "data").iterdir()] == ["gen-data.lock"]  # its lock, taken first, alone


def test_gen_data_refuses_a_model_source_that_is_not_one_before_ray_starts(tmp_path, monkeypatch, capsys):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"models: {{draft: {tmp_path / 'nowhere'}}}\ndata: {{dir: {tmp_path / 'data'}}}\n")
    assert main(["gen-data", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "no such directory or file" in err[-1]
    assert not ray.is_initialized()  # (a private Ray started first: 5 s, then the same refusal)


def test_gen_data_into_a_data_dir_being_written_is_refused_before_ray_starts(tiny_pair, tmp_path, monkeypatch,
                                                                             capsys):
    """As train-head holds its run (test_train.py, test_a_held_run_is_refused_before_the_dataset_is_hashed),
    gen-data holds its data.dir first: a second one into it is refused in one line before Ray starts
    (seconds; a cluster's resources) or a model resolves (a download, a GGUF's hash). It started Ray first."""
    import os
    import re

    import ray

    import specdec.training.data as data
    from specdec.files import held

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started, resolved = [], []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: started.append(1) or pytest.fail("Ray started"))
    monkeypatch.setattr(data, "model_entry", lambda *args: resolved.append(1) or pytest.fail("a model resolved"))
    directory = tmp_path / "data"
    config = tmp_path / "c.yaml"
    config.write_text(f"models: {{draft: {tiny_pair[0]}, target: {tiny_pair[1]}}}\ndata: {{dir: {directory}}}\n")
    with held(directory / data.LOCK_FILE, data.DatasetError, "", ""):  # a gen-data writing it meanwhile
        assert main(["gen-data", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(rf"error: data.dir {re.escape(str(directory))} is being written by process "
                                          rf"{os.getpid()} on .*; wait for it to end, or use another data.dir", err[0])
    assert started == resolved == []


def test_serve_refuses_replicas_this_machine_could_never_place(tiny_pair, capsys, monkeypatch):
    """On its private Ray: Serve waited for the third replica's CPU forever, saying nothing."""
    import os

    import ray
    import services.launch

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services.launch, "start", lambda *args: pytest.fail("the app was deployed"))
    code = main(["serve", *tiny_flags(tiny_pair), "--draft-replicas", str(os.cpu_count()), "--http-port",
                 str(free_port()), "--grpc-port", str(free_port())])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not ray.is_initialized()
    assert err[-1].startswith(f"error: the replicas (--draft-replicas, --verifier-replicas, --target-shards) ask "
                              f"{os.cpu_count() + 1} "
                              f"CPUs and 0 GPUs; this machine has {os.cpu_count()}")


def test_serve_lets_the_requests_in_flight_finish_and_asks_a_gpu_per_shard(tiny_pair, monkeypatch, capsys):
    """Ctrl-C said "the requests in flight finish first" and Serve gave a coordinator 20 s;
    `--target-shards 2` reserved no GPU for its shards."""
    import services.launch
    from services.config import REQUEST_REPLICAS

    built = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services.launch, "serve_forever", lambda config, *args: built.append(config) or 0)
    for shards in (1, 2):
        assert main(["serve", *tiny_flags(tiny_pair), "--target-shards", str(shards)]) == 0
    one, two = built
    assert one.coordinator.graceful_shutdown_timeout_s == REQUEST_REPLICAS["graceful_shutdown_timeout_s"]
    assert one.ingress.graceful_shutdown_timeout_s == REQUEST_REPLICAS["graceful_shutdown_timeout_s"]
    assert one.verifier.health_check_timeout_s == 60 and one.coordinator.num_cpus == 0
    assert (one.verifier.num_gpus, two.verifier.num_gpus, two.draft.num_gpus) == (0, 2, 0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # a GPU machine: its replicas would see none
    capsys.readouterr()
    assert main(["serve", *tiny_flags(tiny_pair), "--device", "cuda"]) == 2
    assert "specdec serve runs its models on the CPU" in capsys.readouterr().err


@pytest.mark.parametrize("flags, reason", [
    (["--policy", "oracle"], "runs in process only"),
    (["--policy", "fixed", "--k", "65"], "k must be at most 64"),
    (["--http-port", "0"], "--http-port must be in 1..65535"),
    (["--grpc-port", "70000"], "--grpc-port must be in 1..65535"),
    (["--http-port", "9000"], "--http-port and --grpc-port are both 9000"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid'"),
    (["--http-port", "TAKEN"], "Address already in use"),
    (["--verifier-replicas", "0"], "--verifier-replicas must be at least 1, got 0"),  # (it named num-replicas)
    # (accepted: Ray started and each replica failed in torch.set_num_threads)
    (["--threads", "99999999999"], "threads: Input should be less than or equal to 4096"),
    (["--draft", "/no/such/draft"], "no such"),  # (the replicas failed after Ray started, with a traceback)
    (["--draft-vocab", "/no/such/vocab.json"], "expected 'full', 'ascii' or a JSON file"),  # (the replicas failed)
    # (accepted and ignored: refused in process, the replicas here read nothing of them)
    (["--llamacpp-context", "4096"], "no model of this engine runs on llama.cpp"),
    # (it joined whatever Ray `ray start` left on the machine, and served where the flags did not say)
    (["--address", f"127.0.0.1:{free_port()}"], "nothing answers there"),
    (["--address", "http://127.0.0.1:8265"], "that is the dashboard's (Jobs) address"),
])
def test_serve_refuses_what_it_could_not_serve_before_ray_starts(tiny_pair, capsys, monkeypatch, flags, reason):
    import socket

    import services.launch

    monkeypatch.setattr(services.launch, "start", lambda *args: pytest.fail("Ray started"))
    with socket.socket() as taken:  # a port another server listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        flags = [str(taken.getsockname()[1]) if flag == "TAKEN" else flag for flag in flags]
        code = main(["serve", *tiny_flags(tiny_pair), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ") and reason in err[-1]


def test_an_error_logged_on_the_way_prints_one_line_without_debug():
    """Found by a bug hunt: a failed round call logged its traceback through Python's last-resort
    handler before the command's own one-line error; --debug is what shows tracebacks."""
    import subprocess
    import sys

    script = ("import logging, sys, specdec.cli as cli\n"
              "def failing(args):\n"
              "    try:\n"
              "        raise RuntimeError('boom')\n"
              "    except RuntimeError:\n"
              "        logging.getLogger('specdec.calls').exception('verifier call failed')\n"
              "    return 0\n"
              "cli.cmd_generate = failing\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")
    quiet = subprocess.run([sys.executable, "-c", script, "generate", "x"], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stderr.strip() == "ERROR: verifier call failed"
    debug = subprocess.run([sys.executable, "-c", script, "generate", "x", "--debug"], capture_output=True, text=True,
                           timeout=120)
    assert "Traceback" in debug.stderr and "RuntimeError: boom" in debug.stderr
