import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# One Inductor cache for every test process: compile time is this machine's cost.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))
# Every pass's output is verified (`piper_fx.verify`), in this process and the ranks it spawns.
os.environ.setdefault("PIPER_VERIFY", "1")


@pytest.fixture(scope="session")
def rank_pools():
    """`rank_pools(world)`: the session's pool of rank processes of that world size
    (`rank_pool.RankPool`, shared with `ranks.run_ranks`), for tests that train many cases."""
    import ranks

    yield ranks.pool
    ranks.close_pools()
