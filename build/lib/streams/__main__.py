from streams.cli import entry

entry()
