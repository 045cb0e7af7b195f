"""Shared fixtures. The real models (SmolLM2, its native-weights load, Gemma 3) and the
transformers reference load once per session, and the real stack starts once (the clients'
tests and the stack tests on the real model share it). The run's guard against processes left behind
(tests/process_guard.py) hooks in here."""

from __future__ import annotations

import os

import pytest
import torch

# the guard: a process that outlives the run's tests is killed and fails the run; the peak memory
from process_guard import (  # noqa: F401
    pytest_configure,
    pytest_runtest_logstart,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# Triton kernels run interpreted on CPU; must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# two threads; one where two runs share the cores (scripts/run_tests.sh sets PD_TEST_THREADS): torch's
# threads on a core the other run takes wait on each other, and its passes took 3x as long
torch.set_num_threads(int(os.environ.get("PD_TEST_THREADS", 0)) or min(2, os.cpu_count() or 1))

# The stack's workers (children inherit this) compute with fp32 weights, as the in-process
# references the tests compare them with (the `smollm2` fixture, transformers) do; the default
# (`auto`: a GGUF's own blocks) is what tests/stack/test_launcher.py and the native tests run.
os.environ.setdefault("PD_WEIGHTS", "fp32")
# and load the grammar library on their first structured request, not at start (2-3 s of CPU per
# process, most stacks here never ask): the session's real stack and the launcher's load it at start
os.environ.setdefault("PD_GRAMMAR_PRELOAD", "0")


@pytest.fixture(scope="session")
def tiny():
    from pdserve.shared.engine.loader import load

    return load("tiny")


@pytest.fixture(scope="session")
def smollm2():
    from pdserve.shared.engine.loader import load

    return load("smollm2")


@pytest.fixture(scope="session")
def fake():
    """The fake model (pdserve/shared/engine/fake.py): the in-process reference of the stack tests that run it."""
    from pdserve.shared.engine.loader import load

    return load("fake:smollm2")


@pytest.fixture(scope="session")
def smollm2_native():
    """SmolLM2 with its file's 4-bit blocks computed with as they are (PD_WEIGHTS=native)."""
    from pdserve.shared.engine.loader import load

    return load("smollm2", weights="native")


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M from its Q4_K_M file (tests/engine/test_gemma3_gguf.py, tests/stack/test_models.py)."""
    from pdserve.shared.engine.loader import load

    return load("gemma3-270m")


@pytest.fixture(scope="session")
def tokenizer():

    from pdserve.shared.engine.sources import smollm2_path
    from pdserve.shared.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_path())


@pytest.fixture(scope="session")
def otlp():
    from pdserve.shared.tools.otlp_sink import OtlpReceiver

    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def stack(otlp, tmp_path_factory):
    """The real stack, 1 prefill + 1 decode worker on SmolLM2, exporting traces to the in-process receiver."""
    from pdserve.local.stack import Stack, StackConfig

    # (no threads lent: the two pytest runs of make test share the cores; tests/stack/test_lent_cores.py lends)
    cfg = StackConfig.on_free_ports(prefill=1, decode=1, kv_blocks=512, lend_cores=False,
                                    log_dir=tmp_path_factory.mktemp("stack-logs"),
                                    env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "PD_GRAMMAR_PRELOAD": "1",
                                         "PD_TRACE_BAGGAGE_KEYS": "app.tenant"})  # (tests/stack/test_ids.py)
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="session")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
