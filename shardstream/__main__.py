"""``python -m shardstream`` runs the command line."""

from .cli.main import entry

entry()
