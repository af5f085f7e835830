"""The protocols plugins rely on: the view of the run that hooks receive, and what a strategy declares."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from .checkpoints._checkpointer import Checkpointer
    from .clusters import AbstractCluster
    from ._ledger import SampleLedger


class RunView(Protocol):
    """What every hook's ``trainer`` argument has, in :class:`~elastic_trainer.Trainer` and
    :class:`~elastic_trainer.ElasticRun` alike (plugins read nothing else of the run)."""

    cluster: AbstractCluster
    """The slices, their health and, for failure injection, a way to lose them."""
    run_dir: Path | None
    """Where plugins write files (``report.json``), or ``None``."""

    @property
    def slices(self) -> tuple[int, ...]:
        """The slices in use."""

    @property
    def mesh(self) -> Mesh | None:
        """Their ``(slice, device)`` mesh."""


class TrainerView(RunView, Protocol):
    """What ``trainer`` has besides when the :class:`~elastic_trainer.Trainer` runs the loop."""

    steps: int
    """Train until this many steps are completed."""
    global_batch_size: int
    """Samples per step over all devices."""
    checkpointer: Checkpointer | None
    """The run's checkpoints, or ``None``."""

    @property
    def ledger(self) -> SampleLedger | None:
        """The samples of the committed steps."""

    @property
    def stragglers(self) -> frozenset[int]:
        """The slices found slower than the others (``trainer.straggler_factor``), not recovered since."""


@runtime_checkable
class Strategy(Protocol):
    """A strategy: a plugin implementing ``et_choose_recovery``, named in the report by ``name``."""

    name: str
    """The report's ``strategy`` (its class name when missing)."""


@runtime_checkable
class RestartingStrategy(Protocol):
    """A strategy whose plans may restart the worker process (``RecoveryPlan(restart_process=True)``).

    The command line then runs the training in worker processes under a
    supervisor that starts a new one each time a worker asks for it, at most
    ``max_restarts`` times; it does so when ``restarts_process`` is true.
    """

    restarts_process: bool
    max_restarts: int


def restarts_process(strategy: object) -> bool:
    """Whether ``strategy`` declares that it restarts the worker process (:class:`RestartingStrategy`)."""
    return isinstance(strategy, RestartingStrategy) and strategy.restarts_process
