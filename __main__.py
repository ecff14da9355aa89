"""`python -m h3_multigpu`: the same command line as `h3-multigpu`."""

import sys

from .cli import main

sys.exit(main())
