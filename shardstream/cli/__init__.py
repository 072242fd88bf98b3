"""The ``shardstream`` command line: one small module per command, registered in main.COMMANDS."""
