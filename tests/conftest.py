import atexit
import os
import shutil
import tempfile


# The planner's disk cache (plans and calibrations): one fresh directory per test
# session, so that no run reads another's plans. Subprocesses (the docs' examples)
# inherit it.
_CACHE_DIR = tempfile.mkdtemp(prefix="eqx_multimap_test_cache_")
os.environ["EQX_MULTIMAP_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)

# Must be set before JAX initialises its backends: 8 simulated CPU devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import pytest


jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(5678), 10_000))
    return lambda: next(keys)
