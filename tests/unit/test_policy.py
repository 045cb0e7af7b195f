from pdserve.services.router import policy
from pdserve.services.router.breakers import Breaker
from pdserve.shared.messages import WorkerInfo


def w(wid, role="decode", free=100, running=0, waiting=0, fp="f", growth=0):
    return WorkerInfo(worker_id=wid, role=role, model="m", fingerprint=fp, total_blocks=100,
                      free_blocks=free, running=running, waiting=waiting, growth_blocks=growth)


def test_placement():
    assert policy.placement(500, 0, 0)[0] == "local"
    assert policy.placement(500, 2, 0) == ("remote", "prefill pool")
    mode, reason = policy.placement(10, 2, 64)
    assert mode == "local" and "threshold" in reason


def test_decode_candidates_need_room_and_prefer_the_least_loaded():
    workers = [w("a", running=5), w("b", running=1), w("c", free=2), w("d", running=1, free=50)]
    assert [x.worker_id for x in policy.decode_candidates(workers, blocks_needed=10)] == ["b", "d", "a"]
    assert policy.decode_candidates(workers, blocks_needed=1000) == []


def test_decode_candidates_prefer_room_for_the_expected_output_over_a_lighter_load():
    """a is idle but its streams may still take 85 of its 100 free blocks; b has 1 stream and
    room for this request's prompt and 30 blocks of output on top of its own."""
    workers = [w("a", free=100, growth=85), w("b", free=60, running=1, growth=10)]
    assert [x.worker_id for x in policy.decode_candidates(workers, 10, output_blocks=30)] == ["b", "a"]
    assert [x.worker_id for x in policy.decode_candidates(workers, 10, output_blocks=2)] == ["a", "b"]


def test_a_burst_spreads_over_equal_workers_as_admits_are_counted():
    """Registry entries a heartbeat old show four idle workers: each admit this router made
    since counts as load, so eight requests in a row go two to each, not all to the first."""
    workers = [w(x) for x in "abcd"]
    booked: dict[str, int] = {}
    for _ in range(8):
        best = policy.decode_candidates(workers, blocks_needed=4, booked=booked)[0].worker_id
        booked[best] = booked.get(best, 0) + 1
    assert booked == {"a": 2, "b": 2, "c": 2, "d": 2}
    assert [x.worker_id for x in policy.decode_candidates(workers, 4)][0] == "a"  # without: the same one each time


def test_a_follow_up_turn_goes_back_to_its_kv_unless_that_worker_is_swamped():
    workers = [w("a", running=2), w("b", running=0), w("c", running=1)]
    order = lambda **kw: [x.worker_id for x in policy.decode_candidates(workers, 10, **kw)]  # noqa: E731
    assert order() == ["b", "c", "a"]
    assert order(cached_tokens={"a": 900, "c": 200}, prompt_tokens=1000) == ["a", "b", "c"]
    assert order(cached_tokens={"a": 300}, prompt_tokens=1000) == ["b", "c", "a"]   # a shared preamble only
    assert order(session_worker="c") == ["c", "b", "a"]
    assert order(session_worker="a", affinity_slack=1) == ["b", "c", "a"]          # too busy: move on


def test_prefill_candidates_require_the_same_model_fingerprint_and_count_recent_work():
    pool = [w("p1", "prefill", waiting=3), w("p2", "prefill", waiting=1), w("p3", "prefill", fp="other")]
    pool[0] = pool[0].model_copy(update={"queued_tokens": 300, "prefill_tokens_per_s": 2000.0})
    cands = policy.prefill_candidates(pool, "f", {"p1": (4, 9)}, {"p1": 100, "p2": 50}, default_tokens_per_s=1000)
    assert [(c.worker_id, c.cached_tokens, c.queued_tokens, c.tokens_per_s, c.cache_blocks) for c in cands] == [
        ("p1", 64, 400, 2000.0, 9), ("p2", 0, 50, 1000, 0)]
    assert policy.prefill_candidates(pool, "nope", {}, {}, 1000) == []


