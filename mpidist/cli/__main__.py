"""``python -m mpidist.cli``: the ``mpidist`` command (:func:`mpidist.cli.main`)."""

from __future__ import annotations

import sys

from mpidist.cli import main

if __name__ == "__main__":
    sys.exit(main())
