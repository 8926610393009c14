"""`python -m jlms`: the `jlms` command line (see `jlms._cli`)."""

from jlms._cli import main

raise SystemExit(main())
