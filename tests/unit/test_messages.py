"""Every wire message round-trips and carries its version; fields a newer sender adds are ignored."""

import pytest
from pydantic import ValidationError

from pdserve.shared import messages as m

SAMPLING = m.Sampling(max_tokens=5, temperature=0.5, stop=("x",), seed=3)
EXAMPLES = [
    SAMPLING,
    m.RouteRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SAMPLING, model="x"),
    m.RouteReply(request_id="r", ok=True, mode="remote", reason="pool", prefill_worker="p", decode_worker="d"),
    m.TokenChunk(request_id="r", seq=3, token_ids=[7], text="é", finished=True, finish_reason="stop"),
    m.AdmitRequest(request_id="r", prompt_token_ids=[1], sampling=SAMPLING, mode="local", crashes=1),
    m.AdmitReply(request_id="r", ok=True, first_block=2, num_blocks=4, kv_tag=1 << 20),
    m.KVLayer(request_id="r", prefill_worker="p", fingerprint="f", tag=1 << 20, layer=3, first_block=0,
              num_blocks=2, checksums=[1, 2**64 - 1]),
    m.KVEnd(request_id="r", ok=True, first_token=5),
    m.KVResend(request_id="r", layer=3, first_block=1, num_blocks=1, resend=1),
    m.PrefillJob(request_id="r", prompt_token_ids=[1], sampling=SAMPLING, decode_worker="d",
                 decode_address="00ff", decode_fingerprint="f", first_block=0, kv_tag=1 << 20, crashes=1),
    m.Requeued(request_id="r", prefill_worker="p", crashes=1),
    m.KVAck(request_id="r", ok=False, error="bad checksum"),
    m.Cancel(request_id="r"),
    m.WorkerInfo(worker_id="w", role="decode", model="x", fingerprint="f", total_blocks=8, free_blocks=4),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert type(msg).decode(msg.encode()) == msg
    assert b'"v":1' in msg.encode()


def test_a_newer_senders_fields_are_ignored_and_an_unknown_version_refused():
    newer = m.RouteRequest.decode(b'{"v":1,"request_id":"r","prompt_token_ids":[1],"model":"x","surprise":1,'
                                  b'"sampling":{"v":1,"max_tokens":3,"new_knob":true}}')
    assert newer == m.RouteRequest(request_id="r", prompt_token_ids=[1], model="x", sampling=m.Sampling(max_tokens=3))
    with pytest.raises(ValidationError):
        m.Cancel.decode(b'{"v":2,"request_id":"r"}')
    with pytest.raises(ValidationError):   # made in code, a misspelt field is still an error
        m.Cancel(request_id="r", surprise=1)


def test_a_resend_number_keeps_its_name_on_the_wire_so_every_version_reads_it():
    notice = m.KVResend(request_id="r", layer=0, first_block=0, num_blocks=1, resend=2)
    assert b'"attempt":2' in notice.encode() and b"resend" not in notice.encode()
    assert m.KVResend.decode(notice.encode()).resend == 2


def test_sampling_maps_to_engine_params():
    params = SAMPLING.to_engine()
    assert params.max_tokens == 5 and params.stop == ("x",) and params.seed == 3
