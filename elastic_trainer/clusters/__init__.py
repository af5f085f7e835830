"""Clusters: where the devices come from, how they group into slices, and how slices are lost.

For backend authors: the abstract clusters a new backend subclasses, and the
helpers the trainer reads a cluster through. A user picks a cluster from
``elastic_trainer`` (``et.SimulatedCluster``, ``et.MultiprocessCluster``,
``et.PathwaysCluster``); ``docs/clusters.md`` says what a backend provides.
"""

from ._base import (
    AbstractCluster as AbstractCluster,
    AbstractInjectableCluster as AbstractInjectableCluster,
    AbstractMultiControllerCluster as AbstractMultiControllerCluster,
    AbstractProcessInjectableCluster as AbstractProcessInjectableCluster,
    AbstractRejoinCluster as AbstractRejoinCluster,
    AbstractSpareCluster as AbstractSpareCluster,
    AbstractTimedCluster as AbstractTimedCluster,
    SyncCall as SyncCall,
    admission_of as admission_of,
    has_spares as has_spares,
    mesh_slice_count as mesh_slice_count,
    vital_slices as vital_slices,
    release as release,
    returning_slices as returning_slices,
)
from .multicontroller import Admission as Admission, MultiprocessCluster as MultiprocessCluster
from ._pathways import PathwaysCluster as PathwaysCluster
from ._simulated import SimulatedCluster as SimulatedCluster

__all__ = [
    "AbstractCluster",
    "AbstractInjectableCluster",
    "AbstractMultiControllerCluster",
    "AbstractProcessInjectableCluster",
    "AbstractRejoinCluster",
    "AbstractSpareCluster",
    "AbstractTimedCluster",
    "Admission",
    "SyncCall",
    "admission_of",
    "has_spares",
    "mesh_slice_count",
    "release",
    "returning_slices",
    "vital_slices",
]
