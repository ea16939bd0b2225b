"""`kvtool bench peers` settings: which engines, the model, how many rounds, the thread counts, the size of every
workload (--quick: tiny) and the KV and prefix-cache budgets every engine gets."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from kvtool.errors import InvalidParameterError

ENGINE_NAMES = ("kvtool", "kvtool-int4", "kvtool-bf16", "llama.cpp", "vllm", "vllm-bf16", "kvtool-vllm",
                "transformers")
WORKLOAD_NAMES = ("memory", "decode", "ttft", "prefix", "streams", "layouts", "vllm-bench", "serve-long",
                  "serve-shared")


@dataclass(frozen=True)
class ClientLoad:
    """One workload of vLLM's `bench serve` client: ``prompts`` requests of ``prefix_tokens`` (one prefix all share)
    + ``input_tokens`` random tokens, ``output_tokens`` out, ``concurrency`` in flight at once."""
    prompts: int
    prefix_tokens: int
    input_tokens: int
    output_tokens: int
    concurrency: int

    def context(self) -> int:
        return self.concurrency * (self.prefix_tokens + self.input_tokens + self.output_tokens + 8)


# long prompts under concurrency: arriving prefills interleave with running decodes, as on a real server
CLIENT_LOADS = {"serve-long": ClientLoad(32, 0, 512, 128, 16), "serve-shared": ClientLoad(24, 1024, 128, 64, 8)}
QUICK_LOADS = {"serve-long": ClientLoad(4, 0, 32, 8, 2), "serve-shared": ClientLoad(4, 64, 16, 8, 2)}


def parse_threads(values: list) -> list[int]:
    """--threads values as counts: "all" is every core; each count once, in the order given."""
    try:
        counts = [(os.cpu_count() or 1) if str(v) == "all" else int(v) for v in values]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise InvalidParameterError(f"--threads {' '.join(map(str, values))}: give counts >= 1 or 'all'")
    return list(dict.fromkeys(counts))


def _all_scenarios() -> list[str]:
    from kvtool.bench.scenarios import SCENARIOS

    return list(SCENARIOS)


@dataclass
class PeersConfig:
    model: str = "smollm2"  # a GGUF file or an alias (smollm2, qwen25); llama.cpp serves the GGUF itself
    engines: list[str] = field(default_factory=lambda: list(ENGINE_NAMES))
    workloads: list[str] = field(default_factory=lambda: list(WORKLOAD_NAMES))
    decode_tokens: int = 256
    prompt_tokens: int = 32  # prompt before the timed decode
    ttft_lengths: list[int] = field(default_factory=lambda: [512, 2048])
    prefix_tokens: int = 2048
    suffix_tokens: int = 64
    streams: list[int] = field(default_factory=lambda: [8, 64])
    stream_tokens: int = 128  # tokens each concurrent stream generates
    stream_prompt_tokens: int = 32
    scenarios: list[str] = field(default_factory=_all_scenarios)
    scenario_requests: int = 6
    policy_paragraphs: int = 8
    tools: int = 6
    client_prompts: int = 32  # vllm-bench: vLLM's own client, random prompts with one shared prefix
    client_prefix_tokens: int = 1024
    client_input_tokens: int = 128  # random tokens after the shared prefix
    client_output_tokens: int = 64
    client_concurrency: int = 4
    repeats: int = 3
    warmup: int = 1
    rounds: int = 2  # every engine runs once per round, the rounds in alternating order (A B C C B A ...)
    kv_mib: int = 2048  # KV budget of every server's running requests (llama.cpp: its --ctx-size instead)
    prefix_cache_mib: int = 1024  # kvtool's prefix-cache budget (vLLM and llama.cpp keep prefixes in their KV)
    # one pass of every engine per count, each engine given the same count (harness.run_peers: one record per pass)
    threads: list[int] = field(default_factory=lambda: parse_threads([1, "all"]))
    client_loads: dict[str, ClientLoad] = field(default_factory=lambda: dict(CLIENT_LOADS))
    vllm_python: str | None = None  # None: $KVTOOL_VLLM_PYTHON, else this python
    vllm_dtype: str = "float32"  # as kvtool on CPU (the converted folders are fp32)
    settle_max_s: float = 180.0  # before each engine, wait up to this long for the load to decay (0: no wait)
    seed: int = 0
    quick: bool = False
    out_dir: str | None = None  # None: benchmarks/results/peers-<model>[-quick]

    def sized(self) -> "PeersConfig":
        """This config, shrunk to smoke-test sizes when quick."""
        if not self.quick:
            return self
        return replace(self, decode_tokens=16, ttft_lengths=[128], prefix_tokens=256, suffix_tokens=16, streams=[4],
                       stream_tokens=8, stream_prompt_tokens=16, scenarios=["shared-prefix", "timestamp"],
                       scenario_requests=2, policy_paragraphs=0, tools=1, repeats=1, warmup=1, client_prompts=4,
                       client_prefix_tokens=64, client_input_tokens=32, client_output_tokens=8, client_concurrency=2,
                       client_loads=dict(QUICK_LOADS),
                       settle_max_s=0.0)  # a smoke test times nothing worth waiting for

    def validate(self) -> "PeersConfig":
        for name, allowed in (("engines", ENGINE_NAMES), ("workloads", WORKLOAD_NAMES),
                              ("scenarios", _all_scenarios())):
            unknown = [x for x in getattr(self, name) if x not in allowed]
            if unknown or not getattr(self, name):
                raise InvalidParameterError(f"--{name}: unknown or none {unknown}; choose from {', '.join(allowed)}")
        sizes = {"decode_tokens": self.decode_tokens, "prompt_tokens": self.prompt_tokens,
                 "prefix_tokens": self.prefix_tokens, "suffix_tokens": self.suffix_tokens,
                 "stream_tokens": self.stream_tokens, "stream_prompt_tokens": self.stream_prompt_tokens,
                 "scenario_requests": self.scenario_requests, "repeats": self.repeats,
                 "threads": min(self.threads, default=0), "client_prompts": self.client_prompts,
                 "client_input_tokens": self.client_input_tokens,
                 "client_output_tokens": self.client_output_tokens, "client_concurrency": self.client_concurrency,
                 "kv_mib": self.kv_mib, "prefix_cache_mib": self.prefix_cache_mib}
        bad = {k: v for k, v in sizes.items() if v < 1}
        bad.update({"ttft_lengths": self.ttft_lengths} if not self.ttft_lengths or min(self.ttft_lengths) < 1 else {})
        bad.update({"streams": self.streams} if not self.streams or min(self.streams) < 1 else {})
        bad.update({"settle_max_s": self.settle_max_s} if not self.settle_max_s >= 0 else {})
        if self.decode_tokens < 2:
            bad["decode_tokens"] = self.decode_tokens  # a rate needs two streamed tokens
        if self.rounds < 2:
            bad["rounds"] = self.rounds  # a median and a spread need every engine at least twice
        if self.client_prefix_tokens < 0:
            bad["client_prefix_tokens"] = self.client_prefix_tokens
        if bad or self.warmup < 0:
            raise InvalidParameterError(f"these must be >= 1 (--decode-tokens and --rounds >= 2, --warmup, "
                                        f"--client-prefix-tokens and --settle-max-s >= 0): {bad or 'warmup'}")
        if self.vllm_dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidParameterError(f"--vllm-dtype {self.vllm_dtype!r}: choose float32, bfloat16 or float16")
        return self

    def context(self) -> int:
        """KV tokens a server must hold at once: the longest request, or all streams together."""
        longest = max(self.ttft_lengths + [self.prefix_tokens + self.suffix_tokens + 8, 4096])
        together = max(self.streams) * (self.stream_prompt_tokens + self.stream_tokens + 8)
        client = [self.client_load(name).context() for name in ("vllm-bench", *self.client_loads)]
        return max(longest, together, *client) + 256

    def concurrency(self) -> int:
        """The most requests any workload sends at once."""
        return max(self.streams + [self.client_load(n).concurrency for n in ("vllm-bench", *self.client_loads)])

    def client_load(self, workload: str) -> ClientLoad:
        """The sizes of one `bench serve` workload: vllm-bench's from the --client-* options, the others fixed."""
        if workload == "vllm-bench":
            return ClientLoad(self.client_prompts, self.client_prefix_tokens, self.client_input_tokens,
                              self.client_output_tokens, self.client_concurrency)
        return self.client_loads[workload]

    def pass_threads(self) -> int:
        """The thread count of one pass's config (run_peers gives each pass a config of one count)."""
        if len(self.threads) != 1:
            raise ValueError(f"a pass runs at one thread count, not {self.threads}")
        return self.threads[0]
