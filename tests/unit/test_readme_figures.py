"""The README's generated figures are the committed results' (a hand edit or a stale block fails)."""

from bench import chaos_readme, clients_readme


def test_the_readmes_chaos_figures_are_the_committed_runs():
    assert chaos_readme.current() in chaos_readme.README.read_text()


def test_the_readmes_works_with_table_is_the_committed_runs():
    assert clients_readme.current() in clients_readme.README.read_text()
