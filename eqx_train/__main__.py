"""`python -m eqx_train`: the command line (see `eqx_train._cli`)."""

from ._cli import main

raise SystemExit(main())
