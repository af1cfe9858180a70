"""`python -m flashtile ...`: the `flashtile` command (flashtile.cli)."""

from flashtile.cli import main

raise SystemExit(main())
