"""Hydra plugins of elastic-trainer-example-plugin; Hydra imports every module here when it starts."""
