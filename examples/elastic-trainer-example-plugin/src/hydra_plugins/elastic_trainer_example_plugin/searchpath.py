"""Puts this distribution's configs on the search path of elastic_trainer's Hydra app."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

ELASTIC_TRAINER_CONFIGS = "pkg://elastic_trainer_conf"
"""The search path entry of ``python -m elastic_trainer``'s own configs."""
OUR_CONFIGS = "pkg://elastic_trainer_example_plugin.conf"
"""This distribution's configs: ``strategy/quorum.yaml``."""


class ElasticTrainerExampleSearchPathPlugin(SearchPathPlugin):
    """Adds ``strategy/quorum.yaml`` to elastic_trainer's configs, and to no other Hydra app's."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        """Append the configs after elastic_trainer's own, so that a built-in of the same name wins."""
        if any(element.path == ELASTIC_TRAINER_CONFIGS for element in search_path.get_path()):
            search_path.append(provider="elastic-trainer-example-plugin", path=OUR_CONFIGS)
