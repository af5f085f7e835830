"""Hydra configs this distribution adds to elastic_trainer's (``strategy/quorum.yaml``)."""
