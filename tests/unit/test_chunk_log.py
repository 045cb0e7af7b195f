"""A decode worker's published chunks, kept for a gateway that lost some on the bus."""

from pdserve.services.decode.chunk_log import ChunkLog
from pdserve.shared import macs
from pdserve.shared.messages import TokenChunk

SECRET = macs.new_secret()


class Log(ChunkLog):
    """Records a chunk as the decode worker does (signed), and gives back the chunks kept."""

    def record(self, chunk):
        super().record(chunk, macs.sign(chunk, SECRET))

    def since(self, *args, **kw):
        kept = super().since(*args, **kw)
        return None if kept is None else [TokenChunk.decode(s.data) for s in kept]


def chunk(rid, seq, n=1, finished=False):
    return TokenChunk(request_id=rid, seq=seq, token_ids=list(range(seq, seq + n)), text="x", finished=finished)


def test_chunks_from_a_seq_on_include_the_one_that_holds_it():
    log = Log()
    for c in (chunk("a", 0), chunk("a", 1, n=3), chunk("a", 4), chunk("b", 0)):
        log.record(c)
    assert [c.seq for c in log.since("a", 0)] == [0, 1, 4]
    assert [c.seq for c in log.since("a", 2)] == [1, 4]      # token 2 is inside the chunk at seq 1
    assert log.since("a", 5) == []                          # nothing missing: nothing to send
    assert log.since("unknown", 0) is None


def test_what_left_the_window_or_came_before_this_placement_is_refused():
    log = Log(window=3)
    for seq in range(5):
        log.record(chunk("a", seq))
    assert log.since("a", 1) is None and [c.seq for c in log.since("a", 2)] == [2, 3, 4]
    resumed = Log()
    resumed.record(chunk("r", 7))                           # a failover placement: tokens 0-6 were made elsewhere
    assert resumed.since("r", 3) is None and len(resumed.since("r", 7)) == 1


def test_finished_requests_are_kept_for_a_while_and_cancelled_ones_not_at_all():
    now = [0.0]
    log = Log(keep_s=10, clock=lambda: now[0])
    log.record(chunk("done", 0))
    log.record(chunk("done", 1, finished=True))
    log.record(chunk("gone", 0))
    log.forget("gone")
    now[0] = 9
    assert [c.seq for c in log.since("done", 1)] == [1] and log.since("gone", 0) is None
    now[0] = 11
    assert log.since("done", 1) is None and not log.finished


def test_a_request_placed_here_that_published_nothing_yet_lost_nothing():
    log = Log()
    assert log.since("waiting", 1, placed=True) == []       # its KV (and first token) not in yet
    assert log.since("waiting", 1) is None                  # not here: the gateway must move it
    log.record(chunk("waiting", 1))
    log.record(chunk("waiting", 2))
    assert [c.seq for c in log.since("waiting", 2, placed=True)] == [2]
    assert log.since("waiting", 0, placed=True) is None     # seq 0 was the prefill worker's: not here
