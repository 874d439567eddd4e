#!/usr/bin/env python3
"""The gradient-control ablation, run from the recipe folder: a launcher of ``python -m studies.ablation``
(studies/ablation/cli.py). Its manual: --help, or studies/ablation/README.md's "How to run"."""

import sys

from studies.ablation.cli import main

if __name__ == "__main__":
    sys.exit(main())
