"""Sources through the workflow: Snakemake on a copy reads a hub dataset from the local cache, reruns its
prompts for a new commit only, and fails an empty partition unless it may be empty."""

import pytest

pytestmark = pytest.mark.e2e
