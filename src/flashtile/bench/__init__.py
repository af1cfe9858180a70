"""`flashtile bench`: flashtile against the other attention backends, side by side, on the same inputs.

    cases.py     what is measured: Case, the presets' sweeps
    inputs.py    the tensors of a case, shared by every backend
    metrics.py   FLOPs and bytes by the FlashAttention papers' conventions
    backends.py  the registry: each backend's setup returns the timed call, or says why it cannot
    refcheck.py  outputs against the fp64 reference, before timing
    timing.py    median and p20/p80 of many repetitions
    run.py       the loop over cases and backends, into rows
    report.py    table, JSON, CSV, the environment header
    plot.py      the PNG
    demo.py      `flashtile demo`
"""
