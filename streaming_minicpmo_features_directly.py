#!/usr/bin/env python
"""Seed-compatible entry point: causal MiniCPM-o 4.5 features of an EasyCom session.

Same flags as `minicpmo-rt features`; see src/minicpmo_rt/features/extract.py.
"""

import sys
from pathlib import Path

try:
    from minicpmo_rt.features.extract import main
except ImportError:  # a fresh clone that was not pip-installed: use its src/
    sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))
    from minicpmo_rt.features.extract import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
