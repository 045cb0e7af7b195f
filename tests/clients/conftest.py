"""Real clients against the real stack (marker `clients`). Each test carries `works_with(client,
what it runs)`, a row of bench/results/clients.json. A test whose client is installed neither in
a venv of its own (.venv-clients/<name>) nor in the project's is deselected (`make test`: the
openai SDK and LangChain run, the others need `make test-clients`), unless PD_CLIENTS_REQUIRED is
set (`make test-clients`: a client that did not install fails). PD_CLIENTS_RESULTS names the file
the rows go to. The stack is the session's real one (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import venvs
from record import Row, outcome, row_of, write
from steps import MODEL

ROWS: dict[str, Row] = {}


def _client(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("works_with")
    return mark.args[0] if mark else None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PD_CLIENTS_REQUIRED"):
        return
    missing = [i for i in items if _client(i) and venvs.interpreter(_client(i)) is None]
    if missing:
        config.hook.pytest_deselected(items=missing)
        items[:] = [i for i in items if i not in missing]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    ended = report.when == "call" or (report.when == "setup" and not report.passed)
    if ended and item.get_closest_marker("works_with"):
        row = ROWS.setdefault(item.nodeid, row_of(item))
        row.result, row.seconds = outcome(report), round(report.duration, 1)
    return report


def pytest_sessionfinish(session):
    path = os.environ.get("PD_CLIENTS_RESULTS")
    if path and ROWS:
        install = {c: float((venvs.VENVS / c / ".install-seconds").read_text())
                   for c in venvs.PACKAGES if (venvs.VENVS / c / ".install-seconds").exists()}
        write(Path(path), list(ROWS.values()), MODEL, install)


@pytest.fixture
def record(request):
    """record(version=..., numbers={...}) fills this test's row."""
    row = ROWS.setdefault(request.node.nodeid, row_of(request.node))

    def put(version: str = "", **numbers) -> None:
        row.version = version or row.version
        row.numbers.update(numbers)
    return put


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as a Hugging Face directory (tokenizer.json, chat template), converted
    from the GGUF: what guidellm and lm-eval load in place of a Hub id."""
    from transformers import AutoTokenizer

    from pdserve.shared.engine.sources import smollm2_path

    path, out = smollm2_path(), tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return out
