"""``python -m autotune.cli``: the command line."""

from autotune.cli._main import main

raise SystemExit(main())
