"""PD_GRAMMAR_PRELOAD: on (the default), a worker builds its structured-output tables and a gateway
loads the grammar library beside the start; off, neither does (the first structured request will)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.services.gateway import main as gateway_main
from pdserve.shared import worker
from pdserve.shared.config import DecodeSettings, GatewaySettings
from pdserve.shared.engine.engine import Engine

WAIT_S = 0.5  # (off: long enough for a thread started by mistake to have run)


@pytest.mark.parametrize("preload", [True, False])
def test_a_worker_builds_its_grammar_tables_at_start_only_with_preload(monkeypatch, preload):
    built = threading.Event()
    monkeypatch.setattr(Engine, "grammars", property(lambda engine: built.set()))
    worker.build_engine(DecodeSettings(model="fake:smollm2", kv_blocks=16, grammar_preload=preload))
    assert built.wait(5 if preload else WAIT_S) == preload


@pytest.mark.parametrize("preload", [True, False])
def test_a_gateway_loads_the_grammar_library_at_start_only_with_preload(monkeypatch, preload):
    loaded = threading.Event()
    monkeypatch.setattr(gateway_main.grammar, "check", lambda grammar: loaded.set())
    asyncio.run(gateway_main.load_model(GatewaySettings(model="fake:smollm2", grammar_preload=preload)))
    assert loaded.wait(5 if preload else WAIT_S) == preload
