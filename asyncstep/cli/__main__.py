"""``python -m asyncstep.cli``: the command line (:func:`asyncstep.cli.main`)."""

import sys

from asyncstep.cli import main

sys.exit(main())
