"""kvtool inside other engines: the engines `kvtool serve --engine NAME` runs on besides kvtool's own
(kvtool.engine), and what a plain server of theirs mounts (vLLM's KV connector: kvtool.integrations.vllm)."""

ENGINES = ("kvtool", "vllm")
