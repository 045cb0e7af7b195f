"""The operator's streams (pdserve/shared/streams.py): what the keeper sets again on a stream that drifted
(a release's new limits, fewer copies), and what it leaves (more copies than asked)."""

from nats.js.api import DiscardPolicy, StreamConfig

from pdserve.shared import streams, subjects


def test_a_stream_as_configured_is_left_alone():
    for config in streams.configs(3):
        assert streams.drift(config, config) is None
        as_read = config.evolve(**{k: -1 for k in ("max_msgs", "max_bytes", "max_msgs_per_subject")
                                   if getattr(config, k) is None})   # the server's "unlimited"
        assert streams.drift(as_read, config) is None


def test_limits_and_subjects_that_drifted_are_set_again_and_copies_only_raised():
    wanted = streams.prefill_config(3)
    made = StreamConfig(name=subjects.PREFILL_STREAM, subjects=[subjects.PREFILL_JOBS, "pd.tokens.>"],
                        retention=wanted.retention, max_age=wanted.max_age, storage=wanted.storage,
                        discard=DiscardPolicy.OLD, num_replicas=1)
    fixed = streams.drift(made, wanted)
    assert fixed is not None and fixed.subjects == [subjects.PREFILL_JOBS]
    assert (fixed.max_msgs, fixed.max_bytes, fixed.discard) == (streams.PREFILL_MAX_MSGS, streams.PREFILL_MAX_BYTES,
                                                                DiscardPolicy.NEW)
    assert fixed.num_replicas == 3
    more = wanted.evolve(num_replicas=5)
    assert streams.drift(more, wanted) is None   # a fleet's five copies are not cut to three


def test_the_prefill_stream_refuses_new_jobs_when_full():
    config = streams.prefill_config()
    assert config.discard == DiscardPolicy.NEW and config.max_msgs and config.max_bytes
