"""``python -m pipesvc`` runs the command line."""

import sys

from pipesvc.cli import main

sys.exit(main())
