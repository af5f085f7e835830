"""Hydra configs of ``python -m elastic_trainer``, installed as ``elastic_trainer_conf``."""
