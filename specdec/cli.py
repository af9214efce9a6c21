"""The `specdec` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

from specdec.errors import InvalidRequestError, SpecDecError, one_line

if TYPE_CHECKING:
    from specdec.training.config import ScalingSection

EXIT_USAGE = 2


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    from specdec.builder import DEFAULT_DRAFT_SOURCE
    from specdec.models.sources import DEFAULT_DRAFT_QUANT, REQUANT_FTYPES, SHIPPED

    group = parser.add_argument_group("models")
    group.add_argument("--draft", default=DEFAULT_DRAFT_SOURCE,
                       help=f"draft (default: {DEFAULT_DRAFT_SOURCE}): 'default' (the pinned 0.5B model), a HF "
                            "directory, a .gguf file, a hub id, a feature draft: "
                            "'default-feature' (shipped) or its directory (specdec train-draft; it runs on a torch "
                            "target), 'suffix': no model, the continuation of the text's own repeats, or "
                            "'suffix+SOURCE': the suffix fused with the model draft SOURCE (e.g. suffix+default)")
    group.add_argument("--also-draft", action="append", default=None, metavar="NAME=SOURCE",
                       help="another draft beside --draft (repeatable), same forms, with its shipped head; a "
                            "request picks it with --use-draft NAME, and the drafts' sessions share the "
                            "target's passes")
    group.add_argument("--target", default="default", help="target model: same forms as --draft")
    group.add_argument("--head", default="auto",
                       help="acceptance head for specdec++: a directory, 'auto' (the head shipped for the default "
                            "pair, or a feature draft's own; none for other drafts) or 'none'")
    group.add_argument("--cache-dir", default=None, help="where models are fetched and converted (default $SPECDEC_CACHE or ~/.cache/specdec)")
    group.add_argument("--draft-format", default="auto", choices=["auto", "fp32", "onednn", "int8"], help="draft weight format and kernels")
    group.add_argument("--target-format", default="auto", choices=["auto", "fp32", "onednn", "int8"], help="target weight format and kernels")
    group.add_argument("--draft-vocab", default="full",
                       help="tokens the draft's LM head scores: full, ascii, or a JSON file listing token ids (lossless either way)")
    group.add_argument("--runtime", default="auto", choices=["auto", "torch", "llamacpp"],
                       help="kernels: llamacpp reads GGUF files as they are; torch runs HF models (GGUF converted "
                            "to fp32 once); auto = llamacpp for default and .gguf on CPU, else torch")
    group.add_argument("--draft-quant", default="auto", choices=["auto", SHIPPED, *REQUANT_FTYPES],
                       help="the llama.cpp draft's weights: as shipped, or requantized once to a type with "
                            "llama.cpp's fast x86 kernels (the target is never requantized); auto = "
                            f"{DEFAULT_DRAFT_QUANT} for the default draft on llama.cpp, else as shipped")
    group.add_argument("--llamacpp-context", type=int, default=None,
                       help="llama.cpp cache positions per model, shared by all sessions (default 8192)")
    group.add_argument("--threads", type=int, default=None, help="CPU threads (torch and llama.cpp)")
    group.add_argument("--device", default="auto", help="where the models run: auto (a GPU when present), cpu, cuda, cuda:N")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="the torch models' dtype: auto = bfloat16 on a GPU, float32 on the CPU")
    group = parser.add_argument_group("batching (sessions share every forward pass)")
    group.add_argument("--max-batch-sessions", type=int, default=None,
                       help="sessions one step advances at most (default 16; the others wait their turn)")
    group.add_argument("--max-pass-tokens", type=int, default=None,
                       help="tokens one forward pass feeds at most; more run as several passes (default: no limit)")
    group.add_argument("--overlap", default=None, choices=["auto", "on", "off"],
                       help="draft a session's next round while its round verifies: auto (default) where the "
                            "planner measures that it pays (a draft with a device or process of its own)")
    group.add_argument("--kv-cache", default="auto", choices=["auto", "slots", "static", "reference"],
                       help="slots: many sessions per pass; static: the same in one preallocated cache (the GPU's "
                            "layout); reference: the batch-1 path, one pass per session; auto: static on a GPU, "
                            "slots on the CPU")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="with the static cache on CUDA: run every pass eagerly instead of replaying captured graphs")


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    from specdec.policies import POLICY_NAMES

    group = parser.add_argument_group("generation")
    group.add_argument("--policy", default=None, help=f"stopping policy: {', '.join(POLICY_NAMES)}")
    group.add_argument("--k", type=int, default=None,
                       help="K for fixed, initial K for heuristic, most candidates per round for the others")
    group.add_argument("--threshold", type=float, default=None,
                       help="h for specdec++, entropy threshold for svip, probability threshold for confidence")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    group.add_argument("--n", type=int, default=None, help="independent samples (default 1)")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    group.add_argument("--use-draft", default=None, metavar="NAME",
                       help="which draft proposes the rounds: 'default' (--draft) or a name of --also-draft "
                            "(served: of the server's models.drafts)")


def generation_params(args: argparse.Namespace):
    from specdec.params import build_params

    return build_params(
        policy=args.policy, k=args.k, threshold=args.threshold, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_new_tokens=args.max_new_tokens,
        n=args.n, stop=tuple(args.stop) if args.stop else None,
        chat_template=False if args.no_chat_template else None, draft=args.use_draft)


def engine_config(args: argparse.Namespace):
    from specdec.builder import EngineConfig

    from specdec.loop import BatchConfig

    from specdec.models.llamacpp import LlamaCppOptions

    from pydantic import ValidationError

    from specdec.errors import validation_message

    batch = BatchConfig.from_flags(args.max_batch_sessions, args.max_pass_tokens, args.overlap)
    try:
        llamacpp = LlamaCppOptions(**({"context": args.llamacpp_context} if args.llamacpp_context is not None else {}))
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc, {"context": "llamacpp-context"})) from None
    pairs = [named.split("=", 1) for named in args.also_draft or []]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise InvalidRequestError("--also-draft takes NAME=SOURCE")
    names = [name for name, _ in pairs]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise InvalidRequestError(f"--also-draft: {', '.join(twice)} named twice")
    drafts = dict(pairs)
    return EngineConfig(draft=args.draft, drafts=drafts, target=args.target, head=args.head, cache_dir=args.cache_dir,
                        draft_format=args.draft_format, target_format=args.target_format,
                        draft_vocab=args.draft_vocab, draft_quant=args.draft_quant, threads=args.threads,
                        device=args.device, dtype=args.dtype, batch=batch, kv_cache=args.kv_cache, cuda_graphs=args.cuda_graphs, runtime=args.runtime,
                        llamacpp=llamacpp)


def has_head(args: argparse.Namespace) -> bool:
    """Whether the draft the request names (--use-draft) has an acceptance head."""
    from specdec.builder import draft_configs
    from specdec.builder import has_head as draft_has_head
    from specdec.params import DEFAULT_DRAFT

    drafts = draft_configs(engine_config(args))
    name = getattr(args, "use_draft", None) or DEFAULT_DRAFT
    if name not in drafts:
        raise InvalidRequestError(f"unknown draft {name!r}; --also-draft names {', '.join(map(repr, drafts))}")
    return draft_has_head(drafts[name])


def prompt_texts(args: argparse.Namespace) -> list[str]:
    """The prompts on the command line, then those of --prompts (limited by --limit)."""
    prompts = list(args.prompt)
    if args.limit is not None and not args.prompts:
        raise InvalidRequestError("--limit takes the first N prompts of --prompts: give --prompts too")
    if args.prompts:
        from specdec.bench.prompt_sets import load_prompts

        prompts += load_prompts(args.prompts, args.limit)
    if not prompts:
        raise InvalidRequestError("no prompt: give one or more prompts, or --prompts FILE")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    """One prompt, one sample: the text streams as rounds commit. Several prompts (or samples) run
    at once, sharing every forward pass, and print when all are done."""
    from specdec.builder import build_engine, build_rules, check_runtime_settings, check_sources
    from specdec.metrics import aggregate_summary
    from specdec.policies import resolve_policy

    params = generation_params(args)
    texts = prompt_texts(args)
    resolve_policy(params.policy, has_head=has_head(args))  # its flags checked before minutes of model loading
    config = engine_config(args)
    check_sources(config)
    check_runtime_settings(config)
    rules = build_rules(config, progress=not args.json)  # the tokenizers and configs, no weights:
    prompts = [rules.encode_prompt(text, params.chat_template) for text in texts]
    for number, prompt_ids in enumerate(prompts, 1):  # each prompt and its policy checked before the models load
        try:
            rules.validate(prompt_ids, params)
        except InvalidRequestError as error:
            raise InvalidRequestError(f"prompt {number}: {error}" if len(prompts) > 1 else str(error)) from None
    engine = build_engine(config, progress=not args.json)

    if len(prompts) == 1 and params.n == 1 and not args.json:
        def stream(_index: int, _ids: list[int], text: str, _finish: str | None) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        result = engine.generate_ids(prompts[0], params, on_update=stream)
        sys.stdout.write("\n")
        print(result.stats.summary(), file=sys.stderr)
        print_costs(engine, args)
        return 0

    start = time.perf_counter()
    results = engine.generate_many(prompts, params)
    wall_s = time.perf_counter() - start
    if args.json:  # one object per prompt, one per line (JSON Lines)
        for result in results:
            print(json.dumps(result.to_dict()))
        print_costs(engine, args)
        return 0
    for p, result in enumerate(results):
        for s, completion in enumerate(result.completions):
            where = ([f"prompt {p + 1}"] if len(prompts) > 1 else []) + ([f"sample {s + 1}"] if params.n > 1 else [])
            sys.stdout.write(f"--- {', '.join(where)} ---\n{completion.text}\n")
        print(result.stats.summary() if len(prompts) == 1 else f"prompt {p + 1}: {result.stats.summary()}",
              file=sys.stderr)
    if len(prompts) > 1:
        print(aggregate_summary([r.stats for r in results], wall_s), file=sys.stderr)
    print_costs(engine, args)
    return 0


def print_costs(engine, args: argparse.Namespace) -> None:
    """--debug: the costs the default policy planned with (measured in this run unless given by hand)."""
    if not args.debug:
        return
    from specdec.cost_profile import describe_profile

    print(describe_profile(engine.cost_profile(), engine.drafting), file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    from specdec.builder import check_runtime_settings, check_sources
    from specdec.policies import PolicyConfig, resolve_policy
    from services.config import AppConfig, ReplicaConfig
    from services.launch import RAY_OPTIONS, serve_forever

    for flag, replicas in (("--draft-replicas", args.draft_replicas), ("--verifier-replicas", args.verifier_replicas)):
        if replicas < 1:
            raise InvalidRequestError(f"{flag} must be at least 1, got {replicas}")
    policy = PolicyConfig(**{k: v for k, v in
                             (("name", args.policy), ("k", args.k), ("threshold", args.threshold)) if v is not None})
    resolve_policy(policy, has_head=has_head(args))  # its flags checked before the replicas load
    engine = engine_config(args)
    check_sources(engine)  # a mistyped source fails here, not in the replicas after Ray started
    if not ray_address(args.address) and args.target_shards == 1:
        # The replicas run here, on the CPU: Ray gives them no GPU (services/app.py). What their
        # models would not read is refused, not ignored, as in process.
        if engine.device not in ("auto", "cpu"):
            raise InvalidRequestError(f"--device {engine.device}: specdec serve runs its models on the CPU "
                                      "(--target-shards N puts the target on N GPUs); to serve on a GPU, use a "
                                      "Serve config (cluster/serve/gpu.yaml)")
        check_runtime_settings(engine.model_copy(update={"device": "cpu"}))
    engine.batch = engine.batch.model_copy(update={"lanes": args.lanes})
    config = AppConfig(
        models=engine.model_copy(update={"threads": None}), policy=policy, model_name=args.model_name,
        target_shards=args.target_shards,
        draft=ReplicaConfig(num_replicas=args.draft_replicas, threads=args.threads),
        verifier=ReplicaConfig(num_replicas=args.verifier_replicas, threads=args.threads,
                               num_gpus=args.target_shards if args.target_shards > 1 else 0))
    return serve_forever(config, args.host, args.http_port, args.grpc_port,
                         lambda need: start_ray(args.address, need, "the replicas (--draft-replicas, "
                                                "--verifier-replicas, --target-shards) ask", RAY_OPTIONS))


def check_answers(address: str, timeout_s: float = 5.0) -> None:
    """A `host:port` (or `ray://host:port`) address where nothing accepts a connection is refused at
    once: Ray's own client retries the GCS for minutes before it gives up."""
    import socket

    if address.startswith(("http://", "https://")):  # $RAY_ADDRESS as Ray's job docs set it, for `ray job submit`
        raise SpecDecError(f"Ray at {address!r}: that is the dashboard's (Jobs) address; give the cluster's "
                           "host:6379 or ray://host:10001, or run the command with `ray job submit`")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # `auto`, `local` and malformed addresses: Ray's own answer is quick and says why
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError, OverflowError) as error:
        raise SpecDecError(f"Ray at {address!r}: nothing answers there ({one_line(error)})") from None


