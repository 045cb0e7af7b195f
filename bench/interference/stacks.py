"""The stacks `make bench` compares on the same cores (colocated, chunked, disaggregated, and
the disaggregated one placing every prompt remotely or with no cores lent), shared by the benchmark
and the planner's profile and check."""

from __future__ import annotations

import os

from pdserve.local.stack import StackConfig

ALL = set(range(os.cpu_count() or 1))


def arms(model: str = "smollm2") -> dict[str, StackConfig]:
    cores = sorted(ALL)
    split = ({cores[0]}, set(cores[1:]) or {cores[0]})
    whole = {"PD_PREFILL_CHUNK": "2048", "PD_MAX_BATCHED_TOKENS": "4096"}
    return {
        "colocated": StackConfig.on_free_ports(decode=1, colocated=True, kv_blocks=2048, threads=len(cores),
                                               env=whole, model=model),
        "chunked": StackConfig.on_free_ports(decode=1, colocated=True, kv_blocks=2048, threads=len(cores),
                                             env={"PD_PREFILL_CHUNK": "128", "PD_MAX_BATCHED_TOKENS": "256"},
                                             model=model),
        # the decode worker on every core: it steps on the prefill worker's threads between that worker's passes
        "disaggregated": StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=2048, threads=len(split[1]),
                                                   env=whole, cpus={"prefill-0": split[0]}, model=model),
    }


def pinned_arm(model: str = "smollm2") -> StackConfig:
    """The disaggregated arm with each worker on its own cores and no threads lent (PD_CORE_BOARD off),
    for the victims only: what lending buys."""
    cfg = arms(model)["disaggregated"]
    cfg.lend_cores = False
    cores = sorted(ALL)
    cfg.cpus = {"prefill-0": {cores[0]}, "decode-0": set(cores[1:]) or {cores[0]}}
    return cfg


def remote_arm(model: str = "smollm2") -> StackConfig:
    """The disaggregated arm with every prompt sent to the prefill pool (PD_PLACEMENT=remote),
    for the victims only."""
    cfg = arms(model)["disaggregated"]
    cfg.env = {**cfg.env, "PD_PLACEMENT": "remote"}
    return cfg
