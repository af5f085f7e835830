"""Processes: the command line, the full-restart supervisor and the local multi-process launcher."""
