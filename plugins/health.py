"""Built-in slice health check: ask the cluster (as pathwaysutils' SliceHealthChecker asks Pathways)."""

from __future__ import annotations

import elastic_trainer as et
import elastic_trainer.plugin as etp


@et.hookimpl(trylast=True)
def et_slice_health(trainer: etp.RunView) -> list[int]:
    """The slices the cluster reports up."""
    return trainer.cluster.healthy_slices()
