"""One offloaded model called from several threads (a web server's or a Gradio app's worker threads): every call
gets the output it gets alone, bitwise, or (distributed offload) a second concurrent call is refused at once."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from diffusers_omni import OffloadConfig, OffloadPlan, apply_offload
from diffusers_omni.offload.hooks import ConcurrentCallError

from offload_helpers import bare_flux, flux_inputs, flux_pipe

THREADS = 4
CALLS = 3
ROUNDS = 3  # a race shows in some runs only: several rounds per test


def _run_threads(work, count: int, timeout: float = 120.0) -> list[BaseException]:
    """Run ``work(k)`` in ``count`` threads started together; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(k: int) -> None:
        # Like the main thread (conftest): OpenMP's thread count is per thread, and another count changes the order
        # of CPU reductions (the last bit of a CLIP output, with or without offload).
        torch.set_num_threads(1)
        try:
            start.wait()
            work(k)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k,), name=f"caller-{k}") for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a caller is still waiting (deadlock?)"
    return errors


def _concurrent_outputs_equal_sequential(model, inputs, references) -> None:
    for _ in range(ROUNDS):
        outputs: dict[tuple[int, int], torch.Tensor] = {}

        def work(k: int) -> None:
            for call in range(CALLS):
                with torch.no_grad():
                    outputs[k, call] = model(**inputs[k])[0]

        errors = _run_threads(work, THREADS)
        assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
        for (k, _), output in outputs.items():
            assert torch.equal(output, references[k])
        assert len(outputs) == THREADS * CALLS


@pytest.mark.parametrize("options", [{}, {"prefetch_depth": 2}, {"max_device_memory": "600KiB"}],
                         ids=["default", "deeper-window", "budget"])
def test_layerwise_concurrent_forwards_equal_the_single_thread_outputs(options):
    model = bare_flux()
    inputs = [flux_inputs(seed) for seed in range(THREADS)]
    with torch.no_grad():
        references = [model(**x)[0] for x in inputs]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", **options))
    assert backend.stats.streamed_blocks > 0
    _concurrent_outputs_equal_sequential(model, inputs, references)
    with torch.no_grad():  # and the ring is in order afterwards
        assert torch.equal(model(**inputs[0])[0], references[0])
    assert backend.stats.on_demand_loads == 0
    backend.disable()


def test_layerwise_nested_stack_in_the_same_thread_does_not_wait_for_itself():
    """``x_embedder`` streams as a stack of its own, entered inside the DiT's forward: the same thread takes the
    offload's lock a second time."""
    model = bare_flux()
    inputs = [flux_inputs(seed) for seed in range(THREADS)]
    with torch.no_grad():
        references = [model(**x)[0] for x in inputs]
    plan = OffloadPlan(extra_streamed=("x_embedder",))
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", plan=plan))
    assert "x_embedder" in [stack.name for stack in backend._state.stacks]
    _concurrent_outputs_equal_sequential(model, inputs, references)
    backend.disable()


def test_a_forward_that_raises_lets_the_next_caller_in():
    model = bare_flux()
    good = flux_inputs(0)
    with torch.no_grad():
        reference = model(**good)[0]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    bad = {**good, "hidden_states": torch.randn(1, 16, 5)}  # wrong channel count: the first block raises
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(**bad)
    outputs = []

    def work(k: int) -> None:
        with torch.no_grad():
            outputs.append(model(**good)[0])

    assert not _run_threads(work, 2, timeout=60)
    assert len(outputs) == 2 and all(torch.equal(o, reference) for o in outputs)
    backend.disable()


