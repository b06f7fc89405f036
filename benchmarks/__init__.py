"""Benchmarks and the scripts that render measured numbers into the docs.

One path rule: this folder is a package, run from the repository root as ``python -m benchmarks.<script>`` (for
example ``python -m benchmarks.docs_tables --check``); the scripts import ``diffusers_omni`` by its public names and
each other as ``benchmarks.<script>``, and never edit ``sys.path``.
"""
