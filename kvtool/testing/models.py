"""The offline real test models, where tests import them from (they live in kvtool.models.offline)."""

from kvtool.models.offline import (GEMMA_PIP, QWEN_NAME, QWEN_PARTS, QWEN_PIP, QWEN_SIZE, gemma3_gguf,
                                   pip_install_no_deps, qwen25_gguf, smollm2_gguf)

__all__ = ["GEMMA_PIP", "QWEN_NAME", "QWEN_PARTS", "QWEN_PIP", "QWEN_SIZE", "gemma3_gguf", "pip_install_no_deps",
           "qwen25_gguf", "smollm2_gguf"]
