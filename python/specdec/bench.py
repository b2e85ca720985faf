"""`python -m specdec.bench ...` = `specdec bench ...` (kept as a redirect).

The end-to-end benchmark is an application of the engine: its code is specdec.apps.bench.
"""

if __name__ == "__main__":
    import sys

    from specdec.cli import main

    main(["bench", *sys.argv[1:]])
