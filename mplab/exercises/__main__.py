"""python -m mplab.exercises release OUT [--key KEYDIR]: see :mod:`mplab.exercises.release`."""

import sys

from mplab.exercises.release import main

__all__: list[str] = []

if sys.argv[1:2] != ["release"]:
    print("usage: python -m mplab.exercises release OUT [--key KEYDIR]\n"
          "(and python -m mplab.exercises.sync NOTEBOOK... to rewrite exercise cells)",
          file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[2:]))
