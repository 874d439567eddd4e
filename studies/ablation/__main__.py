"""``python -m studies.ablation``: the gradient-control ablation (flags: ``--help``)."""

import sys

from studies.ablation.cli import main

sys.exit(main())
