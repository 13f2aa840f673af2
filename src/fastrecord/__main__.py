"""``python -m fastrecord ...`` is the ``fastrecord`` command."""

from fastrecord.commands.cli import entry

entry()
