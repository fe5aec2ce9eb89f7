"""``python -m asyncstep``: the command line."""

from asyncstep.cli import run

run()
