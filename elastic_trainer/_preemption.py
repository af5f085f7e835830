"""Preemption: SIGTERM, Ctrl-C or a signal of one's choice stops training at a step boundary, with a checkpoint.

A signal handler only notes the signal; the trainer's loop asks
:meth:`PreemptionWatch.stops_at` at every step boundary, saves the last
committed step and raises :class:`Preempted`. The command line then exits with
:func:`exit_status` (128 + the signal's number: 143 for SIGTERM, 130 for
Ctrl-C), what a shell, Slurm and Kubernetes report for a process that the
signal ended, so that whatever watches the job sees the termination it caused
(and a supervisor never takes it for a request to restart, 75).

With several JAX processes every one of them must stop at the same step, or
their last saves would not be one checkpoint. ``jax.distributed.initialize``
starts JAX's preemption sync manager, whose own SIGTERM handler (in C++) tells
the coordination service; :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
then becomes true at the same step on every process (the largest step any
process had reached, plus one). So there SIGTERM is left to JAX, and another
stop signal is turned into a SIGTERM to this process. Measured with jax
0.10.2, gloo on CPU, 2 processes, with and without ``jax_enable_recoverability``:
one process sent itself SIGTERM at step 20, both reached the sync point at the
same step (37 and 40 in two runs, the other process being slower).

A second stop signal while the first is being handled ends the process at
once (the signal's default action): Ctrl-C twice does not wait for the save.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator, Sequence

from jax.experimental import multihost_utils

from ._failures import ConfigError, TrainingStopped
from ._private_apis import preemption_service_running

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What always stops a run with a checkpoint: how Kubernetes and Slurm preempt, and Ctrl-C."""


def exit_status(signum: int) -> int:
    """The exit status of a run that ``signum`` stopped: 128 + its number, as a shell reports a process it ended."""
    return 128 + signum


def parse_signal(value: str | int) -> signal.Signals:
    """``"SIGUSR1"``, ``"USR1"`` or ``10`` as a signal; :class:`ConfigError` for anything else."""
    try:
        if isinstance(value, int) or str(value).isdigit():
            return signal.Signals(int(value))
        name = str(value).upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ConfigError(
            f"trainer.preemption_signal {value!r} is not a signal; give a name such as SIGUSR1 or its number."
        ) from None


def stop_signals(extra: str | int | None = None) -> tuple[signal.Signals, ...]:
    """The signals that stop a run: :data:`STOP_SIGNALS`, plus ``extra`` if given."""
    signals = list(STOP_SIGNALS)
    if extra is not None and (chosen := parse_signal(extra)) not in signals:
        if chosen in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"trainer.preemption_signal {chosen.name} cannot be caught; choose another, such as SIGUSR1.")
        signals.append(chosen)
    return tuple(signals)


class Preempted(TrainingStopped):
    """Training stopped because of a stop signal, after saving the last committed step.

    :param signum: the signal; :attr:`exit_status` is what the command line exits with.
    """

    def __init__(self, message: str, *, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_status = exit_status(signum)


@contextlib.contextmanager
def signal_handlers(signals: Sequence[int], handler: Callable[[int, object], None]) -> Iterator[None]:
    """Handle each of ``signals`` with ``handler`` while entered, then restore the handlers there were.

    Python installs handlers only from the main thread: elsewhere none is installed.
    """
    previous: dict[int, object] = {}
    try:
        for signum in signals:
            try:
                previous[signum] = signal.signal(signum, handler)
            except ValueError:  # not the main thread
                break
        yield
    finally:
        for signum, handler_before in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler_before)


class PreemptionWatch:
    """Notes the stop signals received while it is entered; the loop asks :meth:`stops_at`.

    :param signals: the signals that stop the run (see :func:`stop_signals`).

    Handlers are installed only from the main thread (Python allows no
    other); elsewhere the watch never stops the run.
    """

    def __init__(self, signals: Sequence[int]):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._stopping = False
        self._handlers = contextlib.ExitStack()

    def _note(self, signum: int, frame: object) -> None:
        if self.received is not None:  # a second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        if preemption_service_running() and signum != signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells the other processes

    def stops_at(self, step: int) -> bool:
        """Whether to stop with ``step`` committed; called once at every step boundary (all processes alike)."""
        if not self._stopping:
            if preemption_service_running():
                self._stopping = multihost_utils.reached_preemption_sync_point(step)
            else:
                self._stopping = self.received is not None
        return self._stopping

    @property
    def signum(self) -> int:
        """The signal that stops the run (SIGTERM when another process of the job received it)."""
        return self.received or signal.SIGTERM

    def __enter__(self) -> PreemptionWatch:
        own = [s for s in self.signals if not (s == signal.SIGTERM and preemption_service_running())]  # else JAX's
        self._handlers.enter_context(signal_handlers(own, self._note))
        return self

    def __exit__(self, *exc_info) -> None:
        self._handlers.close()
