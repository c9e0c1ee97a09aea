"""`python -m zerojax`: see zerojax._src.cli."""

import sys

from zerojax._src.cli import main

sys.exit(main())
