"""``reports/published.html`` (``testbed.report.published_report``) from a hand-made result
object: the goals' sentence, each row's error and run, and the rows again at an unstated
setting with the table's goals at it."""

from __future__ import annotations

from testbed.report.published_report import write_published_report

GOALS = {"median_abs_error": 0.049, "median_met": True, "worst_abs_error": 0.437, "worst_met": False,
         "comparisons_direction_agree": 7, "comparisons": 7, "comparisons_within_magnitude": 3,
         "deepep_worst_abs_error": 0.261, "deepep_met": False, "fitted_share": 0.0, "rows_simulated": 1, "rows": 1}
ROW = {"id": "fold-T3-2", "config": "mixtral-8x22b-128-h100-mcore.toml", "unit": "mfu", "published": 0.463,
       "predicted": 0.445, "error": -0.039, "weak": False, "missing": "", "explanation": "", "step_time_s": 4.505,
       "bubble_fraction": 0.202, "peak_memory_bytes": 61.3e9, "fits": True, "run_dir": "runs/x/run-0001",
       "stage_time_s": {"experts": 0.916, "dense": 0.265}}
COMP = {"id": "strong-scaling", "what": "strong scaling, 128 to 1,024 GPUs", "published": 0.856, "predicted": 0.878,
        "direction_agrees": True, "magnitude_gap": 0.022, "holds": True}
UNSTATED = {"id": "mixtral-8x22b-vpp7", "what": "a virtual pipeline of 7 chunks a stage", "source": "ModelZoo 7f59386",
            "overrides": ["parallelism.pp_chunks=7"], "comparisons": [COMP],
            "rows": [dict(ROW, predicted=0.515, error=0.112, bubble_fraction=0.074, run_dir="runs/x/run-0002"),
                     {"id": "fold-T4-4", "config": "c.toml", "predicted": None, "error": None, "missing": "refused"}],
            "goals": {"median_abs_error": 0.12, "worst_abs_error": 0.437, "comparisons_within_magnitude": 5,
                      "comparisons": 7}}


def test_the_page_shows_the_judged_rows_and_the_unstated_setting_unjudged(tmp_path):
    out = {"goals": GOALS, "rows": [ROW], "comparisons": [COMP], "deepep_comparisons": [], "deepep": [],
           "assumed_constants": [], "quick": True, "unstated": [UNSTATED]}
    html = write_published_report(tmp_path / "published.html", out).read_text()
    assert "Median |error| 4.9% over 1 of 1 rows" in html and "within 5 points 3" in html
    assert "-3.9%" in html and "run-0001" in html
    assert "Unstated settings at another sourced value (not judged)" in html
    assert "Source: ModelZoo 7f59386" in html and "parallelism.pp_chunks=7" in html
    assert "median |error| would be 12.0%" in html and "5 of 7 comparisons within 5 points" in html
    assert "+11.2%" in html and "run-0002" in html and "refused" in html
    assert "0.878" in html


def test_a_result_without_unstated_settings_still_writes(tmp_path):
    """Results written before the unstated settings existed have no ``unstated`` key."""
    out = {"goals": GOALS, "rows": [ROW], "comparisons": [], "deepep_comparisons": [], "deepep": [],
           "assumed_constants": [], "quick": False}
    html = write_published_report(tmp_path / "p.html", out).read_text()
    assert "No unstated setting is listed." in html
