"""Calibration: collectives measured on real gloo processes fit the cost model's alpha-beta link."""
import pytest

import egraph_did as ed
from egraph_did.calibrate import (KINDS, Measurement, calibrated, fit_link, load_preset, measure_collectives,
                                  predicted, save_preset)


def _measure(rank):
    return measure_collectives(sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 20), iters=5)


def test_fit_recovers_a_known_link_exactly():
    truth = ed.CostModel.h200()
    ms = [Measurement(k, n, 8, truth.collective_time(k, n, 8, 0, 1)) for k in KINDS for n in (1e3, 1e5, 1e7, 1e9)]
    link = fit_link(ms)
    assert link.alpha == pytest.approx(truth.links[0].alpha, rel=1e-6)
    assert link.bandwidth == pytest.approx(truth.links[0].bandwidth, rel=1e-6)


def test_gloo_collectives_calibrate_a_preset_that_round_trips(tmp_path):
    (ms, _) = ed.launch(_measure, 2, "gloo", timeout=120)
    assert {m.kind for m in ms} == set(KINDS) and all(m.seconds > 0 and m.group_size == 2 for m in ms)
    link = fit_link(ms, "gloo-loopback")
    assert link.alpha > 0 and link.bandwidth > 0
    model = calibrated(ed.CostModel.h200(), [link])
    # the fit is the weighted least-squares optimum on these measurements (timings on a loaded 2-core
    # machine are noisy, so no claim on how well a line fits them): every nearby link fits worse
    def error(lk):
        m2 = calibrated(ed.CostModel.h200(), [lk])
        return sum(((predicted(m2, m) - m.seconds) / m.seconds) ** 2 for m in ms)
    best = error(link)
    for fa, fb in ((1.2, 1), (1 / 1.2, 1), (1, 1.2), (1, 1 / 1.2)):
        near = ed.Link("near", alpha=link.alpha * fa, bandwidth=link.bandwidth * fb)
        assert error(near) >= best * (1 - 1e-9)
    path = tmp_path / "preset.json"
    save_preset(model, str(path))
    assert load_preset(str(path)) == model
