"""Model and pipeline classes for systems that Diffusers has no class for, written in Diffusers' style.

Each system is one subpackage (its models, its ``DiffusionPipeline`` subclass); the classes load the published
checkpoints' parameter names and shapes. They know nothing of attention routing or offload: the attention
declarations live in ``diffusers_omni.models`` and the Omni pipelines in ``diffusers_omni.pipelines``, as for the
architectures Diffusers ships.
"""
