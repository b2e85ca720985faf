"""`python -m specdec.train ...` = `specdec train-head ...` (kept as a redirect).

Training is an application of the engine: its code is specdec.apps.train (and specdec.apps.data).
"""

if __name__ == "__main__":
    import sys

    from specdec.cli import main

    main(["train-head", *sys.argv[1:]])
