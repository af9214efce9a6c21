"""The GPU benchmark runs end to end in its smoke mode (tiny shapes, CPU): a GPU machine's minutes
are too few to find a broken script there (two attentions registered under one name once broke its
passes section). Off CUDA the smoke run pads the captured passes to their buckets and runs them
eagerly, so their code runs here too."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_smoke_run_writes_every_section(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.bench", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["finished"]
    passes, loop = data["sections"]["passes"], data["sections"]["loop"]
    assert all({"runtime_ms", "static_ms", "captured_ms"} <= set(row) for rows in passes.values() for row in rows.values())
    assert all(row["graph_vs_eager"]["argmax_agree"] == 1.0 for rows in passes.values() for row in rows.values())
    assert all(row["static_vs_runtime"]["argmax_agree"] == 1.0 for rows in passes.values()
               for key, row in rows.items() if key.startswith("B=1,"))
    assert all("runtime_static_ms" in row for name in ("qwen2.5-0.5b", "qwen2.5-1.5b") for row in passes[name].values())
    assert {"qwen2.5-1.5b", "qwen2.5-1.5b/static", "qwen2.5-1.5b/feature"} <= set(loop)
    assert loop["qwen2.5-1.5b/feature"]["fixed@1"]["draft_passes"] > 0  # its chains timed as the draft's
    assert all("error" not in rows and all("tokens_per_s" in row for row in rows.values())
               for name, rows in loop.items() if name != "probe_profile")
    feature = data["sections"]["feature"]  # the feature draft's step for each target shape, eager off CUDA
    assert set(feature) == {"qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b"}
    assert all({"eager_ms", "chain_ms", "captured_ms"} <= set(row) and row["graph_vs_eager"]["argmax_agree"] == 1.0
               for rows in feature.values() for row in rows.values()), feature
    # the first cache that ran (static), with the loop beside the verifier too
    transport, beside = data["sections"]["transport"].values()
    assert list(data["sections"]["transport"]) == ["qwen2.5-1.5b/static", "qwen2.5-1.5b/static/beside"]
    for rows in (transport, beside):
        assert {"T=0@1", "T=0@2", "T=1@1", "bare_call_ms"} <= set(rows), rows
        assert all(row["added"]["n"] > 0 and set(row["calls"]["draft"]) >= {"request_hop", "worker", "response_hop"}
                   for key, row in rows.items() if key.startswith("T=")), rows
    assert all(set(row["calls"]["verifier"]) >= {"request_hop", "worker", "response_hop"}
               for key, row in transport.items() if key.startswith("T="))
    assert all(set(row["calls"]["verifier"]) == {"call", "worker", "thread_hop"}  # in the loop's process
               for key, row in beside.items() if key.startswith("T="))
