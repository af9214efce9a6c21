#!/usr/bin/env bash
# Issue 34's end-to-end runs on the llama.cpp runtime: the draft requantized to iq4_nl (what
# --draft-quant auto gives the default draft) against the draft as shipped (QUANTS="q4_0 shipped"
# for others), each with target-only, the default policy (specdec++cost) and
# fixed:3 (whose acceptance compares the two drafts), on HumanEval (40) and the prose test set (20),
# greedy. Resumable: each `specdec bench` skips the records its --out holds; rerun after an
# interruption. Compare speeds within one --out only (its policies are interleaved prompt by
# prompt); the two drafts' runs follow each other, so their target-only rows tell how far the
# machine drifted between them. Say which CPU: the report records it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/fast-draft}
for set in "humaneval 40" "prose 20"; do
  read -r name limit <<< "$set"
  [[ -n "${ONLY:-}" && "$name" != "$ONLY" ]] && continue  # ONLY=humaneval: that set alone
  for quant in ${QUANTS:-iq4_nl shipped}; do
    specdec bench --runtime llamacpp --draft default --draft-quant "$quant" --prompts "$name" --limit "$limit" --temperatures 0 \
      --policies target-only specdec++cost fixed:3 --chosen specdec++cost --max-new-tokens 128 \
      --forward-ks 1 2 4 --no-progress --out "$OUT/bench-$name-$quant"
  done
done
