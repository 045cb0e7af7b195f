"""A prefill worker's cancels kept for jobs taken later (pdserve/services/prefill/cancels.py): one stops
a job only from its placement's holder (its MAC) or the supervisor (its subject)."""

from types import SimpleNamespace

from pdserve.services.prefill.cancels import Cancels
from pdserve.shared import macs
from pdserve.shared.messages import Cancel, PrefillJob, Sampling

SECRET = macs.new_secret()


def job(attempt: int, secret: str = SECRET) -> PrefillJob:
    return PrefillJob(request_id="r", prompt_token_ids=[1], sampling=Sampling(), decode_worker="d",
                      decode_address="", decode_fingerprint="", first_block=0, kv_tag=1, attempt=attempt,
                      secret=secret)


def msg(cancel: Cancel, secret: str = "") -> SimpleNamespace:
    data = cancel.encode()
    return SimpleNamespace(data=data, headers={macs.HEADER: macs.mac(secret, data)} if secret else None)


def test_a_cancel_kept_stops_the_older_placements_job_only_with_its_mac_or_from_the_supervisor():
    signed, forged, other = Cancels(), Cancels(), Cancels()
    failover = Cancel(request_id="r", reason="failover", before_attempt=1)
    signed.note("r", 1, msg(failover, SECRET), supervisor=False)
    forged.note("r", 1, msg(failover), supervisor=False)                    # no MAC: anyone's
    other.note("r", 1, msg(failover, macs.new_secret()), supervisor=False)  # another placement's
    assert signed.stops(job(0)) and not signed.stops(job(1))                # the newer placement goes on
    assert not forged.stops(job(0)) and not other.stops(job(0))
    supervised = Cancels()
    supervised.note("r", float("inf"), msg(Cancel(request_id="r", reason="gateway lost")), supervisor=True)
    assert supervised.stops(job(0, secret="")) and supervised.stops(job(3))
