"""Other engines kvtool can serve on (kvtool serve --engine NAME); kvtool's own engine is kvtool.engine."""

ENGINES = ("kvtool", "vllm")
