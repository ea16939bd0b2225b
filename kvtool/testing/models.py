"""The offline real test models, where tests import them from (they live in kvtool.models.offline)."""

from kvtool.models.offline import (QWEN_NAME, QWEN_PARTS, QWEN_PIP, QWEN_SIZE,
                                   pip_install_no_deps, qwen25_gguf, smollm2_gguf)

__all__ = ["QWEN_NAME", "QWEN_PARTS", "QWEN_PIP", "QWEN_SIZE", "pip_install_no_deps", "qwen25_gguf", "smollm2_gguf"]
