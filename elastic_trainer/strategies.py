"""The built-in strategies, for use from Python: ``from elastic_trainer.strategies import ScaleDown``.

They are plugins like any third party's (``plugins/`` in the repository, installed as
``elastic_trainer_plugins``); this module only gives them a public import path.
"""

from elastic_trainer_plugins.fallback import Fallback as Fallback
from elastic_trainer_plugins.full_restart import FullRestart as FullRestart
from elastic_trainer_plugins.diloco import DiLoCo as DiLoCo
from elastic_trainer_plugins.hot_swap import HotSwap as HotSwap
from elastic_trainer_plugins.pause_resume import PauseResume as PauseResume
from elastic_trainer_plugins.scale_down import ScaleDown as ScaleDown

__all__ = ["DiLoCo", "Fallback", "FullRestart", "HotSwap", "PauseResume", "ScaleDown"]
