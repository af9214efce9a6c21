"""Target-only (T) and the default (D) in a given order at C sessions, llama.cpp, in one process:
each run's wall, its prefill passes (> 64 tokens), its decode passes, the probes, the rest, and how
often the draft was called. The forty-eighth session's probe of where the default's time goes
(benchmarks/concurrency.py now reports the same split in its table):

    python docs/results/planner/recheck-2026-12-02b/ab_passes.py TDDTTDDTTD 8   # writes /tmp/prof/ab-ORDER-C.json
"""
import asyncio, collections, json, sys, time, statistics
from specdec.builder import EngineConfig, build_engine
from specdec.params import GenerationParams, PolicyConfig
from specdec.prompts import humaneval_prompts

engine = build_engine(EngineConfig(), progress=False)
ids = [engine.encode_prompt(p) for p in humaneval_prompts(32)]
loop = engine.loop
tr = loop.calls.transport
passes = []
orig_take = tr.verifier.take_timings
def take():
    t = orig_take(); passes.extend(t); return t
tr.verifier.take_timings = take
drafted = collections.Counter()
orig_dp = tr.draft.propose
def dp(*a, **k):
    drafted["calls"] += 1; return orig_dp(*a, **k)
tr.draft.propose = dp
order = sys.argv[1]
C = int(sys.argv[2]) if len(sys.argv) > 2 else 8
out = []
for i, c in enumerate(order):
    policy = {"T": "target-only", "D": "specdec++cost"}[c]
    params = GenerationParams(max_new_tokens=128, policy=PolicyConfig(name=policy))
    engine.generate_ids(ids[0], params.model_copy(update={"max_new_tokens": 4}))
    passes.clear(); drafted.clear()
    async def main():
        t = time.perf_counter()
        rs = await asyncio.gather(*(loop.generate(ids[j], params) for j in range(C)))
        return time.perf_counter() - t, sum(len(r.completions[0].token_ids) for r in rs)
    wall, toks = asyncio.run(main())
    big = sum(p.ms for p in passes if p.tokens > 64 and not p.probe) / 1000
    small = sum(p.ms for p in passes if p.tokens <= 64 and not p.probe) / 1000
    probe = sum(p.ms for p in passes if p.probe) / 1000
    dec = sorted(p.ms for p in passes if p.tokens == 1 and not p.probe)
    row = dict(i=i, policy=c, med1=dec[len(dec)//2] if dec else 0, wall=wall, toks=toks, prefill=big, decode=small, probe=probe,
               other=wall - big - small - probe, draft_calls=drafted["calls"], npass=len(passes))
    out.append(row)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
import os; os.makedirs("/tmp/prof", exist_ok=True)
json.dump(out, open(f"/tmp/prof/ab-{order}-{C}.json", "w"))
