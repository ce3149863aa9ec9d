"""The sweep page opens with what its points show, computed from them."""

from testbed.report.sweep import speedup_figure, sweep_findings


def point(label, sim, measured, baseline=False, base=(0.010, 0.100)):
    return {"label": label, "baseline": baseline, "sim_step_s": sim, "measured_step_s": measured,
            "sim_speedup": None if sim is None else base[0] / sim,
            "measured_speedup": None if measured is None else base[1] / measured,
            "measured_speedup_range": None if measured is None else (base[1] / measured, base[1] / measured)}


def test_findings_name_the_fastest_point_of_each_backend_and_whether_they_agree():
    pts = [point("a=1", 0.010, 0.100, baseline=True), point("a=2", 0.008, 0.090), point("a=3", 0.009, 0.080)]
    assert sweep_findings(pts, skipped=1) == [
        "Fastest simulated point: a=2 (8.00 ms, x1.250 over the baseline).",
        "Fastest measured point: a=3 (80.00 ms, x1.250 over the baseline).",
        "The simulator's fastest point measured 2nd fastest of 3.",
        "1 point(s) of the grid are not valid scenarios (listed at the end).",
    ]
    pts[2]["measured_step_s"] = 0.095
    assert sweep_findings(pts)[2] == "The simulator picks the point that measured fastest."
    sim_only = [point("a=1", 0.010, None, baseline=True), point("a=2", 0.020, None)]
    assert sweep_findings(sim_only) == ["Fastest simulated point: a=1 (10.00 ms)."]


def test_the_speedup_scatter_labels_every_point():
    pts = [point("a=1", 0.010, 0.100, baseline=True), point("a=2", 0.008, 0.090)]
    trace = speedup_figure(pts).data[0]
    assert list(trace.text) == ["a=1", "a=2"] and "text" in trace.mode and trace.name != "point"
