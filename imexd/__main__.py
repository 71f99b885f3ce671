"""`python -m imexd`: the same entry point as the `imexd` console script."""

import sys

from imexd.cli.main import main

sys.exit(main())
