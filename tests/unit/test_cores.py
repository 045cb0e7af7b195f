"""Cores lent between the workers of one host (pdserve/shared/cores.py): a decode worker steps on
a prefill worker's threads only while that worker is between passes, one borrower at a time,
and a dead borrower's hold ends."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from pdserve.shared.cores import Board, Borrower, Lender, Share


def test_a_borrower_holds_an_idle_lenders_threads_until_its_next_pass(tmp_path):
    board = Board(tmp_path / "cores")
    lender, borrower = Lender(board, "prefill-0", 3), Borrower(board, 1)
    assert borrower.threads() == 1, "a lender is busy until its first step says otherwise"
    lender.working(False)
    assert borrower.threads() == 4
    assert board.read(lender.slot)[3] == os.getpid()
    lender.working(True)
    assert borrower.threads() == 1, "threads go back at the lender's next pass"
    assert board.read(lender.slot)[3] == 0
    lender.working(False)
    assert borrower.threads() == 4
    borrower.give_back()
    assert board.read(lender.slot)[3] == 0 and borrower.lent == 0


def test_one_borrower_at_a_time_and_each_lender_once(tmp_path):
    board = Board(tmp_path / "cores")
    a, b = Lender(board, "prefill-0", 1), Lender(board, "prefill-1", 2)
    assert (a.slot, b.slot) == (0, 1)
    assert Lender(board, "prefill-0", 1).slot == 0, "a restarted lender takes its own slot back"
    for lender in (a, b):
        lender.working(False)
    first, second = Borrower(board, 1), Borrower(board, 1)
    second.pid = 1   # (another live process of the host)
    assert first.threads() == 2 and second.threads() == 3, "each takes a different lender's threads"
    assert Borrower(board, 1).threads() == 1, "nothing left to borrow"


def _hold(path: str) -> None:
    Borrower(Board(path), 1).threads()


def test_a_dead_borrowers_hold_ends(tmp_path):
    board = Board(tmp_path / "cores")
    lender = Lender(board, "prefill-0", 1)
    lender.working(False)
    child = mp.get_context("fork").Process(target=_hold, args=(str(tmp_path / "cores"),))
    child.start()
    child.join()
    assert board.read(lender.slot)[3] == child.pid, "the child held the lender's threads when it died"
    assert Borrower(board, 1).threads() == 2


def test_a_decode_share_sets_the_steps_threads_and_a_prefill_share_marks_its_passes(tmp_path):
    before = torch.get_num_threads()
    try:
        prefill = Share(tmp_path / "cores", "prefill", "prefill-0", 1)
        decode = Share(tmp_path / "cores", "decode", "decode-0", 1)
        assert prefill.lender is not None and prefill.lender.busy
        prefill.after_step(has_work=False)
        decode.before_step()
        assert torch.get_num_threads() == 2 and decode.threads == 2
        prefill.before_step()
        decode.before_step()
        assert torch.get_num_threads() == 1
        prefill.after_step(has_work=False)
        decode.before_step()
        decode.after_step(has_work=False)
        assert decode.borrower is not None and decode.borrower.held is None, "an idle decode worker gives back"
    finally:
        torch.set_num_threads(before)


def test_a_borrow_and_its_return_never_rewrite_the_lenders_busy_byte(tmp_path):
    board = Board(tmp_path / "cores")
    lender, borrower = Lender(board, "prefill-0", 1), Borrower(board, 1)
    lender.working(False)
    assert borrower.threads() == 2
    read = board.read

    def read_then_pass_starts(i: int) -> tuple[str, int, bool, int]:
        slot = read(i)
        board.set_busy(lender.slot, True)   # (the lender's pass starts between the borrower's read and write)
        return slot

    board.read = read_then_pass_starts  # type: ignore[method-assign]
    borrower.give_back()
    board.read = read  # type: ignore[method-assign]
    assert board.read(lender.slot) == ("prefill-0", 1, True, 0)
