"""Entry point of ``python -m elastic_trainer``."""

from ._cli import main

main()
