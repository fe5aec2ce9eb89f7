"""``python -m asyncstep.rank``: one rank of a multi-process engine (see
:mod:`asyncstep.nursery.rank_main`)."""

import sys

from asyncstep.nursery.rank_main import main

if __name__ == "__main__":
    sys.exit(main())
