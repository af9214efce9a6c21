"""PNG plots of a bench run (matplotlib's object API: no pyplot, no global backend state).

- plane-t{T}.png: every policy in the (verification rate, discard rate) plane, each swept family's
  Pareto frontier drawn through its points (the paper's Figure 4); lower-left is better.
- tokens-per-s.png: tokens/s per policy, one panel per temperature.
- cost-model.png: each generation's measured wall time against eq. 2.1's prediction.
- forward-times.png: t_draft(k) and t_target(k).
- live-profile.png: the live cost profile the budget planned with (specdec/cost_profile.py), against
  the bare passes of forward-times when measured.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from specdec.bench.costmodel import CostFit

FAMILY_COLORS = {"fixed": "tab:blue", "specdec++": "tab:red", "svip": "tab:green", "confidence": "tab:purple",
                 "heuristic": "tab:orange", "oracle": "black", "hf": "tab:brown", "target-only": "tab:gray"}
FAMILY_MARKERS = {"fixed": "o", "specdec++": "*", "svip": "s", "confidence": "D", "heuristic": "^", "oracle": "X",
                  "hf": "v", "target-only": "P"}
DPI = 120


def write_plots(results: dict, out: Path) -> dict[str, Path]:
    files = {}
    for key, summary in results["by_temperature"].items():
        if summary["policies"]:
            files[f"plane-t{key}"] = plot_plane(summary, out / f"plane-t{key}.png")
    if any(s["policies"] for s in results["by_temperature"].values()):
        files["tokens-per-s"] = plot_throughput(results["by_temperature"], out / "tokens-per-s.png")
    if any(s["cost_model"] for s in results["by_temperature"].values()):
        files["cost-model"] = plot_cost_fit(results, out / "cost-model.png")
    if results.get("forward_times"):
        files["forward-times"] = plot_forward_times(results["forward_times"], out / "forward-times.png")
    if results.get("live_profile"):
        files["live-profile"] = plot_live_profile(results["live_profile"], results.get("forward_times"),
                                                  out / "live-profile.png")
    return files


def _color(family: str) -> str:
    return FAMILY_COLORS.get(family, "tab:cyan")


def plot_plane(summary: dict, path: Path) -> Path:
    fig = Figure(figsize=(7, 5), dpi=DPI)
    ax = fig.add_subplot()
    for family, data in summary["frontiers"].items():
        frontier = data["frontier"]
        ax.plot([v for v, _ in frontier], [d for _, d in frontier], "-", color=_color(family), alpha=0.6, lw=1.5)
    labelled = set()
    for spec, p in summary["policies"].items():
        family = p["family"]
        if family == "target-only":
            continue  # (1, 0) by definition; it would squash the plot
        ax.scatter(p["verification_rate"], p["discard_rate"], color=_color(family),
                   marker=FAMILY_MARKERS.get(family, "o"), s=70 if family == "specdec++" else 40,
                   label=None if family in labelled else family, zorder=3)
        labelled.add(family)
        ax.annotate(spec.split(":", 1)[1] if ":" in spec else spec, (p["verification_rate"], p["discard_rate"]),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    temperature = summary["temperature"]
    ax.set_title(f"verification vs discard rate, {'greedy' if temperature == 0 else f'temperature {temperature:g}'}"
                 f" ({len(summary['prompts'])} prompts)")
    ax.set_xlabel("verification rate N_target / N (lower: fewer target passes)")
    ax.set_ylabel("discard rate N_discarded / N (lower: less wasted drafting)")
    ax.grid(alpha=0.3)
    if labelled:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_throughput(by_temperature: dict, path: Path) -> Path:
    panels = [(k, s) for k, s in by_temperature.items() if s["policies"]]
    height = max(3.0, 0.28 * max(len(s["policies"]) for _, s in panels) + 1.2)
    fig = Figure(figsize=(6 * len(panels), height), dpi=DPI)
    for index, (key, summary) in enumerate(panels, 1):
        ax = fig.add_subplot(1, len(panels), index)
        names = list(summary["policies"])
        values = [summary["policies"][n]["tokens_per_s"] for n in names]
        colors = [_color(summary["policies"][n]["family"]) for n in names]
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        base = summary["policies"].get("target-only")
        if base:
            ax.axvline(base["tokens_per_s"], color="gray", ls="--", lw=1)
        ax.set_xlabel("tokens/s")
        ax.set_title("greedy" if float(key) == 0 else f"temperature {key}")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_cost_fit(results: dict, path: Path) -> Path:
    panels = [(k, s) for k, s in results["by_temperature"].items() if s["cost_model"]]
    fig = Figure(figsize=(5.5 * len(panels), 5), dpi=DPI)
    for index, (key, summary) in enumerate(panels, 1):
        ax = fig.add_subplot(1, len(panels), index)
        fit = CostFit(**summary["cost_model"])
        prompts = set(summary["prompts"])
        records = [r for r in results["records"] if f"{r['temperature']:g}" == key and r["prompt"] in prompts
                   and r["family"] not in ("target-only", "hf")]
        for family in sorted({r["family"] for r in records}):
            mine = [r["stats"] for r in records if r["family"] == family]
            ax.scatter([fit.predict(s["draft_forward_passes"], s["target_forward_passes"]) for s in mine],
                       [s["wall_time_s"] for s in mine], s=12, alpha=0.7, color=_color(family), label=family)
        top = max([r["stats"]["wall_time_s"] for r in records] + [1e-9])
        ax.plot([0, top], [0, top], "k--", lw=1)
        ax.set_xlabel("predicted T = t_draft N_draft + t_target N_target (s)")
        ax.set_ylabel("measured wall time (s)")
        ax.set_title(f"{'greedy' if float(key) == 0 else f'temperature {key}'}: t_draft {fit.t_draft * 1e3:.1f} ms, "
                     f"t_target {fit.t_target * 1e3:.1f} ms, R² {fit.r2:.3f}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_forward_times(forward: dict, path: Path) -> Path:
    fig = Figure(figsize=(6, 4), dpi=DPI)
    ax = fig.add_subplot()
    ks = forward["ks"]
    for role, color in (("draft", "tab:blue"), ("target", "tab:red")):
        ax.plot(ks, [forward[f"{role}_s"][str(k)] * 1000 for k in ks], "o-", color=color, label=f"t_{role}(k)")
    ax.set_xlabel("tokens per pass k")
    ax.set_ylabel("median ms per pass (warm cache)")
    ax.set_title("forward time per pass")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_live_profile(live: dict, forward: dict | None, path: Path) -> Path:
    """The live profile's curves (lines) and the bench's bare warm passes (points), ms by tokens fed."""
    fig = Figure(figsize=(6, 4), dpi=DPI)
    ax = fig.add_subplot()
    draft = live["t_draft_rows_ms"] or {"1": live["t_draft_ms"]}
    for role, curve, color in (("drafting step", draft, "tab:blue"), ("target pass", live["t_target_ms"], "tab:red")):
        points = sorted((int(k), v) for k, v in curve.items())
        ax.plot([k for k, _ in points], [v for _, v in points], "-", color=color, lw=2, label=f"live: {role}")
    if forward:
        for role, color in (("draft", "tab:blue"), ("target", "tab:red")):
            ax.plot(forward["ks"], [forward[f"{role}_s"][str(k)] * 1000 for k in forward["ks"]], "o", color=color,
                    label=f"bare pass: {role}")
    ax.set_xscale("log", base=2)  # one-token steps and prompt prefills on one plot
    ax.set_yscale("log")
    ax.set_xlabel("tokens fed (a drafting step: one per session; a prefill: the prompt)")
    ax.set_ylabel("ms")
    ax.set_title("live cost profile vs measured passes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path
