"""python -m mplab.grade: see mplab.grade."""

import sys

from mplab.grade import main

sys.exit(main())
