"""`kvtool bench peers`: kvtool serve beside llama.cpp's llama-server, vLLM and transformers on one model.

    from kvtool.bench.peers import PeersConfig, run_peers
    record = run_peers(PeersConfig(model="smollm2", engines=["kvtool", "llama.cpp"], quick=True))
"""

from kvtool.bench.peers.config import PeersConfig
from kvtool.bench.peers.harness import run_peers

__all__ = ["PeersConfig", "run_peers"]
