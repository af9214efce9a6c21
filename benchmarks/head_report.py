"""The training report of an acceptance head: markdown tables and a reliability plot from its training.json.

    python -m benchmarks.head_report specdec/heads/default-pair \
        --plot specdec/heads/default-pair/reliability.png > specdec/heads/default-pair/report.md

Prints the data counts, the final validation metrics (loss, binary KL to the soft labels, AUROC,
ECE), the per-epoch curve, the per-position rows, the reliability table, the AUROC of each single
draft feature beside the head's, the same per label temperature, and the calibration (ECE before and
after) when training.json has them, and, when the head came from `specdec train-head --sweep`, the sweep table. `--plot` draws
the reliability diagram (before and after calibration when the head is calibrated).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPORT_FILE = "training.json"


def fmt(x) -> str:
    if isinstance(x, float):
        return "-" if math.isnan(x) else f"{x:.3f}"
    return str(x)


def markdown(report: dict, head_config: dict) -> str:
    counts, train, final = report["data"]["counts"], report["train"], report["final"]
    shape = (f", hidden state through a {train['bottleneck']}-dim bottleneck, dropout {train.get('dropout', 0):g}, "
             f"weight decay {train.get('weight_decay', 0):g}" if train.get("bottleneck") else "")
    lines = [f"Head: {train.get('features', 'hidden')} features, D = {train['depth']}{shape}, w_acc = {train['w_acc']:g}, "
             f"w_rej = {train['w_rej']:g}, mixing ratio r = {train['mixing_ratio']:g}, {train['epochs']} epochs, "
             f"batch {train['batch_size']}, lr {train['lr']:g}; threshold h = {head_config.get('threshold')}",
             "",
             f"Data: {counts['sequences']} responses, {counts['tokens']} labelled tokens "
             f"(train {counts['train_sequences']} / {counts['train_tokens']}, "
             f"validation {counts['validation_sequences']} / {counts['validation_tokens']}); "
             f"prompts: {report['data'].get('prompt_source')}",
             "",
             "| epoch | train loss | val loss | val KL | val AUROC | val ECE |",
             "|---|---|---|---|---|---|"]
    for e in report["epochs"]:
        lines.append(f"| {e['epoch']} | {fmt(e.get('train_loss', math.nan))} | {fmt(e['val_loss'])} | "
                     f"{fmt(e['val_kl'])} | {fmt(e['val_auroc'])} | {fmt(e['val_ece'])} |")
    if final.get("per_position"):
        lines += ["", "Per response position (validation):", "",
                  "| position | tokens | mean label | mean prediction | KL | AUROC |", "|---|---|---|---|---|---|"]
        for row in final["per_position"]:
            lines.append(f"| {row['position']} | {row['count']} | {fmt(row['mean_label'])} | "
                         f"{fmt(row['mean_prediction'])} | {fmt(row['kl'])} | {fmt(row['auroc'])} |")
    rel = final.get("reliability")
    if rel:
        lines += ["", f"Reliability (validation, ECE {fmt(rel['ece'])}):", "",
                  "| bin | tokens | mean prediction | mean label |", "|---|---|---|---|"]
        edges = rel["bin_edges"]
        for b, count in enumerate(rel["count"]):
            if count:
                lines.append(f"| [{edges[b]:.1f}, {edges[b + 1]:.1f}) | {count} | {fmt(rel['mean_prediction'][b])} | "
                             f"{fmt(rel['mean_label'][b])} |")
    if "sweep" in report:
        sweep = report["sweep"]
        lines += ["", f"Sweep (selected by validation {sweep['select_by']}):", "",
                  "| D | w_rej | val loss | val KL | val AUROC | val ECE |", "|---|---|---|---|---|---|"]
        for r in sweep["runs"]:
            mark = " **chosen**" if (r["depth"], r["w_rej"]) == (sweep["best"]["depth"], sweep["best"]["w_rej"]) else ""
            lines.append(f"| {r['depth']} | {r['w_rej']:g}{mark} | {fmt(r['val_loss'])} | {fmt(r['val_kl'])} | "
                         f"{fmt(r['val_auroc'])} | {fmt(r['val_ece'])} |")
    aurocs = report.get("feature_auroc")
    if aurocs:
        names = {"head": "the head", "q_token": "q(y_i)", "top1_probability": "top-1 probability (confidence)",
                 "margin": "top-1/top-2 margin", "entropy": "entropy, negated (SVIP)"}
        lines += ["", "AUROC on the validation tokens, the head against each single feature:", "",
                  "| score | AUROC |", "|---|---|"]
        lines += [f"| {names.get(k, k)} | {fmt(v)} |" for k, v in aurocs.items()]
    by_temperature = report.get("by_temperature")
    if by_temperature:
        feature_names = list(next(iter(by_temperature.values()))["feature_auroc"])
        lines += ["", "Per label temperature (validation; T = 0: greedy labels, exact match):", "",
                  "| T | tokens | mean label | head AUROC | " + " | ".join(f"{n} AUROC" for n in feature_names)
                  + " | ECE raw | ECE calibrated |", "|---" * (6 + len(feature_names)) + "|"]
        for t, row in by_temperature.items():
            lines.append(f"| {t} | {row['tokens']} | {fmt(row['mean_label'])} | {fmt(row['auroc'])} | "
                         + " | ".join(fmt(row["feature_auroc"][n]) for n in feature_names)
                         + f" | {fmt(row['ece_raw'])} | {fmt(row['ece_calibrated'])} |")
    cal = report.get("calibration")
    if cal:
        lines += ["", f"Calibration ({cal['method']}: sigmoid({cal['scale']:.3f} l + {cal['bias']:.3f}), fitted on the "
                  f"validation tokens): ECE {fmt(cal['ece_before'])} before, {fmt(cal['ece_after'])} after "
                  f"({cal['folds']}-fold cross-fitted; {fmt(cal['ece_after_in_sample'])} in sample)"]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    curves = [("head", report["final"]["reliability"])]
    if report.get("calibration"):
        curves = [("raw", report["calibration"]["reliability_before"]),
                  ("calibrated", report["calibration"]["reliability_after"])]
    for label, rel in curves:
        kept = [b for b, c in enumerate(rel["count"]) if c]
        ax.plot([rel["mean_prediction"][b] for b in kept], [rel["mean_label"][b] for b in kept], "o-",
                label=f"{label} (ECE {rel['ece']:.3f})")
    ax.set_xlabel("predicted acceptance probability")
    ax.set_ylabel("mean soft label min(1, p/q)")
    ax.set_title("Acceptance head, validation")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", help="head directory (head.json, training.json)")
    parser.add_argument("--plot", default=None, help="PNG path for the reliability diagram")
    args = parser.parse_args()
    head = Path(args.head)
    report = json.loads((head / REPORT_FILE).read_text())
    print(markdown(report, json.loads((head / "head.json").read_text())))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
