"""``python -m mpidist``: the ``mpidist`` command (:func:`mpidist.cli.main`), the same as the
console script and ``python -m mpidist.cli``, with the same exit status."""

from __future__ import annotations

import sys

from mpidist.cli import main

if __name__ == "__main__":
    sys.exit(main())
