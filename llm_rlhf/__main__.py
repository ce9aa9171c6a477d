import sys

from llm_rlhf.cli import main

sys.exit(main())
