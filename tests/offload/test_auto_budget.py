"""``"auto"`` budgets (#40, the CPU part): read through ``budget.read_machine`` (replaced here by a 12 GiB card,
32 GiB of RAM, a cgroup cap), resolved when enabling, shown in the stats and the report; the same planner as an
explicit size, bitwise the same output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusers_omni.config.offload import LayerwiseOffloadConfig
from diffusers_omni.offload import budget
from diffusers_omni.offload.budget import MachineReading, device_budget, host_budget
from offload_helpers import assert_same_snapshot, flux_pipe, generate, pipeline_snapshot
from test_host_budget import COMPONENTS, _host_bytes, _image, _load, _state_dicts, saved  # noqa: F401 (fixture)

GiB = 1 << 30


def test_config_takes_auto_in_any_case_and_names_auto_in_the_refusal():
    config = LayerwiseOffloadConfig(device="cpu", max_device_memory=" AUTO", max_host_memory="auto")
    assert config.max_device_memory == "auto" and config.max_host_memory == "auto"
    with pytest.raises(ValueError, match=r"max_host_memory='plenty' is not a byte size; allowed: .*or \"auto\""):
        LayerwiseOffloadConfig(device="cpu", max_host_memory="plenty")
    with pytest.raises(TypeError, match=r"max_device_memory must be .*or \"auto\""):
        LayerwiseOffloadConfig(device="cpu", max_device_memory=1.5)


def test_max_device_memory_not_given_is_auto_on_an_accelerator_and_no_budget_on_the_cpu():
    assert LayerwiseOffloadConfig(device="cuda").max_device_memory == "auto"
    assert LayerwiseOffloadConfig(device="cuda", max_device_memory=None).max_device_memory == "auto"
    assert LayerwiseOffloadConfig(device="cpu").max_device_memory is None
    assert LayerwiseOffloadConfig(device="mps").max_device_memory is None  # PyTorch reads no free memory there
    for device in ("cuda", "cpu"):  # "none": no budget anywhere, kept as given (a replace() keeps it)
        config = LayerwiseOffloadConfig(device=device, max_device_memory=" None ")
        assert config.max_device_memory == "none"
        assert dataclasses.replace(config, prefetch_depth=2).max_device_memory == "none"
    assert dataclasses.replace(LayerwiseOffloadConfig(device="cuda"), prefetch_depth=2).max_device_memory == "auto"
    with pytest.raises(ValueError, match=r"max_device_memory='lots' is not a byte size; allowed: .*or \"auto\".*"
                                         r"or \"none\" \(no budget: every block streams\)"):
        LayerwiseOffloadConfig(device="cuda", max_device_memory="lots")


def test_no_budget_streams_every_block_as_none_did(monkeypatch):
    """``max_device_memory="none"`` plans as no budget did: every block streams, nothing is read from the machine."""
    monkeypatch.setattr(budget, "read_machine", lambda device: pytest.fail("no budget reads nothing"))
    pipe = flux_pipe()
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="none")
    assert backend.max_device_memory is None and backend.stats.resident_blocks == 0
    assert backend.stats.streamed_blocks > 0 and backend.stats.auto == []
    pipe.disable_omni_offload()


def test_device_budget_on_a_12_gib_card_under_a_process_fraction():
    card = MachineReading("cuda:0", device_free=20 * GiB, device_total=24 * GiB, device_fraction=0.5,
                          device_allocated=1 * GiB, device_cached=1 * GiB)
    chosen = device_budget(card)
    usable = 12 * GiB - 1 * GiB  # the fraction's 12 GiB less what is allocated (below free + cached = 21 GiB)
    assert chosen.nbytes == usable - int(usable * budget.HEADROOM_SHARE)
    assert "per-process fraction 0.5" in chosen.explain() and "headroom" in chosen.explain()
    small = device_budget(MachineReading("cuda:0", device_free=2 * GiB, device_total=4 * GiB))
    assert small.nbytes == 1 * GiB  # the headroom's floor (1 GiB) applies
    with pytest.raises(ValueError, match='could not read the memory of cuda:0; allowed: a size such as "12GiB"'):
        device_budget(MachineReading("cuda:0"))


def test_host_budget_takes_the_smaller_of_memavailable_and_the_cgroup_room_plus_the_weights_in_ram():
    reading = MachineReading("cpu", mem_available=32 * GiB, cgroup_limit=20 * GiB, cgroup_usage=8 * GiB)
    chosen = host_budget(reading, weights_in_ram=2 * GiB)
    available = 12 * GiB + 2 * GiB
    assert chosen.nbytes == available - int(available * budget.HOST_MARGIN_SHARE)
    assert "cgroup limit 20.00 GiB" in chosen.explain()
    with pytest.raises(ValueError, match="could not read how much RAM is available"):
        host_budget(MachineReading("cpu"), 0)


def test_read_machine_reads_this_machine():
    reading = budget.read_machine(torch.device("cpu"))
    assert reading.device == "cpu" and reading.mem_available and reading.mem_available > 0


def _tiny_reading(available: int):
    return lambda device: MachineReading(str(device), mem_available=available)


def test_auto_on_the_cpu_plans_like_the_size_it_resolves_to_and_the_report_says_so(monkeypatch):
    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    everything = pipe.enable_layerwise_offload(device="cpu").stats.host_bytes
    pipe.disable_omni_offload()
    # RAM plenty: everything fits the device budget (the CPU is the device): nothing streams.
    monkeypatch.setattr(budget, "read_machine", _tiny_reading(64 * GiB))
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="auto")
    assert backend.stats.streamed_blocks == 0 and backend.max_device_memory > everything
    assert backend.stats.auto[0].startswith("max_device_memory=auto: ")
    assert torch.equal(generate(pipe, steps=2), reference)
    report = str(pipe.omni_offload_report())
    assert "auto: max_device_memory=auto" in report and "auto read: device cpu, mem_available 64.00 GiB" in report
    pipe.disable_omni_offload()


def test_auto_that_resolves_to_too_little_refuses_before_anything_changes(monkeypatch):
    pipe = flux_pipe()
    monkeypatch.setattr(budget, "read_machine", _tiny_reading(1 * GiB))  # all of it is headroom
    with pytest.raises(ValueError, match=r"max_device_memory=0 \(0 B\) is too small"):
        pipe.enable_layerwise_offload(device="cpu", max_device_memory="auto")
    assert pipe.omni_offload_backend is None


def test_host_auto_keeps_every_host_copy_when_ram_allows(monkeypatch):
    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    monkeypatch.setattr(budget, "read_machine", _tiny_reading(64 * GiB))
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory="auto")
    assert backend.stats.disk_blocks == 0 and backend.stats.auto[0].startswith("max_host_memory=auto: ")
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()


def test_host_auto_under_a_cgroup_cap_reads_the_rest_from_disk_and_the_cap_holds(saved, monkeypatch):
    """An injected cgroup limit (the CPU machine's stand-in for a ``memory.max`` on the GPU machine): auto pins what
    the cap leaves, the other blocks are read from the checkpoint, and the image is the same."""
    pipe = _load(saved)
    reference = _image(pipe)
    expected = _state_dicts(pipe)
    everything = _host_bytes(pipe)
    chosen = []
    host_budget = budget.host_budget

    def capture(reading, in_ram, device_in_ram=0):
        chosen.append(host_budget(reading, in_ram, device_in_ram))
        device_share.append(device_in_ram)
        return chosen[-1]

    device_share = []

    monkeypatch.setattr(budget, "host_budget", capture)
    # The cap leaves the margin (1 GiB at this size) and the window less a quarter of the host copies: with the
    # weights in RAM (auto counts those back in) about three quarters of the host copies fit.
    backend = pipe.enable_layerwise_offload(device="cpu")
    window = backend.stats.in_flight_capacity  # the device's share of RAM here (the device is the CPU)
    pipe.disable_omni_offload()
    room = GiB - everything // 4 + window
    monkeypatch.setattr(budget, "read_machine", lambda device: MachineReading(
        str(device), mem_available=64 * GiB, cgroup_limit=8 * GiB, cgroup_usage=8 * GiB - room))
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory="auto")
    stats = backend.stats
    (auto,) = chosen
    assert any("cgroup limit 8.00 GiB" in step for step in auto.steps)
    assert stats.disk_blocks > 0  # the cap did not hold every host copy
    assert stats.host_bytes + stats.staging_bytes + stats.shared_bytes <= auto.nbytes  # the cap holds
    # The device is the CPU: its window is RAM too, and left out of the host copies' share
    assert device_share == [stats.in_flight_capacity] and stats.in_flight_capacity > 0
    assert any("the device takes in RAM" in step for step in auto.steps)
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    report = str(pipe.omni_offload_report())
    assert "auto read: device cpu" in report and "cgroup_limit 8.00 GiB" in report
    pipe.disable_omni_offload()
    actual = _state_dicts(pipe)
    assert all(torch.equal(actual[n][k], expected[n][k]) for n in COMPONENTS for k in expected[n])  # nothing lost
    assert torch.equal(_image(pipe), reference)


def test_host_auto_refuses_a_model_without_files_that_does_not_fit_before_pinning(monkeypatch):
    pipe = flux_pipe()
    before = pipeline_snapshot(pipe)
    everything = _host_bytes(pipe)
    monkeypatch.setattr(budget, "read_machine", lambda device: MachineReading(
        str(device), mem_available=64 * GiB, cgroup_limit=8 * GiB, cgroup_usage=7 * GiB + everything // 2))
    with pytest.raises(ValueError, match=r"max_host_memory=\d+ \(.*\) is too small; allowed: at least") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory="auto")
    assert "not loaded from local safetensors files" in str(info.value)  # how much it needs, and the way out
    assert "That budget is what auto found this machine leaves: max_host_memory=auto: " in str(info.value)
    assert "cgroup limit 8.00 GiB" in str(info.value)  # what it read
    assert pipe.omni_offload_backend is None
    assert_same_snapshot(before, pipeline_snapshot(pipe))


def _cgroup_folder(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_cgroup_v1_reads_the_process_own_cgroup_and_the_tightest_ancestor(tmp_path):
    """The CPU machine's own case: v1, the process in a nested memory cgroup (``/process_api/<id>``) whose
    limit is not the mount root's; the ancestor leaving the least room binds; reclaimable page cache is not usage."""
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/jobs/one\n1:cpu:/\n0::/\n")
    mount = tmp_path / "fs" / "memory"
    _cgroup_folder(mount, {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "1000"})
    _cgroup_folder(mount / "jobs", {"memory.limit_in_bytes": str(10 * GiB), "memory.usage_in_bytes": str(9 * GiB),
                                    "memory.stat": f"cache 5\ntotal_inactive_file {2 * GiB}\n"})
    _cgroup_folder(mount / "jobs" / "one", {"memory.limit_in_bytes": str(8 * GiB),
                                            "memory.usage_in_bytes": str(1 * GiB)})
    # jobs: 10 GiB less 7 GiB used (9 less 2 reclaimable) = 3 GiB; one: 8 less 1 = 7 GiB: jobs binds
    assert budget._cgroup(proc, tmp_path / "fs") == (10 * GiB, 7 * GiB)
    (mount / "jobs" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # no limit there: one binds
    assert budget._cgroup(proc, tmp_path / "fs") == (8 * GiB, 1 * GiB)


def test_cgroup_v2_walks_up_from_the_own_folder_and_a_container_root_is_its_cgroup(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/app.scope\n")
    mount = tmp_path / "fs"
    _cgroup_folder(mount, {"cgroup.controllers": "memory"})
    _cgroup_folder(mount / "user.slice", {"memory.max": str(6 * GiB), "memory.current": str(2 * GiB),
                                          "memory.stat": f"anon 1\ninactive_file {GiB}\n"})
    _cgroup_folder(mount / "user.slice" / "app.scope", {"memory.max": "max", "memory.current": str(GiB)})
    assert budget._cgroup(proc, mount) == (6 * GiB, 1 * GiB)
    # A container: /proc/self/cgroup names a path of the host's tree that its mount does not show
    proc.write_text("0::/system.slice/docker-abc.scope\n")
    (mount / "memory.max").write_text(str(4 * GiB))
    (mount / "memory.current").write_text(str(3 * GiB))
    assert budget._cgroup(proc, mount) == (4 * GiB, 3 * GiB)


def test_cgroup_without_limits_or_files_reads_none(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    _cgroup_folder(tmp_path / "fs", {"cgroup.controllers": "memory"})
    assert budget._cgroup(proc, tmp_path / "fs") == (None, None)
    assert budget._cgroup(tmp_path / "missing", tmp_path / "nowhere") == (None, None)
