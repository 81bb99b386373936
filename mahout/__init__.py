"""mahout: the Elephant host client. Never imports Django: hosts install it alone."""
from __future__ import annotations

__version__ = "0.3.0"
