"""``python -m asyncstep``: the command line."""

import sys

from asyncstep.cli import main

sys.exit(main())
