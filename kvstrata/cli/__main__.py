"""`python -m kvstrata.cli`: the same as the `kvstrata` command."""

import sys

from kvstrata.cli import main

sys.exit(main())
