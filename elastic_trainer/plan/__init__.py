"""Goodput at any scale: a projection of every strategy from measured per-event costs.

``python -m elastic_trainer.plan`` reads run directories (a benchmark sweep's
or your own runs'), takes each strategy's costs from them (step, save,
detection, re-mesh, compile, restore, restart), and simulates long jobs on a
cluster of any size under a failure model, with the checkpoint period that
Young/Daly choose; docs/projection.md explains the model.
"""

from ._closed_form import Period as Period
from ._closed_form import choose_period as choose_period
from ._closed_form import restart_goodput as restart_goodput
from ._costs import (
    RecoveryCost as RecoveryCost,
)
from ._costs import (
    StrategyCosts as StrategyCosts,
)
from ._costs import (
    restart_cost as restart_cost,
)
from ._costs import (
    strategy_costs as strategy_costs,
)
from ._costs import (
    swap_cost as swap_cost,
)
from ._costs import (
    with_costs as with_costs,
)
from ._model import (
    MULTI_CONTROLLER as MULTI_CONTROLLER,
)
from ._model import (
    SINGLE_CONTROLLER as SINGLE_CONTROLLER,
)
from ._model import (
    FailureModel as FailureModel,
)
from ._model import (
    Runtime as Runtime,
)
from ._project import (
    Horizon as Horizon,
)
from ._project import (
    Projection as Projection,
)
from ._project import (
    project as project,
)
from ._project import (
    recommend as recommend,
)
from ._project import (
    recommend_spares as recommend_spares,
)
from ._project import (
    scaling as scaling,
)
from ._project import (
    scenarios as scenarios,
)
from ._project import (
    spare_counts as spare_counts,
)
from ._project import (
    spare_scaling as spare_scaling,
)
from ._project import (
    spare_scenario as spare_scenario,
)
from ._runs import MeasuredFailure as MeasuredFailure
from ._runs import MeasuredRun as MeasuredRun
from ._runs import load_run as load_run
from ._runs import run_dirs as run_dirs
from ._simulate import (
    Failure as Failure,
)
from ._simulate import (
    Outcome as Outcome,
)
from ._simulate import (
    Scenario as Scenario,
)
from ._simulate import (
    ScheduledFailure as ScheduledFailure,
)
from ._simulate import (
    failure_trace as failure_trace,
)
from ._simulate import (
    replay as replay,
)
from ._simulate import (
    simulate as simulate,
)
from ._validate import Validation as Validation
from ._validate import validate as validate
