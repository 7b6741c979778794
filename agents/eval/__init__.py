"""Scoring policies: the papers' evaluation, held-out scores with paired intervals, LLM judges, tables.

- :mod:`agents.eval.evaluation`: :func:`~agents.eval.evaluation.evaluate` (greedy or sampled, pass@k);
- :mod:`agents.eval.heldout`: a run's held-out evaluations and their paired comparisons;
- :mod:`agents.eval.judge`: an engine as the LLM judge of :mod:`agentenv.judge`;
- :mod:`agents.eval.tables`: the plain-text tables they print.
"""
