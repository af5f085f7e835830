"""The built-in loggers, for use from Python: ``from elastic_trainer.loggers import TensorBoard``.

They are plugins like any third party's (``plugins/metrics.py`` in the repository, installed as
``elastic_trainer_plugins``); this module only gives them a public import path, the one ``+logger=`` names.
"""

from elastic_trainer_plugins.metrics import TensorBoard as TensorBoard

__all__ = ["TensorBoard"]
