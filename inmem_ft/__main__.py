"""python -m inmem_ft: the same as the `inmem-ft` command."""
import sys

from .cli import main

sys.exit(main())
