"""The ``fastrecord`` command's subcommands (``fastrecord.commands.cli:entry``), one module each: internal.

Their interface is the command line (``fastrecord --help``, README "The command line"); the library API
they are built on is in docs/api.md.
"""

__all__: list[str] = []