def test_model_level_keeps_a_running_component_onloaded_while_another_thread_calls_an_encoder():
    """Thread A runs the transformer while threads B call the text encoders. Each component must stay onloaded for
    its whole forward: before, an encoder's call offloaded the transformer under A's running blocks (on an
    accelerator: weights on the host in the middle of a forward). Probes inside the components record it."""
    pipe = flux_pipe()
    inputs = flux_inputs(0)
    tokens = pipe.tokenizer(["a red fox"], padding="max_length", max_length=16, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = pipe.transformer(**inputs)[0]
        reference_text = pipe.text_encoder(tokens)[0]
    backend = pipe.enable_model_level_offload(device="cpu")
    seen: list[tuple[str, tuple[str, ...]]] = []

    def probe(label):
        def hook(module, args):
            seen.append((label, backend.onloaded()))
            threading.Event().wait(0.002)  # widen the window another thread could use
        return hook

    handles = [block.register_forward_pre_hook(probe("transformer")) for block in pipe.transformer.transformer_blocks]
    handles += [layer.register_forward_pre_hook(probe("text_encoder"))
                for layer in pipe.text_encoder.encoder.layers]
    outputs: list[tuple[str, torch.Tensor]] = []

    def work(k: int) -> None:
        for _ in range(CALLS):
            with torch.no_grad():
                if k == 0:
                    outputs.append(("transformer", pipe.transformer(**inputs)[0]))
                else:
                    outputs.append(("text_encoder", pipe.text_encoder(tokens)[0]))

    for _ in range(ROUNDS):
        errors = _run_threads(work, 3)
        assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    for handle in handles:
        handle.remove()
    assert seen and all(label in onloaded for label, onloaded in seen), [s for s in seen if s[0] not in s[1]][:3]
    for label, output in outputs:
        assert torch.equal(output, reference if label == "transformer" else reference_text)
    with backend.use("transformer"):  # holds the lock; the forward inside takes it again in the same thread
        with torch.no_grad():
            assert torch.equal(pipe.transformer(**inputs)[0], reference)
    pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_disable_waits_for_a_running_forward_and_a_waiting_caller_still_gets_its_output(strategy):
    """One caller runs, another waits for the lock, a third thread disables: disable waits for the running forward;
    whichever of the other two goes next, the waiting caller gets the same output (through the offload, or
    through the resident model if the offload was disabled meanwhile)."""
    for _ in range(ROUNDS):
        model = bare_flux()
        inputs = flux_inputs(0)
        with torch.no_grad():
            reference = model(**inputs)[0]
        backend = apply_offload(model, OffloadConfig(strategy, device="cpu"))
        inside, release = threading.Event(), threading.Event()

        def hold(module, args):
            if threading.current_thread().name == "caller-0" and not inside.is_set():
                inside.set()
                assert release.wait(30)

        handle = model.transformer_blocks[0].register_forward_pre_hook(hold)
        outputs: dict[int, torch.Tensor] = {}

        def work(k: int) -> None:
            if k == 0:
                with torch.no_grad():
                    outputs[k] = model(**inputs)[0]
                return
            assert inside.wait(30)
            if k == 1:
                backend.disable()
            else:
                threading.Event().wait(0.05)
                with torch.no_grad():
                    outputs[k] = model(**inputs)[0]

        def releaser() -> None:
            assert inside.wait(30)
            threading.Event().wait(0.2)  # the disabling and the waiting caller are both blocked by now
            release.set()

        helper = threading.Thread(target=releaser)
        helper.start()
        errors = _run_threads(work, 3, timeout=60)
        helper.join(30)
        handle.remove()
        assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
        assert not backend.is_enabled()
        assert torch.equal(outputs[0], reference) and torch.equal(outputs[2], reference)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("use_allgather", [True, False], ids=["allgather", "no-allgather"])
def test_distributed_refuses_a_second_concurrent_call_at_once(one_rank_group, use_allgather):
    model = bare_flux()
    inputs = flux_inputs(0)
    with torch.no_grad():
        reference = model(**inputs)[0]
    backend = apply_offload(model, OffloadConfig("distributed_layerwise", device="cpu", use_allgather=use_allgather))
    inside, tried = threading.Event(), threading.Event()

    def hold(module, args):  # the first caller waits inside the forward until the second one has tried
        if threading.current_thread().name == "caller-0":
            inside.set()
            assert tried.wait(30)

    handle = model.transformer_blocks[1].register_forward_pre_hook(hold)
    results: dict[int, object] = {}

    def work(k: int) -> None:
        if k == 1:
            assert inside.wait(30)
        try:
            with torch.no_grad():
                results[k] = model(**inputs)[0]
        except ConcurrentCallError as error:
            results[k] = error
        try:
            if k == 1:  # disabling under a running forward is refused too, before anything changed
                backend.disable()
                results["disable"] = None
        except ConcurrentCallError as error:
            results["disable"] = error
        finally:
            if k == 1:
                results["enabled"] = backend.is_enabled() and "__getstate__" in model.__dict__
                tried.set()

    assert not _run_threads(work, 2, timeout=60)
    handle.remove()
    assert torch.equal(results[0], reference)
    refused = results[1]
    assert isinstance(refused, ConcurrentCallError), refused
    message = str(refused)
    assert "'caller-0'" in message and "'caller-1'" in message and "one thread" in message
    assert "enable_layerwise_offload()" in message
    assert isinstance(results["disable"], ConcurrentCallError) and results["enabled"], results
    with torch.no_grad():  # the refused call changed nothing
        assert torch.equal(model(**inputs)[0], reference)
    backend.disable()


def test_layerwise_phases_called_from_several_threads_at_once():
    """Every component managed by phase (#29): threads calling the T5 encoder, the CLIP encoder, the VAE's decode and
    the transformer at once each get what they get alone; a phase entering (parking the other units, freeing other
    stacks' prefetched blocks) never lands in the middle of another thread's forward."""
    pipe = flux_pipe()
    ids_t5 = pipe.tokenizer_2(["a red fox in the snow"], return_tensors="pt").input_ids
    ids_clip = pipe.tokenizer(["a red fox in the snow"], return_tensors="pt").input_ids
    latents = torch.randn(1, pipe.vae.config.latent_channels, 4, 4, generator=torch.Generator().manual_seed(3))
    inputs = flux_inputs()
    calls = {
        "t5": lambda: pipe.text_encoder_2(ids_t5)[0],
        "clip": lambda: pipe.text_encoder(ids_clip).pooler_output,
        "vae": lambda: pipe.vae.decode(latents).sample,
        "dit": lambda: pipe.transformer(**inputs)[0],
    }
    with torch.no_grad():
        references = {name: call() for name, call in calls.items()}
    pipe.enable_layerwise_offload(device="cpu")
    names = list(calls)
    for _ in range(ROUNDS):
        outputs: dict[tuple[int, int], torch.Tensor] = {}

        def work(k: int) -> None:
            for call in range(CALLS):
                with torch.no_grad():
                    outputs[k, call] = calls[names[(k + call) % len(names)]]()

        errors = _run_threads(work, len(names))
        assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
        for (k, call), output in outputs.items():
            assert torch.equal(output, references[names[(k + call) % len(names)]])
    pipe.disable_omni_offload()
