import sys

from edgellm.cli import entry

sys.exit(entry())
