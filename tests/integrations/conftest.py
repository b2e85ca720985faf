"""The integration tests reuse the engine tests' helpers (tests/engine/test_engine.py)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "engine"))
