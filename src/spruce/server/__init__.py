"""OpenAI-compatible HTTP server: `create_app(EngineLoop(engine), model_name=...)`, or `spruce serve`.

Imports are lazy so that `spruce --help` does not load FastAPI or torch.
"""

__all__ = ["EngineLoop", "create_app"]


def __getattr__(name):
    if name == "create_app":
        from spruce.server.app import create_app

        return create_app
    if name == "EngineLoop":
        from spruce.server.engine_loop import EngineLoop

        return EngineLoop
    raise AttributeError(name)
