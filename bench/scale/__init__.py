"""Router placement at fleet scale (`make bench-scale`, `python -m bench.scale`): the plan, the
stage, the simulated fleet, the drive, the check against today's policy, the report."""
