"""Short streams beside long prompts, and goodput on the Azure trace (`make bench`, `python -m
bench.interference`): the stacks compared, a run of each, the report, the prefill chunk's arms."""
