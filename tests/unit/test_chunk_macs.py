"""The gateway takes a request's chunks only signed with its placement's secret (pdserve/shared/macs.py):
a chunk made up by a process with publish rights on `pd.tokens.<id>`, or moved from another
request or placement, never reaches the client."""

import asyncio
from types import SimpleNamespace

from pdserve.services.gateway.relay import Relay, RelayTimings
from pdserve.shared import macs, metrics
from pdserve.shared.messages import RouteReply, RouteRequest, Sampling, TokenChunk

REQ = RouteRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=Sampling(max_tokens=8), model="m")
PLACED = RouteReply(request_id="r", ok=True, mode="remote", decode_worker="d0", prefill_worker="p0")


def chunk(seq, text, finished=False, rid="r", attempt=0):
    return TokenChunk(request_id=rid, seq=seq, token_ids=[100 + seq], text=text, finished=finished, attempt=attempt)


def msg(signed: macs.Signed | None, data: bytes = b"") -> SimpleNamespace:
    if signed is None:
        return SimpleNamespace(data=data, headers=None)
    return SimpleNamespace(data=signed.data, headers={macs.HEADER: signed.mac})


def streamed(deliver):
    """Place REQ on a fake bus, deliver what `deliver(secret)` gives to its token subscription,
    and return the texts the client is streamed and the route request sent."""
    async def run():
        handlers, routed = {}, []

        class Bus:
            async def subscribe(self, subject, cb):
                handlers[subject] = cb
                return SimpleNamespace(unsubscribe=_nothing)

            async def request(self, subject, req, reply_type, timeout):
                routed.append(req)
                return PLACED

            async def publish(self, subject, m, ctx=None, secret=""):
                pass

        _, chunks = await Relay(Bus(), RelayTimings(1, 2)).run(REQ)
        for m in deliver(routed[0].secret):
            await handlers["pd.tokens.r"](m)
        texts = [c.text async for c in chunks]
        return texts, routed[0]

    return asyncio.run(run())


async def _nothing():
    pass


def test_a_chunk_signed_with_the_placements_secret_is_streamed_and_forgeries_are_dropped_and_counted():
    other = macs.new_secret()   # another request's placement: what a worker placed for it holds
    forged_before = metrics.FORGED_CHUNKS._value.get()

    def deliver(secret):
        assert len(secret) == 32
        return [msg(macs.sign(chunk(0, "real "), secret)),
                msg(None, chunk(1, "unsigned", finished=True).encode()),              # no MAC at all
                msg(macs.sign(chunk(1, "wrong secret", finished=True), other)),       # signed for another request
                msg(macs.sign(chunk(1, "moved", finished=True, rid="s"), secret)),    # another id under this secret
                msg(macs.sign(chunk(1, "next placement", finished=True, attempt=1), secret)),  # claims attempt 1
                msg(macs.Signed(chunk(1, "bad mac", finished=True).encode(), "0" * 32)),
                msg(macs.sign(chunk(0, "real "), secret)),                            # a replay: a duplicate seq
                msg(macs.sign(chunk(1, "end", finished=True), secret))]

    texts, routed = streamed(deliver)
    assert texts == ["real ", "end"]
    assert metrics.FORGED_CHUNKS._value.get() == forged_before + 5
    assert routed.secret and routed.secret != REQ.secret   # minted by the gateway, per placement


def test_a_tampered_chunk_fails_its_mac():
    secret = macs.new_secret()
    signed = macs.sign(chunk(0, "a"), secret)
    assert macs.opened("r", {0: secret}, signed.data, signed.mac) == chunk(0, "a")
    tampered = signed.data.replace(b'"a"', b'"b"')
    assert macs.opened("r", {0: secret}, tampered, signed.mac) is None
    assert macs.opened("r", {0: ""}, signed.data, signed.mac) is None     # no secret: nothing verifies
    assert not macs.valid(secret, signed.data, "")
