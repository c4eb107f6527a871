"""`python -m eqx_train`: the command line (see `eqx_train._cli`)."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
