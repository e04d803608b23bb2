#!/usr/bin/env python
"""Seed-compatible entry point: train a turn head on a feature root.

Same flags as `minicpmo-rt train-turn-head`; see src/minicpmo_rt/turn_head/train.py.
"""

import sys
from pathlib import Path

try:
    from minicpmo_rt.turn_head.train import main
except ImportError:  # a fresh clone that was not pip-installed: use its src/
    sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))
    from minicpmo_rt.turn_head.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
