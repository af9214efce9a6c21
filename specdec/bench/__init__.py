"""`specdec bench`: every stopping policy, the HF peer and the oracle on one prompt set, in one run.

    runner.py       the run loop, resumable (records.py: one JSON line per generation)
    specs.py        policy specs (`fixed:4`, `specdec++:0.3`, `hf-dynamic`) and the default sweep
    peer.py         HF transformers assisted generation on the same models, counted and timed like ours
    costmodel.py    the paper's eq. 2.1 fit and eq. 2.3 predictions (pure)
    frontier.py     Pareto frontiers in the verification/discard plane (pure)
    forward.py      forward-time curves t_draft(k), t_target(k)
    report.py       totals, lossless check, goals, results.json and summary.md
    plots.py        PNG plots
"""
