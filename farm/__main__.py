"""`python -m farm` is the `farm` command."""

from farm.cli import main

main()
