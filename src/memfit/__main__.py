"""`python -m memfit ...` (what torchrun launches) is the `memfit` command."""

import sys

from memfit.cli.main import main

sys.exit(main())
