"""Applications of the engine, one module per `specdec` subcommand.

generate.py (`specdec generate`), train.py with the prompt datasets of data.py (`specdec
train-head`), bench.py (`specdec bench`), and common.py, the argument helpers they share.
They import the library (engine, loader, eagle, ...); the library never imports them, and the
entry points (specdec.cli, `python -m specdec`) load them lazily.
"""
