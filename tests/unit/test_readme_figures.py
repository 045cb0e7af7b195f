"""docs/RESULTS.md's generated figures are the committed results' (a hand edit or a stale block fails)."""

import json

import pytest

from bench import clients_readme, stack_overhead, store_memory
from bench.chaos import readme as chaos_readme
from bench.engine import readme as engine_readme
from bench.interference import report
from bench.planning import readme as plan_readme
from bench.results_doc import RESULTS_DOC
from bench.scale import index_readme
from bench.scale import readme as scale_readme

RESULTS = RESULTS_DOC.parents[1] / "bench" / "results"


def _between(begin: str, end: str) -> str:
    text = RESULTS_DOC.read_text()
    assert begin in text and end in text, f"{RESULTS_DOC} has no {begin} ... {end} block"
    return text.split(begin, 1)[1].split(end, 1)[0]


def _json(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_the_chaos_figures_are_the_committed_runs():
    assert chaos_readme.current() in RESULTS_DOC.read_text()


def test_the_engine_figures_are_the_committed_run():
    assert _between(engine_readme.BEGIN, engine_readme.END) == "\n" + engine_readme.block(_json("engine.json")) + "\n"


def test_the_interference_figures_are_the_committed_run():
    for name in ("interference.json", "interference-gemma3-270m.json"):
        if (RESULTS / name).exists() or name == "interference.json":
            data = _json(name)
            assert _between(*report.markers(data)) == "\n" + report.section(data) + "\n"


def test_the_scale_figures_are_the_committed_run():
    assert _between(scale_readme.BEGIN, scale_readme.END) == "\n" + scale_readme.section(_json("scale.json")) + "\n"


def test_the_store_figures_are_the_committed_run():
    assert _between(scale_readme.STORES_BEGIN, scale_readme.STORES_END) == "\n" + scale_readme.stores_section(
        _json("scale_stores.json")) + "\n"


def test_the_architectures_table_is_the_committed_run():
    architectures = pytest.importorskip("bench.engine.architectures")
    assert _between(architectures.BEGIN, architectures.END) == "\n" + architectures.table(
        _json("architectures.json")) + "\n"


def test_the_works_with_tables_are_the_committed_runs():
    assert clients_readme.current() in clients_readme.README.read_text()
    assert clients_readme.current(clients_readme.detail) in clients_readme.DETAIL.read_text()


def test_the_capacity_planning_figures_are_the_committed_runs():
    assert _between(plan_readme.BEGIN, plan_readme.END) == "\n" + plan_readme.section(plan_readme.committed()) + "\n"


def test_the_prefix_index_table_is_the_committed_run():
    assert _between(index_readme.BEGIN, index_readme.END) == "\n" + index_readme.table(
        _json("prefix_index_compare.json")) + "\n"


def test_the_request_path_figures_are_the_committed_run():
    block = stack_overhead.section(_json("stack.json"))
    assert _between(stack_overhead.BEGIN, stack_overhead.END) == "\n" + block + "\n"


def test_the_redis_per_request_figures_are_the_committed_run():
    block = store_memory.section(_json("store.json"))
    assert _between(store_memory.BEGIN, store_memory.END) == "\n" + block + "\n"
