"""A torchrun script whose ranks redraw a progress line with "\\r" (tests/scriptfns.redraws_a_progress_line)."""

import sys

from tests import scriptfns

scriptfns.redraws_a_progress_line(sys.argv[1])
