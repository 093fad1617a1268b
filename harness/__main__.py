import sys

from harness.task import main

sys.exit(main(sys.argv[1:]))
