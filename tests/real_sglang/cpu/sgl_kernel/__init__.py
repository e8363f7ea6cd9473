"""Import-only: see ../import_only.py."""

import sys

from import_only import make_import_only

make_import_only(sys.modules[__name__])
