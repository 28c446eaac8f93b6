"""`python -m kvtier.replay TRACE ...`: the same as `kvtier replay`, on the same path
(`kvtier.cli.main.run_command`), which imports the command's modules where a Ctrl-C is
one line and status 130."""

import sys

from kvtier.cli.main import run_command

sys.exit(run_command(["replay", *sys.argv[1:]], ends_the_process=True))
