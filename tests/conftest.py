import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    """A directory shared by the whole session (cached one-rank baselines live here)."""
    return tmp_path_factory.mktemp("session")
