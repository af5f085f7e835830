"""Failure injection from Python: ``from elastic_trainer.chaos import Chaos``.

``Chaos(failures=[{"at_step": 30, "slice": 1}])`` is a plugin that loses slice 1
during step 30, through the cluster (an
``elastic_trainer.clusters.AbstractInjectableCluster``), the way hardware loses it; pass it in ``et.Trainer(plugins=[...])``. It is the
plugin behind ``+chaos=`` on the command line (``plugins/chaos.py``).
"""

from elastic_trainer_plugins.chaos import Chaos as Chaos, ScheduledFailure as ScheduledFailure

__all__ = ["Chaos", "ScheduledFailure"]
