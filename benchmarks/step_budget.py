"""Where a failure-free step's time goes: the trainer's host work around its program, against the bare loop.

For each device count (``--devices``, default 8 32 64; the small model of
``overhead.py --devices N``, in a process of its own), runs of ``--steps``
steps:

1. the bare donating loop (``_loops.bare_intervals``): its median step is the
   device time of the step's program (plus the loop's own dispatch);
2. the trainer, plain: its median step; these two ``--rounds`` times in
   turns;
3. once, the trainer with each piece of its per-step host work timed (functions
   wrapped from outside, exclusive of the pieces they call): the hooks by
   name, the batch read, the launch check, the dispatch, the wait for the
   devices with its hand-off to the watchdog's thread, the cluster's checks,
   the state's unflattening, the ledger and history, straggler times,
   compiling ahead, host snapshots, the boundary's resize check; "loop and
   the rest" is what no wrapped piece took (the loop itself, the goodput
   clock, records). A piece that ran while the step's program was in flight
   (between its dispatch and the end of the wait) is overlapped with the
   devices; the others are exposed: the devices idle meanwhile.

Prints, per device count, a table in milliseconds per step (medians over the
steps, the first ``WARM_UP_STEPS`` left out), the median over the rounds of
the plain trainer's median step minus the bare loop's (the machine's noise,
a few per cent, included), then ``host_ms_per_step``: in one more plain run,
the median time from the end of the wait for a step's program (the devices
are done) to the call of the next step's, which is the trainer's host time
per step that no device work hides; last, the worst
of them and their spread over the device counts:
``host_ms_per_step=0.31`` (the issue's target: flat within 1 ms from 8 to 64).

    python benchmarks/step_budget.py [--devices 8 32 64] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import elastic_trainer as et


WARM_UP_STEPS = 10
"""Steps left out of every median: the first runs of a program, and the first snapshots, cost more."""


class Timeline:
    """Exclusive time per piece of host work and per step, split into exposed and overlapped (a program in
    flight); :meth:`step_end` closes a step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, list[float]]] = []
        self.seconds: dict[str, list[float]] = self._new_step()  # this step's: [exposed, overlapped] per piece
        self.in_flight = False
        self._stack: list[list[float]] = []  # per open piece: time its wrapped callees took

    @staticmethod
    def _new_step() -> dict[str, list[float]]:
        return collections.defaultdict(lambda: [0.0, 0.0])

    def step_end(self) -> None:
        self.steps.append(dict(self.seconds))
        self.seconds = self._new_step()

    def medians_ms(self) -> dict[str, tuple[float, float]]:
        """Each piece's median exposed and overlapped milliseconds per step, the warm-up left out."""
        steps = self.steps[WARM_UP_STEPS:]
        names = {name for step in steps for name in step}
        return {name: tuple(1e3 * statistics.median(step.get(name, [0.0, 0.0])[i] for step in steps) for i in (0, 1))
                for name in names}

    def wrap(self, category: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            overlapped, begin = self.in_flight, time.perf_counter()
            self._stack.append([0.0])
            try:
                return function(*args, **kwargs)
            finally:
                took = time.perf_counter() - begin
                nested = self._stack.pop()[0]
                if self._stack:
                    self._stack[-1][0] += took
                self.seconds[category][1 if overlapped else 0] += took - nested

        return timed

    def patch(self, owner, name: str, category: str) -> None:
        """Time ``owner.name`` as ``category``."""
        setattr(owner, name, self.wrap(category, getattr(owner, name)))


def instrument(timeline: Timeline) -> None:
    """Wrap the trainer's per-step host work (as a profiler would, from outside)."""
    from elastic_trainer import SimulatedCluster
    from elastic_trainer._layouts import Layouts
    from elastic_trainer._plugins import GuardedHooks
    from elastic_trainer._records import StepHistory
    from elastic_trainer._snapshots import HostSnapshots
    from elastic_trainer._step_runner import StepRunner
    from elastic_trainer._stragglers import StragglerWatch
    from elastic_trainer._watchdog import Watchdog

    patches = [
        (StepRunner, "_take_batch", "batch (take the one read ahead)"), (StepRunner, "_read_batch", "batch (read)"),
        (StepRunner, "_state_of", "state unflattened"), (StepRunner, "_leaves_of", "state's leaves"),
        (StepRunner, "launching", "launch"), (SimulatedCluster, "check_launch", "cluster: launch check"),
        (StepRunner, "dispatched", "dispatched"), (SimulatedCluster, "step_dispatched", "cluster: step dispatched"),
        (SimulatedCluster, "slice_step_seconds", "stragglers"), (StragglerWatch, "observe", "stragglers"),
        (StepHistory, "commit", "ledger and history"), (StepHistory, "note_first_step", "ledger and history"),
        (Layouts, "compile_likely", "compile ahead (check)"), (Layouts, "maybe_resize", "resize check"),
        (HostSnapshots, "take", "host snapshot"), (Watchdog, "wait", "wait: devices, hand-off, cluster check"),
    ]
    for owner, name, category in patches:
        timeline.patch(owner, name, category)
    launching, dispatched, wait = StepRunner.launching, StepRunner.dispatched, Watchdog.wait
    launched_at = [0.0]

    def launched(self):
        try:
            return launching(self)
        finally:
            launched_at[0] = time.perf_counter()

    def in_flight(self):  # the program was dispatched: in flight from here until the wait ends
        timeline.seconds["dispatch (the program's call)"][0] += time.perf_counter() - launched_at[0]
        timeline.in_flight = True
        return dispatched(self)

    def waited(self, wait_for_step):
        try:
            return wait(self, wait_for_step)
        finally:
            timeline.in_flight = False

    StepRunner.launching, StepRunner.dispatched, Watchdog.wait = launched, in_flight, waited
    hook_of = GuardedHooks.__getattr__

    def timed_hook(self, name):
        self.__dict__[name] = timeline.wrap(f"hook {name}", hook_of(self, name))
        return self.__dict__[name]

    GuardedHooks.__getattr__ = timed_hook


def exposed_gaps_ms(work, steps: int) -> list[float]:
    """A plain trainer run with two time stamps per step, as light as a probe gets: when the wait for a step's
    program ends (the devices are done) and when the next step's program is called. What lies between is the
    trainer's host work that no device work hides."""
    from elastic_trainer._step_runner import StepRunner
    from elastic_trainer._watchdog import Watchdog

    import _loops

    launching, wait = StepRunner.launching, Watchdog.wait
    waited: list[float] = []
    gaps: list[float] = []

    def launched(self):
        launching(self)
        if waited:
            gaps.append(1e3 * (time.perf_counter() - waited[-1]))

    def timed_wait(self, wait_for_step):
        try:
            return wait(self, wait_for_step)
        finally:
            waited.append(time.perf_counter())

    StepRunner.launching, Watchdog.wait = launched, timed_wait
    try:
        _loops.trainer_intervals(work, steps)
    finally:
        StepRunner.launching, Watchdog.wait = launching, wait
    return gaps[WARM_UP_STEPS:]


def one(devices: int, steps: int, rounds: int) -> dict:
    """The runs on ``devices`` devices (in this process, its JAX configured now)."""
    import _loops

    _loops.configure(devices)
    work = _loops.small(devices)
    bare, plain = [], []
    for round_ in range(rounds):  # in turns, the order alternating: drift on a shared machine cancels out
        for loop in ([_loops.bare_intervals, _loops.trainer_intervals] if round_ % 2 == 0 else
                     [_loops.trainer_intervals, _loops.bare_intervals]):
            (bare if loop is _loops.bare_intervals else plain).append(_loops.median_ms(loop(work, steps)))
    gaps = exposed_gaps_ms(work, steps)
    timeline = Timeline()
    instrument(timeline)
    timed = _loops.trainer_intervals(work, steps, plugins=[StepEnds(timeline)])
    return {"devices": devices, "work": work.name, "bare_ms": statistics.median(bare),
            "trainer_ms": statistics.median(plain),
            "difference_ms": statistics.median(t - b for t, b in zip(plain, bare, strict=True)),
            "host_ms": statistics.median(gaps),
            "instrumented_ms": _loops.median_ms(timed[WARM_UP_STEPS:]), "pieces_ms": timeline.medians_ms()}


class StepEnds:
    """Closes the timeline's step at each step's end."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline

    @et.hookimpl(trylast=True)
    def et_step_end(self) -> None:
        self.timeline.step_end()


def table(result: dict) -> str:
    rows = sorted(result["pieces_ms"].items(), key=lambda item: -sum(item[1]))
    lines = [f"{result['work']}: bare loop {result['bare_ms']:.2f} ms/step (its program's device time), trainer "
             f"{result['trainer_ms']:.2f} ms/step ({result['instrumented_ms']:.2f} instrumented)",
             f"  {'host work per step':<42}{'exposed ms':>12}{'overlapped ms':>15}"]
    for category, (exposed, overlapped) in rows:
        lines.append(f"  {category:<42}{exposed:>12.3f}{overlapped:>15.3f}")
    timed = sum(sum(ms) for ms in result["pieces_ms"].values())
    lines.append(f"  {'loop and the rest (untimed)':<42}{result['instrumented_ms'] - timed:>12.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="bare and plain trainer runs, in turns")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one device count here, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.rounds)))
        return
    host = {}
    for devices in args.devices:
        out = subprocess.run([sys.executable, str(Path(__file__)), "--one", str(devices), "--steps", str(args.steps),
                              "--rounds", str(args.rounds)], check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        host[devices] = result["host_ms"]
        print(table(result))
        print(f"  trainer minus bare loop, median over {args.rounds} rounds: {result['difference_ms']:.3f} ms "
              "(the machine's noise included)")
        print(f"  host_ms_per_step at {devices} devices: {host[devices]:.3f}\n", flush=True)
    print(f"host time per step, 8 to {max(host)} devices: " + ", ".join(f"{d}: {h:.3f} ms" for d, h in host.items())
          + f"; spread {max(host.values()) - min(host.values()):.3f} ms")
    print(f"host_ms_per_step={max(host.values()):.3f}")


if __name__ == "__main__":
    main()
