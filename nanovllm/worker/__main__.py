"""`python -m nanovllm.worker SPEC_JSON`: one tensor-parallel worker (see worker.py). A module
of its own, so that running it never re-executes a module the package has already imported."""

import sys

from nanovllm.worker.worker import main

sys.exit(main(sys.argv[1:]))
