"""Sampling many requests at once: one pass over their stacked logits, one host read for all of them.

Continuous batching runs many requests per step. Each request's own Sampler costs a handful of kernels
and one host sync, so 64 sampling streams cost 64 syncs a step. sample_rows() does Sampler's math for
every row together, with each row's parameters as a column of a tensor:
- penalties, logit bias and the min_tokens hold, row by row, and only on the rows that ask for them;
- the structured-output masks of every constrained row, computed together (kvtool.engine.constraint.allowed_rows);
- then temperature, top-k, min-p and top-p, in Sampler's order (vLLM's);
- then one draw per row.
The chosen tokens, their logprobs and the top logprobs come back in a single transfer.

The draw is where it differs from Sampler. Sampler draws with torch.multinomial from the request's own
generator, so a seeded request repeats exactly. Here every row draws in one exponential race on the
global generator: argmax of p / E with E ~ Exp(1) (drawn as -log U: torch's CPU exponential_ is ~4x slower
than rand and log) picks token i with probability p_i. Seeded requests
therefore keep their own Sampler, and sample_rows refuses them. The distributions themselves are
Sampler's: processed_logits() equals Sampler's penalised, tempered and truncated logits row by row
(tested).
"""

from __future__ import annotations

import torch

from kvtool.engine.sampling import Sample, Sampler

OFF = float("inf")  # a top_p no cumulative sum reaches: that row keeps every token
TOP_P_CANDIDATES = 1024  # the tokens top-p looks at first (top_p_drop)


def batchable(sampler: Sampler) -> bool:
    """Whether sample_rows may draw for this request (it has no generator of its own to replay)."""
    return sampler.generator is None


def processed_logits(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """[n, V] -> each row's logits as its Sampler would draw from them: penalties (and bias, held stop tokens),
    then for sampled rows temperature and the truncations (-inf where truncated). Greedy rows get the first only."""
    x = logits[:, : samplers[0].vocab_size].float()
    adjusted = [i for i, s in enumerate(samplers) if s.adjusts]
    if adjusted:
        x = x.clone()
        for i in adjusted:
            x[i] = samplers[i]._adjust(x[i], constrain=False)
    constrained = [i for i, s in enumerate(samplers) if s.constraint is not None]
    if constrained:
        from kvtool.engine.constraint import allowed_rows

        ok = allowed_rows([samplers[i].constraint for i in constrained], x.device)
        if len(constrained) < len(samplers):  # the free rows allow everything
            rows, ok = ok, torch.ones(x.shape, dtype=torch.bool, device=x.device)
            ok[torch.tensor(constrained, device=x.device)] = rows
        x = x.masked_fill(~ok, float("-inf"))
    sampled = [not s.p.greedy for s in samplers]
    if not any(sampled):
        return x
    dev = x.device
    col = lambda values: torch.tensor(values, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
    x = x / col([s.p.temperature if on else 1.0 for s, on in zip(samplers, sampled)])
    vocab = x.shape[1]
    ks = [s.p.top_k if on and 0 < s.p.top_k < vocab else 0 for s, on in zip(samplers, sampled)]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k - 1, 0) for k in ks], device=dev)[:, None])
        kth = kth.masked_fill(col([k == 0 for k in ks]) > 0, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    min_p = [s.p.min_p if on else 0.0 for s, on in zip(samplers, sampled)]
    if any(min_p):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < col(min_p) * probs.amax(-1, keepdim=True), float("-inf"))
    top_p = [s.p.top_p if on and s.p.top_p < 1.0 else OFF for s, on in zip(samplers, sampled)]
    if any(p != OFF for p in top_p):
        x = x.masked_fill(top_p_drop(x, col(top_p)), float("-inf"))
    return x


def top_p_drop(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n, V] True where a row's top-p truncation drops the token (top_p [n, 1]; the token that crosses top_p is
    kept): over the TOP_P_CANDIDATES most likely tokens where they hold the row's nucleus (a sort of the whole
    vocabulary costs ~30x a topk of 1,024 on a CPU), else over the row's whole sorted vocabulary."""
    probs = torch.softmax(x, dim=-1)
    top, order = probs.topk(min(TOP_P_CANDIDATES, x.shape[-1]), dim=-1)  # in descending order, as a sort's first
    keep_all = torch.isinf(top_p)
    drop = torch.ones_like(x, dtype=torch.bool).masked_fill_(keep_all, False)
    drop.scatter_(1, order, (top.cumsum(-1) - top >= top_p) & ~keep_all)
    short = ((top.sum(-1, keepdim=True) < top_p) & ~keep_all)[:, 0].nonzero()[:, 0]  # nucleus past the candidates
    if len(short):
        top, order = probs[short].sort(dim=-1, descending=True)
        drop[short] = torch.zeros_like(top, dtype=torch.bool).scatter_(1, order, top.cumsum(-1) - top >= top_p[short])
    return drop


@torch.inference_mode()
def sample_rows(samplers: list[Sampler], logits: torch.Tensor) -> list[Sample]:
    """One Sample per row of logits [n, V] (row i drawn with samplers[i]'s parameters), read back at once."""
    if len(samplers) != logits.shape[0]:
        raise ValueError(f"{len(samplers)} samplers for {logits.shape[0]} rows of logits")
    if not all(batchable(s) for s in samplers):
        raise ValueError("a seeded request draws from its own generator; sample it with its Sampler")
    x = processed_logits(samplers, logits)
    tokens = x.argmax(-1)
    sampled = [not s.p.greedy for s in samplers]
    if any(sampled):
        race = torch.softmax(x, dim=-1).div_(torch.rand_like(x).log_().neg_()).argmax(-1)  # -log U ~ Exp(1)
        mask = torch.tensor(sampled, device=x.device)
        tokens = torch.where(mask, race, tokens) if not all(sampled) else race
    asks = [i for i, s in enumerate(samplers) if s.p.logprobs is not None]
    if not asks:
        return [Sample(t) for t in tokens.tolist()]
    # the logprobs are of the raw model distribution, as Sampler reports them
    idx = torch.tensor(asks, device=x.device)
    raw = torch.log_softmax(logits[:, : samplers[0].vocab_size].float().index_select(0, idx), dim=-1)
    chosen = raw.gather(1, tokens.index_select(0, idx)[:, None])[:, 0]
    k = max(samplers[i].p.logprobs for i in asks)
    parts = [tokens.float(), chosen]
    if k > 0:
        values, ids = torch.topk(raw, k, dim=-1)
        parts += [values.reshape(-1), ids.float().reshape(-1)]  # ids < 2^24: exact in fp32
    out = torch.cat(parts).tolist()
    n, m = len(samplers), len(asks)
    samples = [Sample(int(t)) for t in out[:n]]
    for j, i in enumerate(asks):
        want = samplers[i].p.logprobs
        row = slice(n + m + j * k, n + m + j * k + want)
        ids = out[n + m + m * k + j * k : n + m + m * k + j * k + want]
        samples[i] = Sample(samples[i].token, out[n + j],
                            [(int(t), v) for t, v in zip(ids, out[row])] if want > 0 else None)
    return samples
