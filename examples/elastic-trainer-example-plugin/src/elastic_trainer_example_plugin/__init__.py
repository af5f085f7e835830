"""An elastic_trainer plugin distribution, written against the public API only.

It brings the ``quorum`` strategy (``python -m elastic_trainer +strategy=quorum``),
whose config Hydra finds through ``hydra_plugins/``, and the ``step_counter``
observer, which elastic_trainer loads from the ``elastic_trainer`` entry-point
group.
"""
