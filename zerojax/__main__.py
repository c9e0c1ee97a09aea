"""`python -m zerojax`: see zerojax._src.planner.cli."""

import sys

from zerojax._src.planner.cli import main

sys.exit(main())
