"""A discrete-event simulator of pdserve's pools for capacity planning (`make plan`): the
engine scheduler's rules and the router's placement policy, run against cost models fitted to
a measured profile (bench/planning/profile.py). A simulation, named as one wherever its figures appear."""
