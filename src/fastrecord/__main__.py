"""``python -m fastrecord ...`` is the ``fastrecord`` command."""

import sys

from fastrecord.commands.cli import main

sys.exit(main())
