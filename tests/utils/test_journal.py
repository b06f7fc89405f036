"""The one journal type: undo newest first, exact ``__dict__`` snapshots, attributes put back or removed."""

import logging

import pytest
import torch
from torch import nn

from diffusers_omni.utils.journal import Journal


def test_rollback_runs_newest_first_and_survives_a_failing_undo(caplog):
    order = []
    journal = Journal("test")
    journal.record("first", lambda: order.append(1))
    journal.record("broken", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    journal.record("third", lambda: order.append(3))
    with caplog.at_level(logging.ERROR, logger="diffusers_omni"):
        journal.rollback()
    assert order == [3, 1]
    assert "rollback step 'broken' failed" in caplog.text
    assert len(journal) == 0


def test_set_restores_or_removes_the_attribute():
    module = nn.Linear(2, 2)
    module.tag = "before"
    journal = Journal()
    journal.set(module, "tag", "after")
    journal.set(module, "fresh", 1)
    assert module.tag == "after" and module.fresh == 1
    journal.rollback()
    assert module.tag == "before"
    assert "fresh" not in module.__dict__


def test_snapshot_restores_dict_and_containers_in_place():
    module = nn.Linear(2, 2)
    hooks = module._forward_hooks
    handle_count = len(hooks)
    journal = Journal()
    journal.snapshot(module)
    journal.snapshot(module)  # once per object
    module.register_forward_hook(lambda *args: None)
    module.extra = nn.ReLU()
    module.other = 3
    journal.rollback()
    assert module._forward_hooks is hooks and len(hooks) == handle_count
    assert "extra" not in module._modules and "other" not in module.__dict__


def test_move_tensor_and_commit():
    tensor = torch.zeros(2)
    journal = Journal()
    journal.move_tensor(tensor, torch.device("cpu"))  # already there: nothing to undo
    assert len(journal) == 0
    journal.record("kept", lambda: pytest.fail("committed records never run"))
    journal.commit()
    journal.rollback()
