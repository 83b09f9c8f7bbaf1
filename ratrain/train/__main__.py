"""`python -m ratrain.train`: see the package."""

import sys

from ratrain.train import main

sys.exit(main())
