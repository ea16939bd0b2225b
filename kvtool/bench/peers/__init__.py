"""`kvtool bench peers`: kvtool serve beside llama.cpp's llama-server, vLLM and transformers on one model, at
equal precision and equal threads.

    from kvtool.bench.peers import PeersConfig, run_peers
    records = run_peers(PeersConfig(model="smollm2", engines=["kvtool", "llama.cpp"], threads=[1, 2], quick=True))
"""

from kvtool.bench.peers.config import PeersConfig
from kvtool.bench.peers.harness import run_peers

__all__ = ["PeersConfig", "run_peers"]
