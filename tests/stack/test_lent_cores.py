"""The local stack's workers share the host's cores (PD_CORE_BOARD, pdserve/shared/cores.py): the
decode worker steps on the prefill worker's thread too while that worker is between passes, and
gives it back when it has nothing to step. On the fake model: the board is what is tested."""

from __future__ import annotations

import httpx
import pytest
from conftest import FAKE, MODEL, fake_env
from test_no_transport import counter

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared.cores import Board

pytestmark = pytest.mark.slow


def test_the_decode_worker_steps_on_the_idle_prefill_workers_thread(tmp_path):
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, log_dir=tmp_path, model=FAKE, threads=1,
                                    env=fake_env(PD_PLACEMENT="remote"))
    with Stack(cfg) as stack, httpx.Client(base_url=stack.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24,
                                               "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        lent = counter(stack, "decode-0", "pd_lent_thread_steps_total")
        assert 0 < lent <= 24, "the decode steps after the prompt's pass ran on the prefill worker's thread too"
        board = Board(stack.data / "cores")
        slots = [board.read(i) for i in range(4)]
        assert slots[0][:3] == ("prefill-0", 1, False), "the prefill worker's slot: its thread, between passes"
        assert all(s[3] == 0 for s in slots), "the decode worker gave the thread back when it had nothing to step"
        assert not slots[1][0], "only prefill workers lend"


def test_no_board_with_lending_off(tmp_path):
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=256, log_dir=tmp_path, model=FAKE,
                                    lend_cores=False, env=fake_env())
    with Stack(cfg) as stack, httpx.Client(base_url=stack.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert counter(stack, "decode-0", "pd_lent_thread_steps_total") == 0
        assert not (stack.data / "cores").exists()
