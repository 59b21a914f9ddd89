"""``python -m hetero``: the same command line as the ``hetero`` console script."""

import sys

from ._cli import main

sys.exit(main())
