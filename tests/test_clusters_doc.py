"""docs/clusters.md names every member a cluster, a capability and a platform layer provide, and every file it
links exists."""

import re
from pathlib import Path

import pytest

import elastic_trainer as et
from elastic_trainer.clusters import (
    AbstractCluster, AbstractInjectableCluster, AbstractMultiControllerCluster, AbstractProcessInjectableCluster,
    AbstractRejoinCluster, AbstractSpareCluster, AbstractTimedCluster,
)
from elastic_trainer.clusters.multicontroller._platform import PLATFORM_LAYERS, PlatformLayer

DOC = Path(__file__).parents[1] / "docs" / "clusters.md"


def public_members(cls, *, below=object):
    """The public attributes and methods ``cls`` defines itself (not those of ``below`` and its bases)."""
    inherited = set(dir(below))
    return sorted(name for name in vars(cls) if not name.startswith("_") and name not in inherited) + sorted(
        name for name in getattr(cls, "__annotations__", {}) if not name.startswith("_"))


@pytest.mark.parametrize(("cls", "below"), [
    (AbstractCluster, object),
    (AbstractTimedCluster, AbstractCluster),
    (AbstractMultiControllerCluster, AbstractCluster),
    (AbstractRejoinCluster, AbstractMultiControllerCluster),
    (AbstractInjectableCluster, AbstractCluster),
    (AbstractProcessInjectableCluster, AbstractInjectableCluster),
    (AbstractSpareCluster, AbstractCluster),
    (PlatformLayer, object),
])
def test_every_member_is_named(cls, below):
    text = DOC.read_text()
    members = set(public_members(cls, below=below))
    assert members
    assert [name for name in sorted(members) if f"`{name}`" not in text] == []


def test_every_platform_layer_is_named():
    text = DOC.read_text()
    assert [type(layer).__name__ for layer in PLATFORM_LAYERS.values() if f"`{type(layer).__name__}`" not in text] == []


def test_every_linked_file_exists():
    links = re.findall(r"\]\((\.\./[^)]+)\)", DOC.read_text())
    assert len(links) > 10
    assert [link for link in links if not (DOC.parent / link).exists()] == []


def test_the_core_is_small_and_capabilities_are_asked_for_with_isinstance():
    assert public_members(AbstractCluster) == [
        "configure_jax", "describe", "healthy_slices", "incarnations", "slice_devices", "synchronize", "kind"]
    assert not isinstance(et.SimulatedCluster(slices=2, devices_per_slice=1), AbstractMultiControllerCluster)
    assert issubclass(et.MultiprocessCluster, AbstractRejoinCluster)
    assert issubclass(et.MultiprocessCluster, AbstractTimedCluster)
