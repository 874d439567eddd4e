"""Entry point kept from the flat layout (a contract in DESIGN.md): :mod:`icefall_lite.nn.rnnt_loss`."""

from icefall_lite.nn.rnnt_loss import *  # noqa: F401,F403
