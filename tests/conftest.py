import pytest
import torch

# Tiny models run faster on one thread, and results must not depend on how many cores a machine has.
torch.set_num_threads(1)

from diffusers_omni.attention.selector import ENV_BACKEND, ENV_DIFFUSERS_BACKEND, clear_resolution_cache
from diffusers_omni.attention.tuning import ENV_CACHE_DIR, forget_tuned_table


@pytest.fixture(autouse=True)
def _isolated_tuned_tables(monkeypatch, tmp_path_factory):
    """Tuned routing tables of the machine running the tests never decide a test's routing: each test sees an empty
    cache directory of its own."""
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path_factory.mktemp("omni-cache")))
    forget_tuned_table()
    yield
    forget_tuned_table()


@pytest.fixture(autouse=True)
def _isolated_resolution(monkeypatch):
    """Each test starts without the backend environment variables and with an empty resolution cache."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_DIFFUSERS_BACKEND, raising=False)
    clear_resolution_cache()
    yield
    clear_resolution_cache()
