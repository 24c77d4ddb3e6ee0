"""The proto codec tests share byte builders (codec_build.py) and the golden-fixture
renderer; pytest runs with --import-mode=importlib, so this directory is put on sys.path
for them to be importable by name."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
