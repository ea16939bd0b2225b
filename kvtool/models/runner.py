"""A lean forward pass for Qwen3, Qwen2/Qwen2.5, Llama and Gemma 3 (kvtool.models.gemma3) with an explicit KV cache.

Module and parameter names match the Hugging Face checkpoints, so weights load by name (the layers are in
kvtool.models.layers). run(ForwardPlan) packs the new tokens of several sequences, each over its own KVCache, in a row.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.cache.kv import KVCache
from kvtool.config import is_whole
from kvtool.errors import InvalidParameterError
from kvtool.kernels import cpu_gemm, quant
from kvtool.kernels.cpu_decode import GEMV_MAX_ROWS
from kvtool.models import cpu_prefill, cpu_step
from kvtool.models.gemma3 import GemmaBackbone, is_gemma
from kvtool.models.layers import AttentionTap, Backbone, ForwardPlan, RMSNorm, Tap
from kvtool.models.rope import cos_sin, inv_frequencies
from kvtool.models.spec import ModelSpec

__all__ = ["AttentionTap", "ForwardPlan", "ModelRunner", "RMSNorm", "Tap"]  # the layers' names stay importable here


class ModelRunner(nn.Module):
    """Forward pass over a KVCache. `model.*` and `lm_head` match HF parameter names."""

    def __init__(self, spec: ModelSpec, hf_config=None):
        super().__init__()
        self.spec = spec
        self.model = GemmaBackbone(spec) if is_gemma(spec) else Backbone(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.zeros(0), persistent=False)
        self.register_buffer("inv_freq_local", torch.zeros(0), persistent=False)  # sliding layers' (Gemma 3)
        self.set_rope(hf_config)
        self._head_bf16: torch.Tensor | None = None  # after quantize_int4(): the head in bf16, or in 8 bits where
        self._head_q8: quant.Int8Weight | None = None  # the C++ ops run (quant.small_head)
        self._head_packed: cpu_gemm.PackedWeight | None = None  # after pack_cpu_gemm()
        self._cpu_step: cpu_step.DecodeStep | None = None  # after use_cpu_decode()
        self._cpu_prefill: cpu_prefill.PrefillPass | None = None  # after use_cpu_decode() or use_cpu_prefill()
        self.held_once = False  # whether hold_weights_once() dropped dense copies
        self.register_load_state_dict_post_hook(lambda module, _keys: module._repack_cpu_gemm())

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def weights(self) -> str:
        """"int4" once quantize_int4() packed the projections, "bf16" once pack_cpu_gemm(bf16) did, else "dense"."""
        if self._head_bf16 is not None or self._head_q8 is not None:
            return "int4"
        return "bf16" if self._head_packed is not None and self._head_packed.half else "dense"

    @property
    def precision(self) -> str:
        """The dtype, plus "/int4" or "/bf16" for packed projections ("/int4+bf16" where int4's products of many
        rows run in bf16): what the KV computed here depends on."""
        dtype = str(self.dtype).replace("torch.", "")
        wide = "+bf16" if self.weights == "int4" and self._head_packed is not None and self._head_packed.half else ""
        return dtype if self.weights == "dense" else f"{dtype}/{self.weights}{wide}"

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def output_weight(self) -> torch.Tensor:
        """The head's [V, hidden] values (made anew, exactly, where hold_weights_once() dropped them)."""
        packed = self._head_packed  # (int4 keeps the dense head; its packed copy serves wide products only)
        if packed is not None and self.weights != "int4" and (packed.held is None or packed.half):
            return packed.dense
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def fuse(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self._weights_replaced()

    def _weights_replaced(self) -> None:
        """fuse(), packing, int4 or a move swapped weight objects: decode steps gather them anew."""
        if getattr(self, "_cpu_step", None) is not None:
            self._cpu_step = cpu_step.DecodeStep(self)

    def _apply(self, fn, *args, **kwargs):
        if self.held_once:
            raise ValueError("this runner holds its packed weights once (hold_weights_once()), so it cannot be moved "
                             "or converted; load the model again with the device and dtype wanted")
        out = super()._apply(fn, *args, **kwargs)
        self._weights_replaced()
        return out

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of final hidden states h [..., hidden]."""
        if self.weights == "int4":
            return quant.head_logits(h, self.output_weight, self._head_bf16, self._head_packed, self._head_q8)
        if self._head_packed is not None:  # bf16: few rows in fp32 through the C++ gemv
            return cpu_gemm.packed_linear(h, self._head_packed, exact_rows=GEMV_MAX_ROWS).float()
        return F.linear(h, self.output_weight).float()

    def decode_weight_bytes(self) -> int:
        """Weight bytes one batch-1 decode step reads: every projection and the head (embedding rows,
        norms and biases aside). Memory bandwidth divided by this bounds CPU decode tokens/s."""
        total = 0
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn._wqkv] if attn._wqkv is not None else [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
            gate_up = [mlp._wgu] if mlp._wgu is not None else [mlp.gate_proj.weight, mlp.up_proj.weight]
            outs = [getattr(m, "packed", m.weight) for m in (attn.o_proj, mlp.down_proj)]  # Int4Linear.packed
            total += sum(w.nbytes for w in (*qkv, *gate_up, *outs))
        heads = (self._head_q8, self._head_bf16, self._head_packed, self.output_weight)  # the first one held
        return total + next(w for w in heads if w is not None).nbytes

    @torch.inference_mode()
    def quantize_int4(self) -> None:
        """Pack every projection in 4 bits for CPU decode, and copy the head to 8 bits (bf16 without the C++ ops).

        Needs fuse() first. Each dense weight is overwritten in place with the values its 4-bit grid stands for,
        so prefill and decode multiply by the same weights and the HF-named parameters are views of them (until
        hold_weights_once()). The dense head stays: decode's top logits are made from it (quant.head_logits).
        Where oneDNN runs (kvtool.kernels.cpu_gemm), products of more than quant.MAX_ROWS rows go through packed
        copies of those values and of the head, in bf16 where oneDNN's bf16 GEMM runs (quant.wide_dtype)."""
        if self.weights == "int4":
            return
        if self.cpu_gemm_packed:
            raise ValueError("quantize_int4() needs the dense projections; call it before pack_cpu_gemm()")
        pairs = [(layer.self_attn, layer.mlp) for layer in self.model.layers]
        if any(attn._wqkv is None or mlp._wgu is None for attn, mlp in pairs):
            raise ValueError("quantize_int4() needs the fused projections; call fuse() first")
        for attn, mlp in pairs:  # check all before changing any
            for weight in (attn._wqkv, mlp._wgu, attn.o_proj.weight, mlp.down_proj.weight):
                if reason := quant.unsupported(weight):
                    raise ValueError(reason)

        wide = quant.wide_dtype(self.output_weight)  # oneDNN's, for the products of many rows

        def snap(weight: torch.Tensor) -> quant.Int4Weight:
            packed = quant.quantize_int4(weight)
            weight.copy_(packed.dense)
            packed.dense = weight
            packed.wide = cpu_gemm.pack(weight, wide) if wide else None
            if packed.wide is not None and packed.wide.half:
                packed.wide.held = None  # oneDNN's bf16 copy is all the product needs; `dense` keeps the values
            return packed

        for attn, mlp in pairs:
            attn._wqkv, mlp._wgu = snap(attn._wqkv), snap(mlp._wgu)
            attn.o_proj = quant.Int4Linear(attn.o_proj, snap(attn.o_proj.weight))
            mlp.down_proj = quant.Int4Linear(mlp.down_proj, snap(mlp.down_proj.weight))
        self._head_packed = cpu_gemm.pack(self.output_weight, wide) if wide else None
        self._head_q8 = small = quant.small_head(self.output_weight)
        half = self._head_packed is not None and self._head_packed.half  # its bf16 values serve as the copy
        self._head_bf16 = None if small else self._head_packed.held if half else self.output_weight.detach().bfloat16()
        if small is not None and half:  # oneDNN's copy is all the wide products need
            self._head_packed.held = None
        self._weights_replaced()

    @property
    def cpu_gemm_packed(self) -> bool:
        return self._head_packed is not None

    @torch.inference_mode()
    def pack_cpu_gemm(self, dtype: torch.dtype = torch.float32) -> str | None:
        """Give every fused projection and the head a oneDNN-packed copy for CPU matmuls (kvtool.kernels.cpu_gemm),
        in fp32 or in bf16 (rounded copies: `weights` then says "bf16"; hold_weights_once() drops the fp32 ones).

        Needs fuse() and dense fp32 weights on the CPU; returns None once packed, else why it was not
        (the model then runs plain F.linear, as before). The dense weights stay as they are."""
        if self.weights != "dense":
            return f"the projections are {self.weights}"
        if self.cpu_gemm_packed:
            return None
        pairs = [(layer.self_attn, layer.mlp) for layer in self.model.layers]
        if any(attn._wqkv is None or mlp._wgu is None for attn, mlp in pairs):
            return "the projections are not fused (call fuse() first)"
        if reason := cpu_gemm.unsupported(self.output_weight, dtype):
            return reason
        for attn, mlp in pairs:
            attn._wqkv, mlp._wgu = cpu_gemm.pack(attn._wqkv, dtype), cpu_gemm.pack(mlp._wgu, dtype)
            attn.o_proj = cpu_gemm.PackedLinear(attn.o_proj, cpu_gemm.pack(attn.o_proj.weight, dtype))
            mlp.down_proj = cpu_gemm.PackedLinear(mlp.down_proj, cpu_gemm.pack(mlp.down_proj.weight, dtype))
        self._head_packed = cpu_gemm.pack(self.output_weight, dtype)
        self._weights_replaced()
        return None

    def use_cpu_decode(self, on: bool = True) -> str | None:
        """Run decode steps (one new token per sequence) through kvtool.kernels.cpu_decode, and prefill chunks
        through kvtool.models.cpu_prefill (on), or both through the reference forward (off).
        Returns None when the requested path is set, else why the C++ path cannot run (the reference stays)."""
        reason = self.use_cpu_prefill(on)
        self._cpu_step = cpu_step.DecodeStep(self) if on and reason is None else None
        return reason

    def use_cpu_prefill(self, on: bool = True) -> str | None:
        """Run chunks of more than one new token (prefill) through kvtool.models.cpu_prefill (on) or the reference
        forward (off); decode steps are left as they are. Returns None or why the C++ path cannot run."""
        reason = cpu_step.unsupported(self) if on else None
        self._cpu_prefill = cpu_prefill.PrefillPass(self) if on and reason is None else None
        return reason

    @property
    def cpu_decode(self) -> bool:
        return self._cpu_step is not None

    @property
    def cpu_prefill(self) -> bool:
        return self._cpu_prefill is not None

    @property
    def forward_path(self) -> str:  # "cpu-ops" where the C++ ops run this runner's steps (use_cpu_decode)
        return "cpu-ops" if self.cpu_decode or self.cpu_prefill else "reference"

    @torch.inference_mode()
    def hold_weights_once(self) -> int:
        """Drop the dense copy of every packed weight whose oneDNN bytes the decode gemv reads as well
        (kvtool.kernels.cpu_gemm), and of every int4 projection with a oneDNN copy for its wide products (its
        codes stand for the values exactly): the HF-named parameters they back leave the module (a tied
        embedding reads the head's rows) and `dense` values are made on demand. The runner can no longer be
        moved or take a state dict. Returns the bytes let go; kvtool.load calls it after packing."""
        freed = 0
        for weight, modules in self._weight_slots():
            if isinstance(weight, quant.Int4Weight):  # its codes make its values once no oneDNN copy holds them
                drop = weight.held is not None and weight.wide is not None and (
                    weight.wide.held is None or weight.wide.drop_dense())
                freed += weight.held.numel() * weight.held.element_size() if drop else 0
                weight.held = None if drop else weight.held
            else:
                drop = isinstance(weight, cpu_gemm.PackedWeight) and weight.drop_dense()
                freed += weight.nbytes if drop else 0
            for module in modules if drop else ():
                module.weight = None
        head, tied = self._head_packed, self.spec.tie_word_embeddings
        if self.weights == "int4":  # the dense head stays: decode's top logits and the embedding read it
            head = None
        if head is not None and (not tied or type(self.model.embed_tokens) is nn.Embedding) and head.drop_dense():
            freed += head.nbytes
            if tied:
                self.model.embed_tokens = cpu_gemm.PackedEmbedding(head)
            else:
                self.lm_head.weight = None
        self.held_once = freed > 0
        self._weights_replaced()
        return freed

    def _weight_slots(self):
        """(weight, the modules whose HF-named parameter it backs) for each layer's fused and output projections."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            yield attn._wqkv, (attn.q_proj, attn.k_proj, attn.v_proj)
            yield mlp._wgu, (mlp.gate_proj, mlp.up_proj)
            yield getattr(attn.o_proj, "packed", None), (attn.o_proj,)
            yield getattr(mlp.down_proj, "packed", None), (mlp.down_proj,)

    def _packed_weights(self) -> list[cpu_gemm.PackedWeight]:
        found = [self._head_packed] if self._head_packed is not None else []
        return found + [w for w, _ in self._weight_slots() if isinstance(w, cpu_gemm.PackedWeight)]

    @torch.inference_mode()
    def _repack_cpu_gemm(self) -> None:
        """load_state_dict() copied new values into the dense weights: the packed copies follow."""
        if self.weights == "int4":  # the codes and oneDNN copies would keep the old values
            raise ValueError("this runner's projections are packed in int4; load the model anew")
        if self.held_once or self.weights == "bf16":
            raise ValueError(f"this runner holds its packed weights once{' in bf16' * (self.weights == 'bf16')} "
                             "(hold_weights_once()); load the model anew")
        for weight in self._packed_weights():
            weight.packed = cpu_gemm.pack(weight.dense).packed

    def new_cache(self, capacity: int = 256) -> KVCache:
        s = self.spec
        return KVCache.empty(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype, self.device, capacity)

    def set_rope(self, hf_config=None, device=None) -> None:
        """The inverse frequencies of the global layers (inv_freq) and, for Gemma 3, of the sliding ones."""
        spec = self.spec
        inv_freq, self.rope_scaling = inv_frequencies(spec.rope, spec.head_dim, hf_config)
        self.inv_freq = inv_freq.to(device)
        if spec.rope_local:
            local, scaling = inv_frequencies(spec.rope_local, spec.head_dim, hf_config)
            if scaling != self.rope_scaling:
                raise ValueError(f"the sliding layers' RoPE scales attention by {scaling}, the global ones by "
                                 f"{self.rope_scaling}; kvtool needs one scale")
            self.inv_freq_local = local.to(device)

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        """The inverse frequencies layer `layer` rotates its keys with (skill relocation re-rotates with them)."""
        return self.inv_freq_local if layer in self.spec.sliding_layers else self.inv_freq

    def rope_groups(self) -> list[tuple[list[int], torch.Tensor]]:
        """(layers, inv_freq) for each RoPE base in use: one group, or Gemma 3's global and sliding layers."""
        local = self.spec.sliding_layers
        if not local:
            return [(list(range(self.spec.num_layers)), self.inv_freq)]
        return [([i for i in range(self.spec.num_layers) if i not in local], self.inv_freq),
                (local, self.inv_freq_local)]

    def rope_cos_sin(self, positions: torch.Tensor):
        """cos, sin [T, head_dim]; for Gemma 3 each is a (global, local) pair that each layer picks from."""
        cos, sin = cos_sin(self.inv_freq, positions, self.rope_scaling, self.dtype)
        if not self.spec.rope_local:
            return cos, sin
        cos_l, sin_l = cos_sin(self.inv_freq_local, positions, self.rope_scaling, self.dtype)
        return (cos, cos_l), (sin, sin_l)

    @torch.inference_mode()
    def forward(self, input_ids, cache: KVCache, positions=None, logits: str = "last", tap: Tap | None = None):
        """Run tokens [T] through the model, appending their KV to `cache`.

        logits: "last" -> [1, V], "all" -> [T, V] (fp32), "none" -> None.
        positions default to the cache slots they occupy (cache.offset + arange(T)).
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        if positions is not None:
            positions = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        return self.forward_batch([(ids, cache)], positions, logits, tap)[0]

    def forward_batch(self, seqs: list[tuple[torch.Tensor, KVCache]], positions=None, logits: str | list = "last",
                      tap: Tap | None = None) -> list[torch.Tensor | None]:
        """run(ForwardPlan(seqs, positions, logits, tap)): the path this runner takes by default."""
        return self.run(ForwardPlan(seqs, positions, logits, tap))

    @torch.inference_mode()
    def run(self, plan: ForwardPlan) -> list[torch.Tensor | None]:
        """One forward for several sequences, each (new token ids [T_i], its own KVCache), packed into one
        [1, sum T_i] row so every matmul runs once (attention stays per sequence); per-sequence logits as in
        forward(). The one place that picks the forward: the C++ CPU ops' decode step (one new token each) or
        prefill pass where this runner has them (use_cpu_decode) and the plan allows them, else the reference."""
        seqs, positions, logits, tap = plan.seqs, plan.positions, plan.logits, plan.tap
        ops = tap is None and plan.path != "reference"
        ids = [torch.as_tensor(i, dtype=torch.long, device=self.device).reshape(-1) for i, _ in seqs]
        caches = [c for _, c in seqs]
        lengths = [int(i.shape[0]) for i in ids]
        if (ops and self._cpu_step is not None and all(t == 1 for t in lengths) and logits == "last"
                and len({id(c) for c in caches}) == len(caches) and self._cpu_step.takes(caches)):
            at = [c.offset for c in caches] if positions is None else [int(p) for p in positions]
            out = self._cpu_step(torch.cat(ids), caches, at)
            return [out[j : j + 1] for j in range(len(seqs))]
        if positions is None:
            positions = torch.cat([torch.arange(c.offset, c.offset + t, device=self.device)
                                   for c, t in zip(caches, lengths)])
        cos, sin = self.rope_cos_sin(positions)
        x = self.model.embed_tokens(torch.cat(ids) if len(ids) > 1 else ids[0])[None]
        if (ops and self._cpu_prefill is not None and x.dtype == torch.float32
                and len({id(c) for c in caches}) == len(caches) and self._cpu_prefill.takes(caches)):
            x = self._cpu_prefill(x[0], caches, lengths, cos, sin)[None]
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, i, caches, positions, lengths, tap)
        if logits == "none":
            return [None] * len(seqs)
        ends = torch.tensor(lengths, device=self.device).cumsum(0)
        if logits == "last":
            h = self.model.norm(x[0, ends - 1])
            out = self.head(h)
            return [out[j : j + 1] for j in range(len(seqs))]
        if logits == "all":
            out = self.head(self.model.norm(x[0]))
            return list(out.split(lengths))
        # one mode per sequence: the head runs on its last row, or on all its rows
        every, end = [m == "all" for m in logits], 0
        rows = []
        for t, a in zip(lengths, every):
            end += t
            rows += range(end - t, end) if a else [end - 1]
        out = self.head(self.model.norm(x[0, torch.tensor(rows, device=self.device)]))
        return list(out.split([t if a else 1 for t, a in zip(lengths, every)]))

    def check_ids(self, ids: torch.Tensor) -> None:
        """InvalidParameterError naming the ids outside the vocabulary (checked where ids are on the CPU)."""
        vocab = self.spec.vocab_size
        if ids.device.type == "cpu" and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise InvalidParameterError(f"token ids must be in [0, {vocab}); got "
                                        f"{[t for t in ids.tolist() if not 0 <= t < vocab][:5]}")

    def prefill(self, input_ids: Iterable[int] | torch.Tensor, cache: KVCache, chunk: int = 512,
                logits: str = "last", tap: Tap | None = None):
        """Forward in chunks of `chunk` tokens; returns the logits of the last chunk (or all, concatenated)."""
        ids = torch.as_tensor(input_ids if isinstance(input_ids, torch.Tensor) else list(input_ids),
                              dtype=torch.long).reshape(-1)
        if not is_whole(chunk, 1):
            raise InvalidParameterError(f"chunk must be an integer >= 1 tokens, got {chunk!r}")
        self.check_ids(ids)
        cache.reserve(cache.offset + ids.shape[0] + 1)
        outs = []
        for start in range(0, ids.shape[0], chunk):
            part = ids[start : start + chunk]
            is_last = start + chunk >= ids.shape[0]
            mode = logits if (logits == "all" or is_last) else "none"
            out = self.forward(part, cache, logits=mode, tap=tap)
            if out is not None:
                outs.append(out)
        if not outs:
            return None
        return torch.cat(outs) if logits == "all" else outs[-1]
