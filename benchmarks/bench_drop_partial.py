"""Before stopping a `specdec bench` run that will resume elsewhere: drop the prompt in flight, so
each prompt's policies all run on one machine.

    python -m benchmarks.bench_drop_partial docs/results/bench-humaneval
"""

import sys

from specdec.bench.records import RecordStore

store = RecordStore(sys.argv[1])
dropped = store.drop_incomplete_prompts()
print(f"dropped {', '.join(f'prompt {p} at t={t}' for t, p in dropped) or 'nothing'}; {len(store)} records kept")
