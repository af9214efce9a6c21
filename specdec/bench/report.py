"""From records to results: per-policy totals, the lossless check, the cost-model fit, frontiers,
the issue's goals, and the files a run leaves (results.json, summary.md, PNG plots).

Totals are taken over the prompts every measured policy finished at that temperature (all of them
once a run is complete), so tokens/s compare like with like; tokens/s is total tokens over total
wall time, prefill included.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from specdec.bench.costmodel import CostFit, fit_cost_model, fit_round_costs, fit_standalone, speedup_share
from specdec.bench.frontier import frontier_dominance, pareto_frontier
from specdec.bench.records import RecordStore, divergence_key, record_key, stats_from_dict, temperature_key
from specdec.bench.specs import BASELINE, SWEPT_FAMILIES, PolicySpec, parse_spec
from specdec.metrics import RequestStats

RESULTS_FILE, SUMMARY_FILE = "results.json", "summary.md"
NOT_SPECULATIVE = (BASELINE,)  # families left out of the cost-model fit (no draft passes)

# Issue 19's goals, at every temperature (the oracle one greedy, the frontier one sampled): the
# default SpecDec++ against the best fixed K and the best training-free rule, each in hindsight.
GOAL_FIXED, GOAL_RULES, GOAL_ORACLE_SHARE = 1.10, 1.05, 0.85
TRAINING_FREE_RULES = ("svip", "confidence")
# A record whose process got less than its neighbours' median CPU share over this factor was timed
# while something else had the CPU: a generation slowed 1.3x by another process gets 1 / 1.3 of it.
CONTENDED_SLOWDOWN = 1.25
MIN_TIMED_S = 1.0  # a shorter generation's CPU share is noise (a tiny model's, a one-token one's)


def build_results(store: RecordStore, specs: list[PolicySpec], config, prompt_count: int, notes: dict) -> dict:
    temperatures = [float(t) for t in config.temperatures]
    results = {
        "settings": config.settings(), "head": notes.get("head"), "machine": notes.get("machine"),
        "date": notes.get("date") or time.strftime("%Y-%m-%d"),
        "prompts": {"source": config.prompts, "count": prompt_count,
                    "skipped": notes.get("skipped_prompts", {})},
        "policies": [s.key for s in specs], "temperatures": temperatures,
        "skipped_specs": {k: v for k, v in notes.get("skipped_specs", {}).items()
                          if k.split("@")[0] in {s.key for s in specs}},
        "chosen": notes.get("chosen", {}), "forward_times": notes.get("forward_times"),
        "live_profile": notes.get("live_profile"),
        "by_temperature": {}, "records": [],
    }
    for temperature in temperatures:
        records = {s.key: [store.get(record_key(s.key, temperature, i)) for i in range(prompt_count)] for s in specs}
        records = {k: [r for r in rs if r is not None] for k, rs in records.items()}
        results["records"].extend(r for rs in records.values() for r in rs)
        results["by_temperature"][temperature_key(temperature)] = summarize_temperature(
            specs, records, temperature, notes.get("divergences", {}))
    results["cpus"] = dict(Counter(r.get("cpu", "?") for r in results["records"]))
    results["contended"] = contended_records(results["records"], (results["machine"] or {}).get("threads"))
    profile = fit_round_costs(results["records"], source=f"specdec bench in-loop fit, {results['date']}")
    results["cost_profile"] = profile.model_dump() if profile else None
    results["lossless"] = lossless_summary(results)
    results["goals"] = evaluate_goals(results)
    return results


def contended_records(records: list[dict], threads: int | None) -> list[str]:
    """Records timed while another process held the CPU: the process's CPU time over its threads'
    wall time (its CPU share) fell under the median share of the records beside it by more than
    CONTENDED_SLOWDOWN. A process alone keeps its share whatever it decodes (torch's threads spin
    while they wait, llama.cpp's at barriers); another busy process takes its part of the cores and
    stretches the wall time. The runner reruns such records once (`BenchRun`); a report names those
    still contended (delete their lines from records.jsonl and resume)."""
    if not threads:
        return []
    shares = {i: r["process_cpu_s"] / (r["stats"]["wall_time_s"] * threads) for i, r in enumerate(records)
              if "process_cpu_s" in r and r["stats"]["wall_time_s"] >= MIN_TIMED_S}
    if not shares:
        return []
    usual = statistics.median(shares.values())
    return [f"{records[i]['spec']}@{records[i]['temperature']:g}#{records[i]['prompt']}" for i, share in shares.items()
            if share * CONTENDED_SLOWDOWN < usual]


def lossless_summary(results: dict) -> dict:
    """Greedy only: which policies' tokens differ from target-only's, and whether each difference is
    a near-tie of the target's top two at the first differing token (runner.first_divergence): the
    target scores a token slightly differently in a pass of another size (llama.cpp's kernels; the
    HF peer's groupings), which can flip a near-tie and nothing else. Ours must show no other
    difference (`ours_lossless`)."""
    greedy = results["by_temperature"].get(temperature_key(0.0), {}).get("policies", {})
    checks = {k: p["lossless"] for k, p in greedy.items() if "lossless" in p and k != BASELINE}
    mismatched = {k: c["mismatched_prompts"] for k, c in checks.items() if not c["equal"]}
    near_ties = {k: c["near_tie_prompts"] for k, c in checks.items() if c["near_tie_prompts"]}
    defects = {k: [p for p in c["mismatched_prompts"] if p not in c["near_tie_prompts"]] for k, c in checks.items()}
    defects = {k: v for k, v in defects.items() if v}
    ours = {k for k in checks if not parse_spec(k).is_peer}
    return {"checked": sorted(checks), "mismatched": mismatched, "near_ties": near_ties, "defects": defects,
            "ours_equal": not (ours & set(mismatched)) if checks else None,
            "ours_lossless": not (ours & set(defects)) if checks else None}


def common_prompts(records: dict[str, list[dict]]) -> list[int]:
    measured = [{r["prompt"] for r in rs} for rs in records.values() if rs]
    return sorted(set.intersection(*measured)) if measured else []


def summarize_temperature(specs: list[PolicySpec], records: dict[str, list[dict]], temperature: float,
                          divergences: dict | None = None) -> dict:
    prompts = common_prompts(records)
    common = set(prompts)
    kept = {k: [r for r in rs if r["prompt"] in common] for k, rs in records.items()}
    totals: dict[str, RequestStats] = {}
    for spec in specs:
        if kept[spec.key]:
            total = RequestStats()
            for record in kept[spec.key]:
                total.merge(stats_from_dict(record["stats"]))
            totals[spec.key] = total
    ours = [r for s in specs if not s.is_peer and s.family not in NOT_SPECULATIVE for r in kept[s.key]]
    fit = fit_cost_model([r["stats"]["draft_forward_passes"] for r in ours],
                         [r["stats"]["target_forward_passes"] for r in ours], [r["stats"]["wall_time_s"] for r in ours])
    baseline_records = kept.get(BASELINE, [])
    standalone = fit_standalone([r["stats"]["target_forward_passes"] for r in baseline_records],
                                [r["stats"]["wall_time_s"] for r in baseline_records])
    base = totals.get(BASELINE)
    base_aggregate = aggregate_tokens_per_s(records.get(BASELINE, []))
    lossless = lossless_check(kept, divergences or {}) if temperature == 0 else {}
    policies = {}
    for spec in specs:
        total = totals.get(spec.key)
        if total is None:
            continue
        predicted = fit.throughput(total.verification_rate, total.discard_rate) if fit else None
        aggregate = aggregate_tokens_per_s(records[spec.key])
        row = {"family": spec.family, "value": spec.value, "prompts": len(kept[spec.key]), **total.to_dict(),
               "aggregate_tokens_per_s": aggregate,
               "aggregate_speedup": aggregate / base_aggregate if aggregate and base_aggregate else None,
               "speedup": total.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else None,
               "predicted_tokens_per_s": predicted,
               "predicted_speedup": predicted_speedup(fit, predicted, base, total)}
        if spec.key in lossless:
            row["lossless"] = lossless[spec.key]
        policies[spec.key] = row
    families = {}
    for family in SWEPT_FAMILIES:
        points = [(p["verification_rate"], p["discard_rate"]) for p in policies.values() if p["family"] == family]
        if points:
            families[family] = {"points": points, "frontier": pareto_frontier(points)}
    dominance = {}
    for family in families:
        if family != "fixed" and "fixed" in families:
            dominance[f"{family} over fixed"] = frontier_dominance(families[family]["points"],
                                                                   families["fixed"]["points"]).to_dict()
    return {"temperature": temperature, "prompts": prompts, "policies": policies,
            "cost_model": fit.to_dict() if fit else None,
            "standalone_target": standalone.to_dict() if standalone else None,
            "frontiers": families, "dominance": dominance}


def aggregate_tokens_per_s(records: list[dict]) -> float | None:
    """Tokens over the wall time of the groups they were decoded in (a run with --concurrency > 1),
    over every prompt of the policy (a group's wall time covers all of its prompts); None for one
    prompt at a time (then tokens/s is the aggregate). Over target-only's, decoded in groups of the
    same size, it is the policy's speedup at that load (`aggregate_speedup`)."""
    grouped = [r for r in records if "group_wall_s" in r]
    if not grouped:
        return None
    walls = {r["group"]: r["group_wall_s"] for r in grouped}
    return sum(r["stats"]["generated_tokens"] for r in grouped) / sum(walls.values())


def lossless_check(records: dict[str, list[dict]], divergences: dict[str, dict]) -> dict[str, dict]:
    """Greedy: every policy's tokens against target-only's, prompt by prompt; a differing prompt is a
    near-tie when its first divergence (`divergences`, runner.first_divergence) says so, with the
    target's logit gap there."""
    reference = {r["prompt"]: r["token_ids"] for r in records.get(BASELINE, [])}
    if not reference:
        return {}
    checks = {}
    for key, recs in records.items():
        compared = [r for r in recs if r["prompt"] in reference]
        mismatched = [r["prompt"] for r in compared if r["token_ids"] != reference[r["prompt"]]]
        found = [divergences.get(divergence_key(key, prompt), {}) for prompt in mismatched]
        near = [(prompt, d["gap"]) for prompt, d in zip(mismatched, found) if d.get("near_tie")]
        checks[key] = {"compared": len(compared), "mismatched_prompts": mismatched, "equal": not mismatched,
                       "near_tie_prompts": [prompt for prompt, _ in near], "near_tie_gaps": [gap for _, gap in near]}
    return checks


# ----------------------------------------------------------------------------------------------
# Goals


def _best(policies: dict, family: str) -> tuple[str, dict] | None:
    rows = [(k, p) for k, p in policies.items() if p["family"] == family]
    return max(rows, key=lambda kp: kp[1]["tokens_per_s"]) if rows else None


def _specdec_pp_point(policies: dict, chosen: dict) -> tuple[str, dict, str] | None:
    """The default SpecDec++: the point chosen on validation prompts when there is one (`--chosen`,
    `specdec++:H` or `specdec++cost`, else the h the head records), else the sweep's best
    (optimistic: that h was picked on this very prompt set)."""
    pick = chosen.get("specdec++")
    if pick and pick["spec"] in policies:
        return pick["spec"], policies[pick["spec"]], pick["source"]
    best = _best(policies, "specdec++")
    if best is None:
        return None
    return best[0], best[1], "best h of the sweep on these prompts (not chosen on validation: optimistic)"


def _best_of(policies: dict, families: tuple[str, ...]) -> tuple[str, float] | None:
    """(spec, tok/s) of the fastest point of any of `families`: the baselines at their best in hindsight."""
    rows = [best for family in families if (best := _best(policies, family)) is not None]
    if not rows:
        return None
    key, row = max(rows, key=lambda kp: kp[1]["tokens_per_s"])
    return key, row["tokens_per_s"]


def _ratio_goal(name: str, target: float, ours, theirs, theirs_label: str) -> dict:
    row = {"goal": name, "target": target, "measured": None, "met": None, "detail": ""}
    if ours is None:
        row["detail"] = "not measured: no specdec++ records (no acceptance head?)"
        return row
    if theirs is None:
        row["detail"] = f"not measured: no {theirs_label} records"
        return row
    (our_key, our_row, how), (their_key, their_tps) = ours, theirs
    measured = our_row["tokens_per_s"] / their_tps if their_tps else None
    row.update(measured=measured, met=measured is not None and measured >= target,
               detail=f"{our_key} ({how}) {our_row['tokens_per_s']:.2f} tok/s vs {their_key} {their_tps:.2f} tok/s")
    if measured is not None and measured < target:
        row["detail"] += f"; short by {(target - measured) / target:.1%}"
    return row


def predicted_speedup(fit: CostFit | None, predicted_tps: float | None, base, total) -> float | None:
    """Predicted tok/s over target-only's measured tok/s, the same baseline as the measured speedup.
    The paper's t_target / latency assumes a target-only step costs t_target; on CPU the fitted
    t_target (a verification pass over K+1 tokens) is dearer than a one-token step, which would
    inflate every predicted speedup alike (by about 1.2x on the default pair)."""
    if fit is None or predicted_tps is None:
        return None
    if base is not None and base.tokens_per_s:
        return predicted_tps / base.tokens_per_s
    return fit.speedup(total.verification_rate, total.discard_rate)


def evaluate_goals(results: dict) -> list[dict]:
    """Issue 19's goals, per temperature: the default SpecDec++ against the best fixed K and the best
    training-free rule (svip, confidence), each at its best point on these prompts; greedy: its
    share of the oracle's measured speedup; temperature 1: its frontier over fixed K's."""
    goals = []
    for key, summary in results["by_temperature"].items():
        policies, when = summary["policies"], "greedy" if float(key) == 0.0 else f"T={key}"
        ours = _specdec_pp_point(policies, results["chosen"])
        goals.append(_ratio_goal(f"specdec++ tok/s >= {GOAL_FIXED:.2f}x the best fixed K ({when})", GOAL_FIXED, ours,
                                 _best_of(policies, ("fixed",)), "fixed"))
        goals.append(_ratio_goal(f"specdec++ tok/s >= {GOAL_RULES:.2f}x the best svip or confidence ({when})",
                                 GOAL_RULES, ours, _best_of(policies, TRAINING_FREE_RULES), "svip or confidence"))
        if float(key) == 0.0:
            goals.append(_oracle_goal(policies, ours, summary["cost_model"]))
        else:
            goals.append(_frontier_goal(summary, when))
    return goals


def _oracle_goal(policies: dict, ours, cost_model: dict | None) -> dict:
    row = {"goal": f"specdec++ speedup over target-only >= {GOAL_ORACLE_SHARE:.0%} of the oracle's (greedy, "
                   "both measured)", "target": GOAL_ORACLE_SHARE, "measured": None, "met": None, "detail": ""}
    oracle = policies.get("oracle")
    needed = (("specdec++", ours), ("oracle", oracle), (BASELINE, policies.get(BASELINE)))
    missing = [what for what, value in needed if value is None]
    if missing:
        row["detail"] = f"not measured: no {', '.join(missing)} records"
        return row
    key, mine, how = ours
    share = speedup_share(mine["speedup"], oracle["speedup"])
    row.update(measured=share, met=share >= GOAL_ORACLE_SHARE,
               detail=f"{key} ({how}) {mine['speedup']:.2f}x vs the oracle's {oracle['speedup']:.2f}x")
    if cost_model is not None and oracle.get("predicted_speedup") and mine.get("predicted_speedup"):
        row["detail"] += (f" (cost model: {mine['predicted_speedup']:.2f}x vs {oracle['predicted_speedup']:.2f}x, "
                          f"{speedup_share(mine['predicted_speedup'], oracle['predicted_speedup']):.0%})")
    if share < GOAL_ORACLE_SHARE:
        row["detail"] += f"; short by {(GOAL_ORACLE_SHARE - share) / GOAL_ORACLE_SHARE:.1%}"
    return row


def _frontier_goal(sampled: dict, when: str) -> dict:
    row = {"goal": f"specdec++ frontier dominates fixed's in the verification/discard plane ({when})",
           "target": 1.0, "measured": None, "met": None, "detail": ""}
    dominance = sampled["dominance"].get("specdec++ over fixed")
    if dominance is None:
        row["detail"] = "not measured: needs specdec++ and fixed records at temperature 1"
        return row
    row.update(measured=dominance["dominated"] / dominance["total"], met=dominance["dominates"],
               detail=f"{dominance['dominated']} of fixed's {dominance['total']} frontier points on or above "
                      f"specdec++'s frontier ({dominance['uncovered']} at a verification rate specdec++ does not "
                      "reach)")
    return row


# ----------------------------------------------------------------------------------------------
# Files


def write_outputs(results: dict, out: Path) -> dict[str, Path]:
    """results.json, summary.md and the PNG plots; returns {what: path}."""
    from specdec.bench import plots

    out.mkdir(parents=True, exist_ok=True)
    files = {"results": out / RESULTS_FILE, "summary": out / SUMMARY_FILE}
    files.update(plots.write_plots(results, out))
    results["files"] = {k: p.name for k, p in files.items()}
    files["results"].write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    files["summary"].write_text(markdown(results))
    return files


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _mixed_machines(cpus: dict) -> list[str]:
    """A run resumed on another machine: its records say which CPU ran them (the run order is
    prompt by prompt, so each prompt's policies mostly share one)."""
    if len(cpus) < 2:
        return []
    return ["Records from more than one machine (a resumed run): "
            + ", ".join(f"{n} on {cpu}" for cpu, n in sorted(cpus.items(), key=lambda kv: -kv[1])) + "."]


def markdown(results: dict) -> str:
    settings, prompts = results["settings"], results["prompts"]
    machine = results.get("machine") or {}
    lines = [
        f"# specdec bench ({results['date']})", "",
        f"{prompts['count']} prompts from `{prompts['source']}`, {settings['max_new_tokens']} new tokens, "
        f"draft `{settings['draft']}` ({settings['draft_format']}"
        + (f", vocabulary {settings['draft_vocab']}" if settings.get("draft_vocab", "full") != "full" else "")
        + f"), target `{settings['target']}` "
        f"({settings['target_format']}), head `{results['head']}`, seed {settings['seed']}.",
        f"Machine: {machine.get('cpu', '?')}, {machine.get('threads', '?')} threads, "
        f"torch {machine.get('torch', '?')}, transformers {machine.get('transformers', '?')}"
        + (f", GPU {machine['gpu']}" if machine.get("gpu") else "") + ".",
        *_mixed_machines(results.get("cpus") or {}),
        *([f"**Timed while the CPU was shared** (the process got under 1/{CONTENDED_SLOWDOWN:g} of its neighbours' median CPU "
           f"share; delete their lines from records.jsonl and resume): {', '.join(results['contended'])}."]
          if results.get("contended") else []),
        "",
        "Tokens/s: total tokens over total wall time (prefill included) on the prompts every policy finished. "
        "Predicted: eq. 2.3 with the fitted (t_draft, t_target). `hf-*`: HF transformers assisted generation "
        "on the same loaded models."
        + (f" Concurrency {settings['concurrency']}: that many prompts of a policy at once; tokens/s is per "
           "request (its own wall time), aggregate tok/s is tokens over the groups' wall time, and `vs "
           "target-only` divides it by target-only's, decoded in groups of the same size (the speedup at that load)."
           if settings.get("concurrency", 1) > 1 else ""), "",
    ]
    for key, summary in results["by_temperature"].items():
        lines += _temperature_section(key, summary)
    lossless = results["lossless"]
    if lossless["checked"]:
        if not lossless["mismatched"]:
            lines += [f"Greedy outputs equal target-only's, prompt by prompt, for every policy checked "
                      f"({len(lossless['checked'])}).", ""]
        if lossless["near_ties"]:
            lines += [f"Greedy outputs that differ from target-only's only after a near-tie of the target's top two "
                      f"(policy: prompts): {lossless['near_ties']}: the target scored that token in a pass of "
                      "another size, whose rounding can flip a near-tie (docs/benchmarks.md, lossless check).", ""]
        if lossless["defects"]:
            lines += [f"Greedy outputs that differ from target-only's **not** at a near-tie (policy: prompts): "
                      f"{lossless['defects']}.", ""]
    lines += ["## Goals", "", "| goal | target | measured | met | detail |", "|---|---|---|---|---|"]
    for goal in results["goals"]:
        met = {True: "yes", False: "**no**", None: "-"}[goal["met"]]
        lines.append(f"| {goal['goal']} | {goal['target']:g} | {_fmt(goal['measured'], '.3f')} | {met} "
                     f"| {goal['detail']} |")
    lines.append("")
    forward = results.get("forward_times")
    if forward:
        ks = forward["ks"]
        lines += ["## Forward time per pass (median ms, warm cache, k tokens fed)", "",
                  "| model | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
        for role in ("draft", "target"):
            lines.append(f"| {role} | " + " | ".join(f"{forward[f'{role}_s'][str(k)] * 1000:.1f}" for k in ks) + " |")
        lines.append("")
    profile = results.get("cost_profile")
    if profile:
        (one, a), (last, b) = sorted((int(k), v) for k, v in profile["t_target_ms"].items())
        lines += [f"Costs in the loop (`cost_profile`, fitted on every speculative generation): t_draft = "
                  f"{profile['t_draft_ms']:.1f} ms a drafting step; a verification pass over k candidates "
                  f"{a:.0f} + {(b - a) / (last - one):.1f} k ms.", ""]
    live = results.get("live_profile")
    if live:
        draft = live["t_draft_rows_ms"] or {"1": live["t_draft_ms"]}
        lines += ["## Live cost profile (what the verification budget planned with at the end of the run)", "",
                  f"{live['source']}; drafting {'pays' if live.get('drafting', True) else 'does not pay: the draft was off'}"
                  " (specdec/budget.py). `SPECDEC_COST_PROFILE=<this results.json>` makes the budgeted policies "
                  "plan with these curves.", "", "| pass | " + " | ".join(f"{k}" for k in draft) + " |",
                  "|---" * (len(draft) + 1) + "|",
                  "| drafting step, ms by sessions | " + " | ".join(f"{v:.1f}" for v in draft.values()) + " |", "",
                  "| pass | " + " | ".join(f"{k}" for k in live["t_target_ms"]) + " |",
                  "|---" * (len(live["t_target_ms"]) + 1) + "|",
                  "| target pass, ms by tokens | " + " | ".join(f"{v:.1f}" for v in live["t_target_ms"].values()) + " |",
                  ""]
    skipped = results["skipped_specs"]
    if skipped or prompts["skipped"]:
        lines += ["## Skipped", ""]
        lines += [f"- `{spec}`: {reason}" for spec, reason in skipped.items()]
        lines += [f"- prompt {index}: {reason}" for index, reason in prompts["skipped"].items()]
        lines.append("")
    files = results.get("files", {})
    if files:
        lines += ["Files: " + ", ".join(f"`{name}`" for name in files.values()), ""]
    return "\n".join(lines)


def _lossless_cell(check: dict | None) -> str:
    """yes; near-tie (n/N, largest gap); **no** (the prompts that differ otherwise / N)."""
    if check is None:
        return "-"
    if check["equal"]:
        return "yes"
    near, compared = check["near_tie_prompts"], check["compared"]
    other = len(check["mismatched_prompts"]) - len(near)
    near_text = (f"near-tie ({len(near)}/{compared}, gap <= {max(abs(g) for g in check['near_tie_gaps']):.2f})"
                 if near else "")
    return ", ".join(x for x in [f"**no** ({other}/{compared})" if other else "", near_text] if x)


def _temperature_section(key: str, summary: dict) -> list[str]:
    title = "greedy" if float(key) == 0 else f"temperature {key}"
    grouped = any(p.get("aggregate_tokens_per_s") for p in summary["policies"].values())  # --concurrency > 1
    columns = ["policy", "tokens", "tok/s", "speedup", *(["aggregate tok/s", "vs target-only"] if grouped else []),
               "predicted tok/s", "verification rate", "discard rate", "acceptance", "mean accepted length",
               *(["lossless"] if float(key) == 0 else [])]
    lines = [f"## {title.capitalize()} ({len(summary['prompts'])} prompts)", "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for spec, p in summary["policies"].items():
        row = (f"| {spec} | {p['generated_tokens']} | {p['tokens_per_s']:.2f} | {_fmt(p['speedup'], '.2f', 'x')} | "
               + (f"{_fmt(p.get('aggregate_tokens_per_s'))} | {_fmt(p.get('aggregate_speedup'), '.2f', 'x')} | "
                  if grouped else "")
               + f"{_fmt(p['predicted_tokens_per_s'])} | {p['verification_rate']:.3f} | {p['discard_rate']:.3f} | "
               f"{p['acceptance_rate']:.1%} | {p['mean_accepted_length']:.2f} |")
        if float(key) == 0:
            row += f" {_lossless_cell(p.get('lossless'))} |"
        lines.append(row)
    lines.append("")
    fit, standalone = summary["cost_model"], summary["standalone_target"]
    if fit:
        lines.append(f"Cost model (eq. 2.1 over {fit['points']} speculative generations): t_draft = "
                     f"{fit['t_draft'] * 1000:.2f} ms, t_target = {fit['t_target'] * 1000:.2f} ms, "
                     f"R² = {fit['r2']:.3f}.")
    if standalone:
        lines.append(f"Target-only alone: t_target = {standalone['t_target'] * 1000:.2f} ms per pass "
                     f"(R² = {standalone['r2']:.3f}).")
    for name, d in summary["dominance"].items():
        lines.append(f"Frontier {name}: {d['dominated']}/{d['total']} of fixed's frontier points dominated"
                     f" ({d['uncovered']} out of reach).")
    lines.append("")
    return lines
