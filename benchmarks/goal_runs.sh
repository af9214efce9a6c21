#!/usr/bin/env bash
# Issue 19's goal runs on the torch runtime: HumanEval (40 prompts) and the prose test set (20), greedy
# then T=1, every policy family at its sweep; then one report per set over both temperatures.
# Resumable: each `specdec bench` skips the records its --out already holds, so rerun this script after
# an interruption. Hours on a 2-core CPU (docs/benchmarks.md, "Issue 19: the goal runs").
set -euo pipefail
cd "$(dirname "$0")/.."
B="specdec bench --runtime torch --draft default --max-new-tokens 128 --no-progress --chosen specdec++cost"
# greedy: the chosen default (specdec++cost), the paper's rule at the validation h, the baselines, the oracle
G="target-only specdec++:0.5 fixed:4 fixed:6 fixed:8 fixed:10 fixed:12 fixed:14 svip:0.2 svip:0.3 svip:0.4
   confidence:0.4 confidence:0.6 confidence:0.8 specdec++cost oracle"
# T=1: the same plus the paper's whole fixed-K and h sweeps (the frontier goal)
S="target-only fixed:2 fixed:4 fixed:6 fixed:8 fixed:10 fixed:12 fixed:14 svip:0.2 svip:0.3 svip:0.4
   confidence:0.4 confidence:0.6 confidence:0.8 specdec++cost specdec++:0.1 specdec++:0.3 specdec++:0.5
   specdec++:0.7 specdec++:0.9"
for set in "humaneval 40" "prose 20"; do
  read -r name limit <<< "$set"
  $B --prompts "$name" --limit "$limit" --temperatures 0 --policies $G --out "docs/results/goal-$name"
done
for set in "humaneval 40" "prose 20"; do
  read -r name limit <<< "$set"
  $B --prompts "$name" --limit "$limit" --temperatures 1 --policies $S --out "docs/results/goal-$name"
  $B --prompts "$name" --limit "$limit" --temperatures 0 1 --policies $G $S --out "docs/results/goal-$name" --report-only
done
