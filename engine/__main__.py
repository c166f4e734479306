import os
import sys

from .cli import main
from .parallel import exit_rank

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank: leave without the finalization that can abort
    exit_rank(code)
sys.exit(code)
