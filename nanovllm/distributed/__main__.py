"""`python -m nanovllm.distributed SPEC_JSON`: one tensor-parallel worker (see worker.py). A module
of its own, so that running it never re-executes a module the package has already imported."""

import sys

from nanovllm.distributed.worker import main

sys.exit(main(sys.argv[1:]))
