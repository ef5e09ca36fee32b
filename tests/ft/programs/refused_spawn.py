"""``mpidist train`` (the arguments are mpidist's) whose replacements cannot be started: the
program it would spawn does not exist, so ``Spawn`` fails by itself (as with no free slots)
and growing back is refused, without a lost process."""

import ftprog  # noqa: F401, I001 - first: output capture and pid

import sys

from mpidist.cli import main

sys.executable = "/nonexistent/python3"  # what growing back spawns
sys.exit(main(sys.argv[1:]))
