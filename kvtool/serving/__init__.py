"""kvtool.serving: an OpenAI-compatible server that also shows raw tokens and the chat template.

`create_app` is imported lazily so `kvtool --help` does not pay for FastAPI.
"""

from kvtool.serving.config import ServerConfig

__all__ = ["create_app", "ServerConfig"]


def __getattr__(name):
    if name == "create_app":
        from kvtool.serving.app import create_app

        return create_app
    raise AttributeError(name)
