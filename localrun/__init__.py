"""localrun: a local LLM runner for one desktop.

`localrun.LLM` is imported lazily so that torch-free parts (the CLI's `plan`, `pull`,
`models`, and the `layerplan` package) start without importing torch.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from localrun.api import LLM
        return LLM
    raise AttributeError(f"module 'localrun' has no attribute {name!r}")
