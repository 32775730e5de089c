"""kestrel: a compact LLM serving engine."""
from kestrel import envs  # noqa: F401  (first: environment knobs are read once, at import)
from kestrel.core.outputs import RequestOutput
from kestrel.core.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers: import it only when asked for.
    if name == "Engine":
        from kestrel.engine.engine import Engine
        return Engine
    if name == "EngineConfig":
        from kestrel.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
