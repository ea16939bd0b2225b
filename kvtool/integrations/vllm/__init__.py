"""kvtool serve --engine vllm: vLLM schedules and runs the forward passes; kvtool keeps its HTTP surface.

The HTTP layer sees the same seam as with kvtool's engine (a worker of Handles that yield TokenEvents,
and a ServedModel), so the routes, tool parser, raw token stream, template render, timings and metrics
are kvtool's own. vLLM runs in this process (LLMEngine, one worker thread), with the settings of
kvtool.integrations.vllm.settings applied before vllm is imported.
"""


def available() -> bool:
    """Whether vllm can be imported here (the [vllm] extra is installed)."""
    from importlib.util import find_spec

    return find_spec("vllm") is not None
