import sys

from isoserve.kernels import main

sys.exit(main())
