"""``generate --mmap`` with a hub id downloads through ``DiffusionPipeline.download`` (issue 16): Diffusers' own
file filtering (component folders, safetensors over .bin, no single-file checkpoints), not a whole-repository
``snapshot_download``. No hub is reachable in tests, so the download returns a local folder; the loading is real."""

from diffusers import DiffusionPipeline

from diffusers_omni.cli.common import load_pipeline
from diffusers_omni.testing import tiny_flux_pipeline


def test_mmap_downloads_a_hub_id_with_diffusers_filtering(tmp_path, monkeypatch):
    folder = tmp_path / "snapshot"
    tiny_flux_pipeline().save_pretrained(folder)
    requested = []

    def download(cls, name, **kwargs):
        requested.append(name)
        return str(folder)

    monkeypatch.setattr(DiffusionPipeline, "download", classmethod(download))
    pipe = load_pipeline("someone/tiny-flux", mmap=True)
    assert requested == ["someone/tiny-flux"]
    weight = next(pipe.transformer.parameters())
    assert weight.untyped_storage().nbytes() > 0 and type(pipe.transformer).__name__ == "FluxTransformer2DModel"
    with open("/proc/self/maps") as maps:
        files = [line.split()[-1] for line in maps if str(folder) in line]
    assert any(path.endswith("transformer/diffusion_pytorch_model.safetensors") for path in files)
