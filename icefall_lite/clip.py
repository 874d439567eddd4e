"""Entry point kept from the flat layout (a contract in DESIGN.md): :mod:`icefall_lite.nn.clip`."""

from icefall_lite.nn.clip import *  # noqa: F401,F403
