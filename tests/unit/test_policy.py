from services.router import policy
from shared.messages import WorkerInfo


def w(wid, role="decode", free=100, running=0, waiting=0, fp="f"):
    return WorkerInfo(worker_id=wid, role=role, model="m", fingerprint=fp, total_blocks=100,
                      free_blocks=free, running=running, waiting=waiting)


def test_prefill_mode():
    assert policy.prefill_mode(500, 0, 0)[0] == "local"
    assert policy.prefill_mode(500, 2, 0) == ("remote", "prefill pool")
    mode, reason = policy.prefill_mode(10, 2, 64)
    assert mode == "local" and "threshold" in reason


def test_decode_candidates_need_room_and_prefer_the_least_loaded():
    workers = [w("a", running=5), w("b", running=1), w("c", free=2), w("d", running=1, free=50)]
    assert [x.worker_id for x in policy.decode_candidates(workers, blocks_needed=10)] == ["b", "d", "a"]
    assert policy.decode_candidates(workers, blocks_needed=1000) == []


def test_prefill_choice_requires_the_same_model_fingerprint():
    pool = [w("p1", "prefill", waiting=3), w("p2", "prefill", waiting=1), w("p3", "prefill", fp="other")]
    assert policy.choose_prefill(pool, "f").worker_id == "p2"
    assert policy.choose_prefill(pool, "nope") is None
