"""`python -m tests.simulation`: what `scripts/simulate` runs."""

from __future__ import annotations

import sys

from tests.simulation.batch import main

sys.exit(main())
