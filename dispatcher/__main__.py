import sys

from dispatcher.cli import main

sys.exit(main(prog_name="python -m dispatcher"))
