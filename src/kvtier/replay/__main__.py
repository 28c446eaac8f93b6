"""`python -m kvtier.replay TRACE ...`: the same as `kvtier replay`."""

import sys

from kvtier.replay.cli import main

sys.exit(main())
