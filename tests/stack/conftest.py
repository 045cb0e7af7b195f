"""The real stack as processes on free ports: nats-server, redis-server, router, gateway, workers;
with the real model (tests/conftest.py's session `stack`, the clients' too), or the fake one where
the model is not what is tested (FAKE, fake_env, the session's `fake_stack`)."""

from __future__ import annotations

import pytest

from pdserve.local.stack import Stack, StackConfig

MODEL = "SmolLM2-135M-Instruct"
# the fake model (pdserve/shared/engine/fake.py), for the tests of routing, failover, cancellation and the
# bus: the real engine around it, tokens no model's; served under MODEL's name (fake_env)
FAKE = "fake:smollm2"


def fake_env(step_s: float = 0.0, **env: str) -> dict[str, str]:
    """A fake-model stack's environment (`env` on top): MODEL's name, `step_s` slept per forward pass."""
    return {"PD_MODEL_NAME": MODEL, "PD_FAKE_STEP_S": str(step_s), **env}


@pytest.fixture(scope="session")
def fake_stack(otlp, tmp_path_factory):
    """The session's stack as `stack` is, on the fake model: for the files whose tests are about
    the API and the path, not the model's numbers (a file takes it with `stack` and `client`
    pointed at it). Every prompt through the prefill worker's handoff (PD_PLACEMENT=remote), as
    the real stack places them: the fake's passes take microseconds, so once the decode worker's
    rate is measured the default `cheapest` would prefill short prompts there."""
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, model=FAKE,
                                    log_dir=tmp_path_factory.mktemp("fake-stack-logs"),
                                    env=fake_env(OTEL_EXPORTER_OTLP_ENDPOINT=otlp.url,
                                                 PD_TRACE_BAGGAGE_KEYS="app.tenant", PD_PLACEMENT="remote"))
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="session")
def fake_client(fake_stack):
    from openai import OpenAI

    return OpenAI(base_url=fake_stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
