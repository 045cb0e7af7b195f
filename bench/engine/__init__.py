"""The engine against transformers and llama.cpp (`make bench-engine`, `python -m bench.engine`):
speed, quality, structured output, each architecture (tiny random checkpoints), grammar libraries."""
