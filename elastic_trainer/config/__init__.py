"""Configs: the schemas in Hydra's ConfigStore (``_schemas``), the value checks that the schemas and the
constructors share (``_settings``), and the one place where configs become objects (``_build``)."""
