import sys

from duetserve.entrypoints.cli import main

sys.exit(main())
