"""Python 3.11 only, for the tests of Megatron-LM core_v0.19 (its `megatron.training` imports
`typing.override`, new in 3.12): typing_extensions' backport in its place, the same decorator
(it marks the method and returns it). Put first on PYTHONPATH by tests/megatron_lm_jobs.py
where the interpreter lacks it; a user runs core_v0.19 on the Python it asks for."""

import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
