"""From split graphs to code that runs: kernel substitution and backends (``backends``), the
eager straight-line writer and the piecewise cut at sends, and the rewrites that adapt a loaded
attention program to vLLM's flat batches (attention slots, cache positions, sampled rows)."""
