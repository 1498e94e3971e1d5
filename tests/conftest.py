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

import torch  # noqa: E402  (after the environment it reads)


# A frame past Dynamo's recompile limit runs eagerly, with a warning: a test comparing a compiled
# step with eager PyTorch would then compare eager with itself and pass. Here that is an error.
torch._dynamo.config.fail_on_recompile_limit_hit = True


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: the frames earlier tests compiled are dropped
    (they would count towards the recompile limit of code every test runs, such as the
    example GPT's `forward`)."""
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def rank_pools():
    """`rank_pools(world)`: the session's pool of rank processes of that world size
    (`rank_pool.RankPool`, shared with `ranks.run_ranks`), for tests that train many cases."""
    import ranks

    yield ranks.pool
    ranks.close_pools()
