"""python -m mplab.grade: see mplab.grade."""

import os
import sys

# As with PYTHONSAFEPATH: the folder the grader was started in is not searched for modules,
# so a file written there (by a notebook it grades, say) is never imported while it regrades.
if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from mplab.grade import main  # noqa: E402

__all__: list[str] = []

sys.exit(main())
