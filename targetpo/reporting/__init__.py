"""What a run reports: its metrics (``metrics.py``), the completions table (``completions.py``) and the block that says
what trains (``run_summary.py``)."""
