import time

import pytest

import elastic_trainer.plugin as etp


def test_categories_add_up_to_wall_time():
    clock = etp.GoodputClock(started_at=time.time() - 0.05)
    with clock.measure("compile"):
        time.sleep(0.02)
    with clock.measure("productive"):
        time.sleep(0.03)
    time.sleep(0.01)
    clock.stop()
    summary = clock.summary()
    assert summary["badput_s"]["startup"] >= 0.05
    assert summary["badput_s"]["compile"] >= 0.02
    assert summary["badput_s"]["other"] >= 0.01
    assert summary["productive_s"] + sum(summary["badput_s"].values()) == pytest.approx(summary["wall_s"])
    assert set(summary["badput_s"]) == set(etp.BADPUT_CATEGORIES)


def test_unknown_category_is_refused():
    with pytest.raises(ValueError, match="unknown goodput category 'lunch'"):
        with etp.GoodputClock().measure("lunch"):
            pass
