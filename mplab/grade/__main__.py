"""python -m mplab.grade: see mplab.grade."""

import sys

from mplab.grade import main

__all__: list[str] = []

sys.exit(main())
