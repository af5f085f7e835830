"""cluster=pathways with pathwaysutils' own elastic module, and a fake health checker in place of TPU slices."""

import jax
import pytest

import elastic_trainer as et
from elastic_trainer_plugins.scale_down import ScaleDown

elastic = pytest.importorskip("pathwaysutils.elastic.elastic")  # the `pathways` extra, part of `test`

PATHWAYS_INDICES = (10, 11, 12, 13)  # Pathways' slice indices need not start at 0
DOWN: set[int] = set()  # Pathways slice indices the fake reports down


class FakeHealthChecker(elastic.SliceHealthChecker):
    """pathwaysutils' checker interface; reports every slice active except those in DOWN."""

    def dispatch(self):
        self.dispatched = True

    def validate(self):
        assert self.dispatched
        return set(self.slice_to_devices) - DOWN


class FakePathways(et.PathwaysCluster):
    """A Pathways job on CPU devices: a step over a slice that is down raises, as Pathways' steps do."""

    def __init__(self):
        devices = jax.devices()
        super().__init__(FakeHealthChecker, slice_to_devices={
            index: devices[2 * i: 2 * i + 2] for i, index in enumerate(PATHWAYS_INDICES)})

    def synchronize(self, call, slices, *, since):
        if any(PATHWAYS_INDICES[s] in DOWN for s in slices):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: the devices of slice 11 are unreachable")


class LoseSlice11:
    @et.hookimpl
    def et_step_start(self, step):
        if step == 3:
            DOWN.add(11)


def test_pathways_health_checks_and_slice_down_errors_drive_scale_down(tiny_trainer_kwargs):
    DOWN.clear()
    cluster = FakePathways()
    assert cluster.describe() == {"kind": "pathways", "slices": 4, "devices_per_slice": 2, "spare_slices": 0}
    assert cluster.healthy_slices() == [0, 1, 2, 3]
    state, report = et.Trainer(**tiny_trainer_kwargs(
        steps=6, global_batch_size=24, cluster=cluster, strategy=ScaleDown(compile_ahead=False), plugins=[LoseSlice11()],
        snapshot_period=1,
    )).fit()
    [failure] = report["failures"]
    # NOT_FOUND is not a slice loss for the built-in classifier: pathwaysutils' rule, through our hook, made it one
    assert (failure["kind"], failure["action"], failure["slices"]) == ("slice_lost", "scale_down", [1])
    # the step raised once it had taken the state (one program over every slice, the state donated): the host
    # snapshot of the step before restores it
    assert (failure["slices_after"], failure["restored_from"], failure["lost_steps"]) == (3, "snapshot", 0)
    assert report["steps_completed"] == 6 and report["cluster"]["kind"] == "pathways"
    DOWN.clear()


def test_pathways_on_cpu_devices_is_a_clear_error():
    with pytest.raises(et.ConfigError, match="cluster=pathways needs devices with a slice index"):
        et.PathwaysCluster().slice_devices()
