"""Faults under load (`make chaos`, `python -m bench.chaos`): the scenarios, what each fault
cost, the figures of docs/RESULTS.md."""
