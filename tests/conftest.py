"""Shared test set-up.

Monarch child processes import actor classes by module name, and they only see PYTHONPATH, so
the test process's sys.path is exported before any mesh is spawned.
"""

import os
import sys

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
