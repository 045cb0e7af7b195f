"""The README's generated figures are the committed results' (a hand edit or a stale block fails)."""

from bench import chaos_readme


def test_the_readmes_chaos_figures_are_the_committed_runs():
    assert chaos_readme.current() in chaos_readme.README.read_text()
