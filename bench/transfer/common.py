"""What the transfer arms share (`python -m bench.transfer` and the segment arm, which the
planner's profile also runs): repetitions per payload size, messages under way, the timeout."""

MIB = 1 << 20
NATS_SLOW_CONSUMER = "max_pending: 1073741824\nwrite_deadline: \"60s\"\n"
# messages under way at a time in the UCX arms: the services' sender sends each batch of layers
# as soon as it is computed, without waiting for the one before (pdserve/shared/kv/sender.py)
STREAMED = 4
ARM_TIMEOUT_S = 300  # an arm that has not finished by then is reported failed, its processes killed


def reps_for(size: int) -> int:
    return max(3, min(200, (512 * MIB) // size))
