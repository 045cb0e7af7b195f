"""The relay's reorder buffer: chunks in seq order, once each, nothing after the end."""

from pdserve.services.gateway.reorder import Reorder
from pdserve.shared.messages import TokenChunk


def chunk(seq: int, *tokens: int, finished: bool = False) -> TokenChunk:
    return TokenChunk(request_id="r", seq=seq, token_ids=list(tokens), text="", finished=finished)


def test_early_chunks_wait_for_the_gap_then_come_in_order():
    order = Reorder()
    assert [c.seq for c in order.add(chunk(0, 10))] == [0]
    assert list(order.add(chunk(3, 13))) == [] and order.gap
    assert [c.seq for c in order.add(chunk(1, 11, 12))] == [1, 3]
    assert not order.gap and order.generated == [10, 11, 12, 13] and order.next_seq == 4


def test_duplicates_and_chunks_already_passed_are_dropped():
    order = Reorder()
    list(order.add(chunk(0, 10, 11)))
    assert list(order.add(chunk(0, 10, 11))) == []   # the prefill and the decode worker's first tokens
    assert list(order.add(chunk(1, 11))) == []        # inside what was passed on
    assert [c.seq for c in order.add(chunk(2, 12))] == [2]
    assert order.generated == [10, 11, 12]


def test_nothing_is_passed_on_after_the_finishing_chunk():
    order = Reorder()
    list(order.add(chunk(2, 12)))
    out = list(order.add(chunk(0, 10, 11, finished=True)))
    assert [c.seq for c in out] == [0] and order.finished
    assert list(order.add(chunk(3, 13))) == [] and order.generated == [10, 11]


def test_a_moved_stream_forgets_the_old_placements_early_chunks():
    order = Reorder()
    list(order.add(chunk(0, 10)))
    list(order.add(chunk(5, 15)))
    order.forget_waiting()
    assert not order.gap
    assert [c.seq for c in order.add(chunk(1, 11))] == [1] and order.next_seq == 2
