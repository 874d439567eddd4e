"""``python -m studies.learning_speed``: the learning-speed study (see :mod:`studies.learning_speed.study`)."""

import sys

from studies.learning_speed.study import main

sys.exit(main())
