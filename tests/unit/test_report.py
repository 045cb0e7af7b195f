"""The benchmark report: the README section and the plots come from the JSON's numbers, and
only the text between the markers changes."""

from __future__ import annotations

from bench.interference import report
from bench.results_doc import update_block


def _arm(itl_p99: float, gap: float, points: list[tuple[float, float]], rate: float) -> dict:
    pct = lambda x: {"mean": x, "p50": x, "p90": x, "p99": x}  # noqa: E731
    return {"victims": {"itl_s": {**pct(0.05), "p99": itl_p99}, "max_gap_s": gap, "ttft_s": pct(0.2),
                        "tpot_s": pct(0.06)},
            "victim_itls_s": [0.05, 0.06, itl_p99],
            "timeline": {"victims": [[0.1, 0.2, 0.3]], "aggressors": [[0.15, 0.9]]},
            "replay": {"points": [{"rate": r, "slo_attainment": a} for r, a in points], "goodput_rate": rate}}


DATA = {
    "machine": {"cpus": 2, "platform": "Linux-test"}, "mode": "quick",
    "workload": {"victims_and_aggressors": {"duration_s": 40, "victim_rate": 0.3, "aggressor_rate": 0.05,
                                            "requests": 14, "victim": "32-token prompt, 128 output tokens",
                                            "aggressor": "1024-token prompt, 4 output tokens"},
                 "replay": {"seconds_per_rate": 20, "scale": 8, "rates": [0.5, 1.0], "mean_prompt_tokens": 113,
                            "mean_output_tokens": 29, "slo": {"ttft_s": 2.0, "tpot_s": 0.15}}},
    "arms": {"colocated": _arm(0.321, 1.64, [(0.5, 0.95), (1.0, 0.5)], 0.61),
             "chunked": _arm(0.2, 0.43, [(0.5, 1.0), (1.0, 0.8)], 0.83),
             "disaggregated": _arm(0.079, 0.13, [(0.5, 1.0), (1.0, 0.95)], 1.0)},
    "summary": {"itl_p99_colocated_over_disagg": 4.063, "itl_p99_chunked_over_disagg": 2.532,
                "itl_p999_colocated_over_disagg": 12.0, "itl_p999_chunked_over_disagg": 3.0,
                "itl_p999_s": {"colocated": 1.2, "chunked": 0.3, "disaggregated": 0.1},
                "max_gap_disagg_s": 0.13, "ttft_p50_disagg_over_colocated": 1.0,
                "ttft_p99_victims_over_alone_disagg": 1.25,
                "ttft_victims_s": {a: {"victims": {"p50": 0.2, "p99": 0.5, "p99.9": 0.6},
                                       "alone": {"p50": 0.2, "p99": 0.4, "p99.9": 0.45}}
                                   for a in ("colocated", "chunked", "disaggregated")},
                "goodput_disagg_over_colocated": 1.639, "goodput_disagg_over_chunked": None},
}


def test_the_section_carries_the_machine_the_scale_each_arm_and_each_ratio():
    text = report.section(DATA)
    assert "2 CPU cores (Linux-test)" in text and "lengths ÷ 8" in text
    assert "| colocated | 50 | 321 | 1200 | 1.64 | 0.20 | 0.50 | 0.60 | 0.40 | 60 |" in text
    assert "| `ttft_p99_victims_over_alone_disagg` (≤ 2) | 1.25 |" in text
    assert "| disaggregated | 1.00 | 0.95 | 1.00 |" in text            # attainment per rate, goodput
    assert "| `goodput_disagg_over_colocated` (≥ 1.5) | 1.639 |" in text
    assert "| `goodput_disagg_over_chunked` (reported) | n/a |" in text


def test_only_the_text_between_the_markers_is_replaced(tmp_path):
    readme = tmp_path / "README.md"
    begin, end = report.markers(DATA)
    readme.write_text(f"# title\nbefore\n{begin}\nold figures\n{end}\nafter\n")
    update_block(readme, begin, end, "new figures")
    assert readme.read_text() == f"# title\nbefore\n{begin}\nnew figures\n{end}\nafter\n"


def test_the_plots_are_written(tmp_path):
    for plot in (report.plot_itl_cdf, report.plot_timeline, report.plot_goodput):
        path = tmp_path / f"{plot.__name__}.png"
        plot(DATA, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_remote_placement_gets_a_victims_row_when_measured():
    arms = {**DATA["arms"], "disaggregated-remote": _arm(0.09, 0.15, [], 0.0)}
    ttft = {**DATA["summary"]["ttft_victims_s"],
            "disaggregated-remote": {"victims": {"p50": 0.3, "p99": 4.0, "p99.9": 4.5},
                                     "alone": {"p50": 0.2, "p99": 0.4, "p99.9": 0.45}}}
    text = report.section({**DATA, "arms": arms, "summary": {**DATA["summary"], "ttft_victims_s": ttft,
                                                             "itl_p999_s": {**DATA["summary"]["itl_p999_s"],
                                                                            "disaggregated-remote": 0.2}}})
    assert "| disaggregated-remote | 50 | 90 | 200 | 0.15 | 0.30 | 4.00 | 4.50 | 0.40 | 60 |" in text
    assert "| `ttft_p99_victims_over_alone_disagg_remote` (reported) | n/a |" in text