def test_prefill_cost_prefers_the_worker_holding_the_prefix_unless_it_is_swamped():
    from pdserve.services.router.policy import PrefillCandidate, choose_soonest, predicted_prefill_s

    warm = PrefillCandidate("warm", cached_tokens=3000, queued_tokens=2000, tokens_per_s=1000)
    idle = PrefillCandidate("idle", cached_tokens=0, queued_tokens=0, tokens_per_s=1000)
    assert predicted_prefill_s(warm, 4000) == 3.0 and predicted_prefill_s(idle, 4000) == 4.0
    assert choose_soonest([idle, warm], 4000)[0].worker_id == "warm"
    swamped = PrefillCandidate("warm", cached_tokens=3000, queued_tokens=60_000, tokens_per_s=1000)
    best, reason = choose_soonest([idle, swamped], 4000)
    assert best.worker_id == "idle" and "0 of 4000 tokens cached" in reason
    # greedy (weight 0) leaves a moderately busy warm worker; the default weight stays with it
    busy = PrefillCandidate("warm", cached_tokens=3000, queued_tokens=5000, tokens_per_s=1000)
    assert choose_soonest([idle, busy], 4000, recompute_weight=0)[0].worker_id == "idle"
    assert choose_soonest([idle, busy], 4000)[0].worker_id == "warm"
    assert choose_soonest([], 10) == (None, "no prefill worker")
    full, empty = (PrefillCandidate(n, 0, 0, 1000, blocks) for n, blocks in (("a", 500), ("b", 20)))
    assert choose_soonest([full, empty], 4000)[0].worker_id == "b"      # a new prefix: the emptier cache


def test_trace_replay_keeps_sessions_on_their_cache():
    """A synthetic conversation trace (7 sessions of 6 growing turns, a shared first block):
    ours reaches the oracle's hit rate, round-robin scatters the sessions."""
    from bench.router_eval import Request, oracle, replay

    requests = []
    for turn in range(6):
        for session in range(7):
            blocks = [0] + [session * 100 + i for i in range(1, 2 + 2 * turn)]   # each turn extends the last
            requests.append(Request(t=turn * 10 + session * 0.5, prompt_tokens=512 * len(blocks), hash_ids=blocks))
    ours = replay(requests, "ours", workers=4, cache_blocks=256, tokens_per_s=5000)
    rr = replay(requests, "round_robin", workers=4, cache_blocks=256, tokens_per_s=5000)
    best = oracle(requests)["hit_rate"]
    assert ours["hit_rate"] >= 0.95 * best and ours["hit_rate"] > 1.5 * rr["hit_rate"], (ours, rr, best)


def test_admission_refuses_what_would_miss_the_objective_and_says_when_to_retry():
    assert policy.within_objective(3.0, 0) == (True, 0.0, "")
    assert policy.within_objective(3.0, 5.0)[0] is True
    ok, retry, why = policy.within_objective(12.5, 5.0)
    assert not ok and retry == 7.5 and "12.5 s exceeds the 5 s objective" in why
    assert policy.within_objective(5.2, 5.0)[1] == 1.0


def test_local_prefill_when_the_pool_would_queue_it_or_holds_less_of_it_and_local_is_cheaper():
    free = policy.PrefillCandidate("p", cached_tokens=0, queued_tokens=0, tokens_per_s=1000)
    busy = free._replace(queued_tokens=3000)  # a long prompt under way there
    # the pool can start it soon and holds as much of it: it goes there, even with an idle decode worker
    mode, why = policy.local_or_remote(40, 0, 0, 1000, free)
    assert mode == "remote" and "0 tokens queued before its 40" in why
    assert policy.local_or_remote(40, 0, 0, 1000, free._replace(queued_tokens=160))[0] == "remote"  # 4 x its own
    assert policy.local_or_remote(40, 0, 0, 1000, free._replace(queued_tokens=161))[0] == "local"
    # behind a long prompt: a short one is prefilled beside the decode worker's streams
    assert policy.local_or_remote(40, 0, 4, 1000, busy)[0] == "local"
    # ... unless the stall of many streams costs more than the wait
    mode, why = policy.local_or_remote(400, 0, 8, 1000, busy._replace(queued_tokens=2000))
    assert mode == "remote" and "8 streams" in why
    # a long prompt mostly cached on the decode worker (a follow-up turn) stays local, pool free or not
    assert policy.local_or_remote(4000, 3968, 2, 1000, free)[0] == "local"
    assert policy.local_or_remote(40, 0, 0, 1000, None) == ("local", "no prefill worker available")