def ray_address(address: str | None) -> str | None:
    """The cluster a command joins: `address`, else $RAY_ADDRESS (which ray job submit sets); None:
    a private local instance."""
    return address or os.environ.get("RAY_ADDRESS")


def start_ray(address: str | None, need: dict[str, float], asking: str, options: dict,
              local: dict | None = None) -> bool:
    """Connect to `address` (else $RAY_ADDRESS, which ray job submit sets), else start a private
    local instance (`local`: its own ray.init options): never attach to some other Ray that happens
    to run on this machine (a bare `ray.init()` joins one `ray start` left). That instance has no
    autoscaler: what it could never place (`need`, {"CPU": n, "GPU": n}; `asking` names who asks,
    e.g. "scaling (4 workers) asks") is refused, where Ray would wait forever. Returns whether it joined a cluster."""
    import ray

    address = ray_address(address)
    if address:
        check_answers(address)
        try:
            ray.init(address=address, **options)
        except (ValueError, ConnectionError) as error:  # a malformed address; none answering there
            raise SpecDecError(f"Ray at {address!r}: {one_line(error)}") from None
        return True
    try:
        ray.init(address="local", **options, **(local or {}))
    except (RuntimeError, ConnectionError) as error:  # e.g. "The current node timed out during startup"
        raise SpecDecError(f"Ray did not start: {one_line(error)}") from None
    have = ray.cluster_resources()
    if any(need[kind] > have.get(kind, 0) + 1e-9 for kind in need):
        ray.shutdown()
        raise SpecDecError(f"{asking} {need['CPU']:g} CPUs and {need['GPU']:g} GPUs; this machine has "
                           f"{have.get('CPU', 0):g} and {have.get('GPU', 0):g}")
    return False


