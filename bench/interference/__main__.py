"""`python -m bench.interference`: `make bench` (bench/interference/run.py)."""

from bench.interference.run import main

main()