def test_a_breaker_opens_on_repeated_transfer_failures_then_probes_and_closes():
    b = Breaker(failures=3, window_s=10, cooldown_s=5)
    for t in (0, 1):
        b.record(False, t)
    assert b.allow(2) and b.state == "closed"          # 2 failures: still closed
    b.record(True, 2)
    b.record(False, 3)                                  # 3 of 4 failed
    assert b.state == "open" and not b.allow(4) and not b.allow(7.9)
    assert b.allow(8.1)                                 # one probe after the cooldown...
    b.chosen(8.1)
    assert b.state == "half-open" and not b.allow(8.2)  # ...at a time
    b.record(False, 9)                                  # the probe failed: open again
    assert not b.allow(10) and b.allow(14.5)
    b.chosen(14.5)
    b.record(True, 15)                                  # the probe went through: closed
    assert b.state == "closed" and b.allow(15) and b.allow(15)


def test_old_failures_leave_the_window_and_successes_outweigh_failures():
    b = Breaker(failures=3, window_s=10, cooldown_s=5)
    for t in (0, 1, 2):
        b.record(False, t)
    assert b.state == "open"
    b = Breaker(failures=3, window_s=10, cooldown_s=5)
    for t in (0, 1):
        b.record(False, t)
    b.record(False, 20)                                 # the first two are out of the window
    assert b.state == "closed"
    for t in range(21, 26):
        b.record(True, t)
    for t in (26, 27):
        b.record(False, t)
    assert b.state == "closed"                          # 3 failures among 8: a healthy path


def test_pools_split_the_registry_per_model_and_the_redis_index_names_each_slots_worker():
    from pdserve.services.router.indexes import RedisIndex
    from pdserve.services.router.pools import EMPTY, pools

    def w(wid, role, model, slot):
        return WorkerInfo(worker_id=wid, role=role, model=model, block_size=32, prefix_slot=slot, cached_blocks=slot)
    got = pools([w("p1", "prefill", "a", 3), w("d1", "decode", "a", 0), w("d2", "decode", "a", 7),
                 w("p2", "prefill", "b", 5)])
    a, b = got["a"], got["b"]
    assert [x.worker_id for x in a.prefills] == ["p1"] and [x.worker_id for x in a.decodes] == ["d1", "d2"]
    slots = RedisIndex(None, "r", 1.0).slots(a)  # type: ignore[arg-type]
    assert {s: x.worker_id for s, x in slots.items()} == {3: "p1", 7: "d2"}   # slot 0: none (lost)
    assert a.block_size == 32 and EMPTY.block_size == 16 and not EMPTY.workers
    assert [x.worker_id for x in b.workers] == ["p2"] and set(got) == {"a", "b"}
    # a lookup's answer by slot, turned into the holders alone (a slot nobody names is dropped)
    from pdserve.shared import prefix_index
    assert prefix_index.by_worker(slots, {3: 4, 9: 2}) == {"p1": (4, 3)}


def test_best_decode_is_the_rankings_first_on_any_pool():
    """The simulator's one-pass choice (best_decode) against the router's ranking, on random
    pools with and without sessions, cached prefixes and bookings (ties included)."""
    import random
    rng = random.Random(7)
    for _ in range(500):
        pool = [w(f"w{i}", free=rng.choice([0, 5, 50, 100]), running=rng.randrange(4), waiting=rng.randrange(2),
                  growth=rng.choice([0, 10, 60])) for i in range(rng.randrange(1, 9))]
        kw = rng.choice([{}, {"cached_tokens": {"w0": 600}, "prompt_tokens": 1000}, {"session_worker": "w1"},
                         {"booked": {"w2": 3}}])
        need, out = rng.choice([1, 10, 60]), rng.choice([0, 20])
        ranked = policy.decode_candidates(pool, need, output_blocks=out, **kw)
        assert policy.best_decode(pool, need, output_blocks=out, **kw) is (ranked[0] if ranked else None)