def start_training_ray(address: str | None, scaling: ScalingSection) -> None:
    """Ray for a training job (`start_ray`); its workers log to the driver. From here SIGTERM stops
    the job as Ctrl-C does (sigterm_as_ctrl_c)."""
    import ray

    if not ray.is_initialized():  # Ray starts workers at nice 15; here they are the job: not below everything else
        start_ray(address, {"CPU": scaling.num_workers * scaling.cpus_per_worker,
                            "GPU": scaling.num_workers * scaling.use_gpu},
                  f"scaling ({scaling.num_workers} workers) asks", {"log_to_driver": True},
                  local={"_system_config": {"worker_niceness": 0}})
        # after ray.init, whose handler exits the process mid-call (a crash dump, rc 134)
        signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)


def sigterm_as_ctrl_c(signum, frame) -> None:
    """SIGTERM (`kill`, `ray job stop`) does what Ctrl-C does at that moment: Ray Train's graceful
    abort inside fit() (its SIGINT handler then; training.checkpoints.fit), else KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    (handler if callable(handler) else signal.default_int_handler)(signum, frame)


def cmd_gen_data(args: argparse.Namespace) -> int:
    from specdec.models.sources import check_source
    from specdec.training.config import load_config
    from specdec.training.data import generate_dataset

    config = load_config(args.config)
    for role in ("draft", "target"):  # a mistyped source fails here, not after Ray started
        check_source(getattr(config.models, role), role)
    # Ray once data.dir is held: a second gen-data into it is refused before Ray starts, as train-head's run
    manifest = generate_dataset(config, reuse=args.reuse_responses,
                                connect=lambda: start_training_ray(args.address, config.scaling))
    counts = manifest["counts"]
    print(f"{config.data.dir}: {counts['sequences']} sequences, {counts['positions']} response tokens, "
          f"{counts['tokens']} labelled tokens "
          f"in {counts['shards']} shards ({'complete' if manifest['complete'] else 'incomplete'})", file=sys.stderr)
    return 0


def cmd_train_head(args: argparse.Namespace) -> int:
    from specdec.training.config import load_config
    from specdec.training.train import sweep_heads, train_head

    config = load_config(args.config)
    train = config.require_train()

    def connect() -> None:  # once the job's checks passed (a foreign, empty or corrupt dataset, other settings)
        start_training_ray(args.address, config.scaling)

    if args.sweep:
        summary = sweep_heads(config, connect)
        best = summary["best"]
        print(f"best of {len(summary['runs'])} runs by validation {summary['select_by']}: D={best['depth']} "
              f"w_rej={best['w_rej']:g}; head saved to {train.output}", file=sys.stderr)
        return 0
    final = train_head(config, connect)["epochs"][-1]
    print(f"head saved to {train.output}: epoch {final['epoch']}, validation AUROC {final['val_auroc']:.3f}, "
          f"ECE {final['val_ece']:.3f}, KL {final['val_kl']:.4f}", file=sys.stderr)
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specdec.training.config import load_config
    from specdec.training.draft import train_draft

    config = load_config(args.config)
    # a foreign, empty or corrupt dataset, a missing target or init, a run name's other settings: before Ray starts
    report = train_draft(config, lambda: start_training_ray(args.address, config.scaling))
    final = report["final"]
    accepted = ", ".join(f"{k.removeprefix('val_acc_')} {v:.3f}" for k, v in final.items() if k.startswith("val_acc_"))
    print(f"feature draft saved to {config.draft.output}: {report['parameters']:,} parameters, "
          f"{report['vocabulary']['ids']} output ids; validation greedy acceptance: {accepted}", file=sys.stderr)
    return 0


# what a training command prints when Ctrl-C or SIGTERM stopped it (`interrupted`, read by main)
RESUME_TRAINING = "interrupted: run the same command again to resume from the last checkpoint (docs/resuming.md)"


def add_training_parsers(commands) -> None:
    gen = commands.add_parser("gen-data", help="generate training data on Ray (resumable): the acceptance head's "
                                               "labels or the feature draft's target states (data.kind)")
    gen.add_argument("--config", required=True, help="pipeline YAML (see cluster/training/)")
    gen.add_argument("--address", default=None, help="Ray address (default $RAY_ADDRESS, else a new local instance)")
    gen.add_argument("--reuse-responses", default=None, metavar="DIR",
                     help="label the responses of an older dataset (same target and response settings) again "
                          "instead of regenerating them")
    gen.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    gen.set_defaults(func=cmd_gen_data, interrupted="interrupted: the shards written are kept; run the same command "
                                                    "again to generate the rest (docs/resuming.md)")

    train = commands.add_parser("train-head", help="train the acceptance head with Ray Train (resumable)")
    train.add_argument("--config", required=True, help="pipeline YAML (see cluster/training/)")
    train.add_argument("--sweep", action="store_true", help="train every (depth, w_rej) of the sweep section "
                                                            "and keep the best on validation")
    train.add_argument("--address", default=None, help="Ray address (default $RAY_ADDRESS, else a new local instance)")
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    train.set_defaults(func=cmd_train_head, interrupted=RESUME_TRAINING)

    draft = commands.add_parser("train-draft", help="train the feature draft with Ray Train (resumable)")
    draft.add_argument("--config", required=True, help="pipeline YAML with data.kind features and a draft section")
    draft.add_argument("--address", default=None, help="Ray address (default $RAY_ADDRESS, else a new local instance)")
    draft.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    draft.set_defaults(func=cmd_train_draft, interrupted=RESUME_TRAINING)


def cmd_bench(args: argparse.Namespace) -> int:
    from specdec.bench.runner import BenchConfig, run_bench
    from specdec.bench.specs import parse_specs

    parse_specs([*args.policies, *args.chosen])  # a bad spec fails before minutes of model loading
    config = BenchConfig(engine=engine_config(args), policies=args.policies, temperatures=args.temperatures,
                         prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                         seed=args.seed, out=args.out, forward_ks=args.forward_ks,
                         forward_repeats=args.forward_repeats, chosen=args.chosen, concurrency=args.concurrency)
    results = run_bench(config, progress=not args.no_progress, report_only=args.report_only)
    print((args.out / "summary.md").read_text())
    lossless = results["lossless"]
    if lossless["ours_lossless"] is False:
        print(f"error: greedy outputs differ from target-only's, not at a near-tie: {lossless['defects']}",
              file=sys.stderr)
        return 1
    if lossless["ours_equal"] is False:
        print(f"note: greedy outputs differ from target-only's only after a near-tie of the target's top two "
              f"{lossless['near_ties']}: the target scores a token slightly differently in a pass of another "
              "size (docs/benchmarks.md, lossless check)", file=sys.stderr)
    return 0


def add_bench_parser(commands) -> None:
    from pathlib import Path

    from specdec.bench.specs import DEFAULT_POLICIES

    bench = commands.add_parser("bench", help="every policy, the oracle and the peers on HumanEval (resumable)")
    add_model_flags(bench)
    group = bench.add_argument_group("benchmark")
    group.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), metavar="SPEC",
                       help="policy specs: target-only, fixed:K, specdec++:H, specdec++cost, svip:T, confidence:T, "
                            "heuristic[:K], oracle; the peers hf-heuristic[:K], hf-dynamic[:T] (--runtime torch) and "
                            "llamacpp-lookup[:N] (llama.cpp); SPEC@NAME runs on --also-draft NAME (default: the issue's "
                            "full sweep)")
    group.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    group.add_argument("--prompts", default="humaneval",
                       help="humaneval (default), validation (stdlib validation split, for choosing thresholds), "
                            "prose (natural-language test set), prose-validation (prose validation split), "
                            "editing (code edits and conversations that repeat their input) or a .jsonl/.txt file")
    group.add_argument("--limit", type=int, default=None, help="first N prompts only")
    group.add_argument("--concurrency", type=int, default=1,
                       help="prompts of one policy decoded at once, sharing the batch (default 1: one at a time)")
    group.add_argument("--max-new-tokens", type=int, default=128)
    group.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    group.add_argument("--out", type=Path, default=Path("bench-results"),
                       help="output directory; a rerun with the same directory resumes")
    group.add_argument("--chosen", nargs="+", default=[], metavar="SPEC",
                       help="operating points chosen on validation prompts, e.g. specdec++:0.5 (the goals use "
                            "them; default: the head's recorded h)")
    group.add_argument("--forward-ks", nargs="*", type=int, default=[1, 2, 4, 8, 16],
                       help="k for the forward-time curves (none: skip them)")
    group.add_argument("--forward-repeats", type=int, default=5)
    group.add_argument("--report-only", action="store_true", help="rewrite the outputs from the records, run nothing")
    group.add_argument("--no-progress", action="store_true")
    bench.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="SpecDec++ speculative decoding")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one or more prompts, in this process")
    generate.add_argument("prompt", nargs="*", help="one or more prompts (they share every forward pass)")
    generate.add_argument("--prompts", default=None, metavar="SOURCE",
                          help="more prompts: a .txt file (one per line), a .jsonl file, humaneval, validation, "
                               "prose, prose-validation or editing")
    generate.add_argument("--limit", type=int, default=None, help="first N prompts of --prompts only")
    add_model_flags(generate)
    add_generation_flags(generate)
    generate.add_argument("--json", action="store_true",
                          help="print one JSON object with completions and stats per prompt, one per line")
    generate.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show tracebacks and the measured costs the default policy planned with")
    generate.set_defaults(func=cmd_generate)

    serve = commands.add_parser("serve", help="serve the models with Ray Serve over gRPC and HTTP")
    add_model_flags(serve)
    group = serve.add_argument_group("serving")
    from specdec.policies import POLICY_NAMES

    group.add_argument("--policy", default=None, help=f"default stopping policy: {', '.join(POLICY_NAMES)}")
    group.add_argument("--k", type=int, default=None, help="default k (see specdec generate --help)")
    group.add_argument("--threshold", type=float, default=None, help="default threshold (see specdec generate --help)")
    group.add_argument("--host", default="127.0.0.1",
                       help="address the HTTP proxy listens on (0.0.0.0 for all); Serve's gRPC proxy listens on "
                            "every interface whatever this says (docs/reliability.md, \"Access\")")
    group.add_argument("--http-port", type=int, default=8000)
    group.add_argument("--grpc-port", type=int, default=9000)
    group.add_argument("--model-name", default="specdec", help="the model id the OpenAI routes answer to")
    group.add_argument("--address", default=None,
                       help="Ray cluster to serve on (default $RAY_ADDRESS, else a new local instance)")
    group.add_argument("--draft-replicas", type=int, default=1)
    group.add_argument("--verifier-replicas", type=int, default=1)
    group.add_argument("--target-shards", type=int, default=1,
                       help="GPUs per verifier replica, the target split over them (1: every replica on the CPU)")
    group.add_argument("--lanes", type=int, default=1, choices=range(1, 9), metavar="N",
                       help="batches in flight: 2 lets the draft work on one while the verifier checks the other "
                            "(pays where they run on different devices; docs/benchmarks.md)")
    serve.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    serve.set_defaults(func=cmd_serve)

    add_training_parsers(commands)
    add_bench_parser(commands)

    from clients.cli import add_client_parser

    add_client_parser(commands, add_generation_flags)
    return parser


class OneLineFormatter(logging.Formatter):
    """A log record as its message alone: the error it logs is printed once, in one line, where
    the command ends (--debug keeps tracebacks)."""

    def formatException(self, exc_info) -> str:
        return ""

    def formatStack(self, stack_info) -> str:
        return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.debug and not logging.getLogger().handlers:  # (Python's last-resort handler prints tracebacks)
        handler = logging.StreamHandler()
        handler.setFormatter(OneLineFormatter("%(levelname)s: %(message)s"))
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C, and SIGTERM where a command routes it so (start_training_ray)
        if hint := getattr(args, "interrupted", None):  # how to go on, where a rerun resumes
            print(hint, file=sys.stderr)
        return 130
    except Exception as exc:
        if (message := user_error(exc)) is None or args.debug:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE


def user_error(exc: Exception) -> str | None:
    """The one line a user's error prints: ours, or a flag's value that a config model refused
    (pydantic's first error); None for anything else (a bug: its traceback shows)."""
    if isinstance(exc, SpecDecError):
        return str(exc)
    from pydantic import ValidationError

    from specdec.errors import validation_message

    return validation_message(exc) if isinstance(exc, ValidationError) else None


if __name__ == "__main__":
    sys.exit(main())
