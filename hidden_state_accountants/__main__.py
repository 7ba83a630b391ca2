"""``python -m hidden_state_accountants`` runs the ``hsa`` command line."""

import sys

from hidden_state_accountants.cli import main

sys.exit(main())
