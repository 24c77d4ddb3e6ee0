"""The policy tests share tests/netpol_model.py (an independent model of NetworkPolicy v1);
pytest runs with --import-mode=importlib, so tests/ is put on sys.path here."""

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
