"""`python -m levers9` is the `levers9` command."""

from levers9.cli import main

raise SystemExit(main())
