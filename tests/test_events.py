"""The event timeline: events.jsonl beside report.json."""

import dataclasses
import json

import pytest

import elastic_trainer as et
import elastic_trainer.events as timeline
from elastic_trainer_plugins.chaos import Chaos
from elastic_trainer_plugins.scale_down import ScaleDown


def test_events_jsonl_is_the_runs_timeline(tiny_trainer_kwargs, tmp_path):
    run_dir = tmp_path / "run"
    chaos = Chaos(failures=[{"at_step": 3, "slice": 1, "down_for_s": 1e9}])
    result = et.Trainer(
        **tiny_trainer_kwargs(
            steps=6, global_batch_size=24, run_dir=run_dir, strategy=ScaleDown(compile_ahead=False), plugins=[chaos],
            checkpointer=et.Checkpointer(tmp_path / "checkpoints", period=2),
        )
    ).fit()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    records = {kind.event: kind for kind in vars(timeline).values()
               if isinstance(kind, type) and issubclass(kind, timeline.Event) and hasattr(kind, "event")}
    assert {event["event"] for event in events} == {"step", "checkpoint_save", "failure", "recovery", "resize",
                                                      "restore"} and set(records) >= {e["event"] for e in events}
    for event in events:  # each line is its typed record's JSON: a span's fields, or a report record's
        fields = {f.name for f in dataclasses.fields(records[event["event"]])} - {"failure", "resize", "straggler"}
        assert fields <= set(event) - {"event"}
    times = [event["time"] for event in events]
    assert times == sorted(times)
    assert all(event["end"] >= event["time"] for event in events if "end" in event)

    steps = [event for event in events if event["event"] == "step"]
    assert [event["step"] for event in steps] == [1, 2, 3, 4, 5, 6]  # the failed step is not one of them
    assert [len(event["slices"]) for event in steps] == [4, 4, 4, 3, 3, 3]
    assert [event["step"] for event in events if event["event"] == "checkpoint_save"] == [2, 4, 6]

    (failure,) = [event for event in events if event["event"] == "failure"]
    assert (failure["step"], failure["slices"], failure["action"]) == (3, [1], "scale_down")
    (recovery,) = [event for event in events if event["event"] == "recovery"]
    assert recovery["end"] - recovery["time"] == pytest.approx(result.report["failures"][0]["recovery_s"])
    # at the end of the first step after it: within that step, before the step's own end is noted
    assert steps[3]["time"] < recovery["end"] <= steps[3]["end"] + 1e-6  # (+ the float rounding of an epoch time)
    (resize,) = [event for event in events if event["event"] == "resize"]
    assert (resize["slices_before"], resize["slices_after"], resize["reason"]) == (4, 3, "failure")
    (restore,) = [event for event in events if event["event"] == "restore"]
    assert restore["source"] == "replica" and restore["step"] == 3
    assert failure["time"] < resize["time"] < recovery["end"]
