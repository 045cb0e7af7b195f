"""KV transfer between processes (`make bench-transfer`, `python -m bench.transfer`): each
transport's arm, the peer libraries' arms, the handoff and int8 KV's quality."""
