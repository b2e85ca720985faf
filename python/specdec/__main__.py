"""`python -m specdec ...` is the `specdec` command."""

from specdec.cli import main

main()
