"""`python -m kvtier ...`: the `kvtier` command (`kvtier demo`, `replay`, `generate`), for
an environment whose scripts folder is not on PATH. Same entry as the script:
`kvtier.cli.main.main`, whose module imports only what a Ctrl-C at start-up needs."""

from __future__ import annotations

import sys

from kvtier.cli.main import main

sys.exit(main())
