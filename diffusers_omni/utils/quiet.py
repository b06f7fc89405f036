"""Silence known-harmless third-party messages, only while our own imports trigger them.

Importing Diffusers' pipelines and models imports transformers' and Diffusers' quantizer integrations, and with them
every quantization package that is installed (the test extra installs torchao, bitsandbytes and kernels). Each
prints something once per process on stderr, none of it about anything the command does:

- transformers (``transformers.utils.import_utils``): "`CLIPImageProcessor` requires torchvision (not installed);
  falling back to `CLIPImageProcessorPil`", once per class Diffusers' pipeline modules name at import (for
  IP-Adapter image encoders we never use); the fallback is exactly what transformers would use.
- torchao (``torchao``): "Failed to load .../torchao/_C_*.so: ..." for its optional C++ kernels built for another
  torch or CUDA (torchao falls back to its Python paths; nothing we run needs them).
- torch (``torch.utils._pytree``): "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
  torch.compile ... deprecated", torchao registering its enums the old way.
- bitsandbytes (``bitsandbytes.backends.cpu.ops``): "Failed to load CPU gemm_4bit_forward from kernels-community:
  ..." (it falls back to its own CPU kernel).
- Diffusers (``diffusers.quantizers.torchao.torchao_quantizer``): "Unable to import `torchao` Tensor objects" (the
  torchao release renamed classes Diffusers lists for ``torch.load``'s allow-list of torchao checkpoints).
- kernels (``kernels._internals.hf_hub``, 0.19): "Skipping publisher trust check for 'kernels-community/...' because
  Hugging Face Hub is in offline mode." when bitsandbytes looks up its optional CPU kernel offline (the kernel is
  not used: bitsandbytes falls back, the notice above).

Only these messages are dropped, only on those loggers and only inside the ``with`` block: every other warning
still shows, and the same messages show when the user's own code triggers them.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

# logger name → the messages dropped on it (matched with ``re.search`` against the formatted message).
KNOWN_IMPORT_NOISE: dict[str, re.Pattern[str]] = {
    "transformers.utils.import_utils": re.compile(
        r"^`\w+` requires torchvision \(not installed\); falling back to `\w+Pil`"
    ),
    "torchao": re.compile(r"^Failed to load \S*torchao\S*\.so: "),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
    "bitsandbytes.backends.cpu.ops": re.compile(r"^Failed to load CPU gemm_4bit_forward from kernels-community"),
    "diffusers.quantizers.torchao.torchao_quantizer": re.compile(r"^Unable to import `torchao` Tensor objects"),
    "kernels._internals.hf_hub": re.compile(r"^Skipping publisher trust check for 'kernels-community/[\w.-]+' "
                                            r"because Hugging Face Hub is in offline mode"),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def quiet_third_party_imports() -> Iterator[None]:
    """Drop the known import-time notices above while Diffusers pipeline and model modules are imported.

    Example:
    ```py
    >>> with quiet_third_party_imports():
    ...     module = importlib.import_module("diffusers_omni.pipelines.flux")
    ```
    """
    installed = []
    for name, pattern in KNOWN_IMPORT_NOISE.items():
        logger, drop = logging.getLogger(name), _DropKnownNoise(pattern)
        logger.addFilter(drop)
        installed.append((logger, drop))
    try:
        yield
    finally:
        for logger, drop in installed:
            logger.removeFilter(drop)


# The name its first callers use (it dropped only transformers' torchvision notice then).
quiet_torchvision_fallback = quiet_third_party_imports
