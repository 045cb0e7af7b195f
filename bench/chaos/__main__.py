"""`python -m bench.chaos`: the scenarios (bench/chaos/scenarios.py)."""

from bench.chaos.scenarios import main

main()
