"""The multi-controller backend (``cluster=multiprocess``): slices made of whole JAX processes.

Membership (``_membership.py``: who lives, the agreements, stuck processes),
the rejoin of replacements (``_rejoin.py``), failure injection
(``_process_injection.py``), every key-value name (``_keys.py``), the
coordination service (``_coordinator.py``), step times (``_step_times.py``),
the order of synchronization calls (``_call_order.py``), and the platform
layer (``_platform.py``: what depends on the devices' collectives), composed
by :class:`MultiprocessCluster` (``_multiprocess.py``). docs/clusters.md says
what each part provides.
"""

from ._multiprocess import MultiprocessCluster as MultiprocessCluster
from ._rejoin import Admission as Admission
