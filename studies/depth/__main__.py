"""``python -m studies.depth``: the depth report (see :mod:`studies.depth.report`)."""

from studies.depth.report import main

main()
