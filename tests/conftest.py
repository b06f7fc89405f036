import pytest
import torch

# Tiny models run faster on one thread, and results must not depend on how many cores a machine has.
torch.set_num_threads(1)

from diffusers_omni.attention.selector import ENV_BACKEND, ENV_DIFFUSERS_BACKEND, clear_resolution_cache


@pytest.fixture(autouse=True)
def _isolated_resolution(monkeypatch):
    """Each test starts without the backend environment variables and with an empty resolution cache."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_DIFFUSERS_BACKEND, raising=False)
    clear_resolution_cache()
    yield
    clear_resolution_cache()
