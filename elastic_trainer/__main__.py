"""Entry point of ``python -m elastic_trainer``."""

from .launch._cli import main

main()
