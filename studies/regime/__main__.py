"""``python -m studies.regime``: the pilot's runs, then (once family.json is written) the family's and its
control's, then (once onset.json is written) the two confirmatory questions' in its order; resumable, the
report rewritten after each run. With ``--report-only``: the report alone, from the committed summaries."""

import argparse
import logging

from studies.regime.family import control_stage, family_stage
from studies.regime.onset import load_design, verify_machine
from studies.regime.onset import run_all as run_onset
from studies.regime.pilot import PILOT
from studies.regime.report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report-only", action="store_true", help="re-render README.md from the summaries")
    parser.add_argument(
        "--verify-machine",
        action="store_true",
        help="retrain the first steps of each onset question's first run here and record whether this machine "
        "computes alike (then its runs count in that question's tests)",
    )
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s [%(module)s] %(message)s", level=logging.INFO)
    if args.verify_machine:
        verify_machine(load_design())
    elif not args.report_only:
        PILOT.run_all(after_each=write_report)
        for stage in (family_stage(), control_stage()):
            if stage is not None:
                stage.run_all(after_each=write_report)
        onset = load_design()
        if onset is not None:
            run_onset(onset, after_each=write_report)
    logging.info(f"wrote {write_report()}")


main()
