"""Entry point kept from the flat layout (a contract in DESIGN.md): :mod:`icefall_lite.nn.scaling`."""

from icefall_lite.nn.scaling import *  # noqa: F401,F403
