"""Property-based fuzzing of the gateway's OpenAPI on the live stack (schemathesis, bench/fuzz.py):
no 5xx and no hang, whatever the body, at ~4,000 requests: schemathesis's coverage phase (~2,000 a
run, whatever the examples) and 10 fuzzed examples per operation (`make fuzz`: 100 over four
seeds, over 10,000). The served model's run starts from valid bodies of each operation
(bench/fuzz.py's BODIES), so each one, a completions batch included, is answered as well as
refused. Generation is capped (max_tokens <= 4, prompts <= 256 tokens) so that the requests that
do reach a worker stay cheap. On the fake model (tests/stack/conftest.py): what is
probed is the gateway's handling of bodies, not the model's numbers."""

from __future__ import annotations

import pytest
from conftest import FAKE, fake_env

from bench.fuzz import BODIES, CAPS, answered_after, run_both
from pdserve.local.stack import Stack, StackConfig

pytestmark = pytest.mark.slow
EXAMPLES = 10  # per operation: the fuzzing phase's share (the coverage phase's requests come regardless)


def test_over_1000_generated_requests_get_no_5xx_and_no_hang(tmp_path):
    cfg = StackConfig.on_free_ports(colocated=True, decode=1, kv_blocks=512, log_dir=tmp_path, model=FAKE,
                                    env=fake_env(**CAPS))
    with Stack(cfg) as stack:
        any_model, served = run_both(stack, tmp_path, EXAMPLES)
        after = answered_after(stack)
        alive = stack.procs["decode-0"].poll() is None
    print(f"schemathesis: {any_model.generated} requests (any model) + {served.generated} (the served model); "
          f"answered: {dict(served.answered)}")
    assert any_model.rc == 0, any_model.tail
    assert served.rc == 0, served.tail
    statuses = any_model.statuses + served.statuses
    assert not [s for s in statuses if s.startswith("5")], statuses
    assert sum(statuses.values()) >= 1000 and after and alive
    assert set(BODIES) | {"/v1/completions (batch)"} <= set(served.answered), served.answered
