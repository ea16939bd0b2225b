"""Needle in a haystack: one fact placed at depths 0%…100% of a filler context, the model asked
about it. Per depth: accuracy (greedy answer contains the fact's number) and the attention the
answer position pays to the fact's tokens — the lost-in-the-middle curve.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtool.errors import InvalidParameterError
from kvtool.viz.probs import attention_pass

NAMES = ["Amara", "Bruno", "Chen", "Dalia", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]
PLACES = ["the harbour town", "the mountain village", "the old capital", "the river delta", "the desert oasis",
          "the island port", "the forest valley", "the northern plains", "the lake district", "the coastal city"]
DEEDS = ["repaired fishing nets by the pier", "painted the walls of the school", "studied the migration of birds",
         "baked bread for the market", "mapped the narrow streets", "tended a garden of herbs",
         "collected stories from the elders", "built a small wooden boat", "taught children to read",
         "sold woollen scarves at the fair", "restored an abandoned chapel", "kept bees behind the mill"]
SEASONS = ["spring", "summer", "autumn", "winter"]
# (fact, question, answer); the filler has no digits, so the answer occurs once.
NEEDLES = [("The secret passcode for the blue vault is 7314.", "What is the secret passcode for the blue vault?",
            "7314"),
           ("The lighthouse keeper's lucky number is 5829.", "What is the lighthouse keeper's lucky number?", "5829"),
           ("The red train departs from platform 46.", "From which platform does the red train depart?", "46")]

MAX_ANSWER = 24  # greedy tokens of each answer
QUESTION_ROOM = 160  # tokens beside the filler: chat template, instruction, question, answer


@dataclass
class NeedleResult:
    model: str
    context_tokens: int
    depths: list[float]
    trials: list[dict] = field(default_factory=list)  # one per (depth, needle)

    def per_depth(self) -> list[dict]:
        out = []
        for d in self.depths:
            ts = [t for t in self.trials if t["depth"] == d]
            out.append({"depth": d, "accuracy": float(np.mean([t["correct"] for t in ts])),
                        "attention_on_needle": float(np.mean([t["attention_on_needle"] for t in ts])),
                        "attention_on_needle_per_token": float(np.mean([t["per_token"] for t in ts])),
                        "n": len(ts)})
        return out

    def to_json(self) -> dict:
        return {"kind": "needle", "model": self.model, "context_tokens": self.context_tokens,
                "per_depth": self.per_depth(), "trials": self.trials}


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    return [f"In the {rng.choice(SEASONS)}, {rng.choice(NAMES)} from {rng.choice(PLACES)} {rng.choice(DEEDS)}."
            for _ in range(count)]


def needle_prompt(model, context_tokens: int, depth: float, needle: tuple[str, str, str], seed: int) -> str:
    """Chat prompt with ~context_tokens of filler, the fact at sentence index round(depth * count)."""
    rng = random.Random(seed)
    per_sentence = len(model.encode_rendered(" ".join(filler_sentences(random.Random(0), 20)))) / 20
    sentences = filler_sentences(rng, max(1, int(context_tokens / per_sentence)))
    sentences.insert(round(depth * len(sentences)), needle[0])
    doc = " ".join(sentences)
    question = f"Read the document, then answer.\n\n{doc}\n\nQuestion: {needle[1]} Answer with the number only."
    if not model.chat_template:
        return question + "\nAnswer:"
    return model.render([{"role": "user", "content": question}])


def run_trial(model, ids: list[int], span: tuple[int, int], answer: str, max_new: int = MAX_ANSWER) -> dict:
    n = len(ids)
    layers, heads = list(range(model.spec.num_layers)), list(range(model.spec.num_heads))
    on_needle = torch.zeros(len(layers), dtype=torch.float64)

    def consume(layer, part, probs):
        on_needle[layer] = probs[:, 0, span[0] : span[1]].sum(-1).mean().cpu().double()

    logits, cache = attention_pass(model, ids, layers, heads, [n - 1], consume, full=True)
    out, eot = [], set(model.end_of_turn_ids())
    for _ in range(max_new):  # greedy continuation on the same cache
        tok = int(logits.argmax(-1))
        if tok in eot:
            break
        out.append(tok)
        logits = model.runner.forward([tok], cache)
    text = model.decode(out, skip_special_tokens=True)
    share = float(on_needle.mean())
    return {"answer": text.strip(), "correct": answer in text, "attention_on_needle": share,
            "attention_on_needle_by_layer": on_needle.round(decimals=6).tolist(),
            "per_token": share / (span[1] - span[0]), "needle_tokens": [span[0], span[1]], "n_tokens": n}


def needle_experiment(model, context_tokens: int, depths: list[float], trials: int = 1, seed: int = 0,
                      progress: bool = True) -> NeedleResult:
    from kvtool.viz.tokens import find_spans, make_tokens

    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise InvalidParameterError(f"needle depths must be in [0, 1]; got {depths}")
    if not 1 <= trials <= len(NEEDLES):
        raise InvalidParameterError(f"--trials must be in 1..{len(NEEDLES)} (one needle each)")
    if context_tokens < 50:
        raise InvalidParameterError("--context-tokens must be at least 50")
    room = model.context_window - QUESTION_ROOM
    if context_tokens > room:  # the filler was built (and tokenized) before anything else looked at its length
        raise InvalidParameterError(f"--context-tokens {context_tokens} does not fit: the model's context window is "
                                    f"{model.context_window} tokens and the question and answer need about "
                                    f"{QUESTION_ROOM}; use at most {room}")
    res = NeedleResult(model.name, context_tokens, list(depths))
    for d in depths:
        for t in range(trials):
            needle = NEEDLES[t]
            prompt = needle_prompt(model, context_tokens, d, needle, seed + t)
            ids = model.encode_rendered(prompt) if model.chat_template else model.encode(prompt)
            if len(ids) + MAX_ANSWER > model.context_window:
                raise InvalidParameterError(f"the needle prompt came to {len(ids)} tokens, which leaves no room for "
                                            f"a {MAX_ANSWER}-token answer in the context window of "
                                            f"{model.context_window}; use a smaller --context-tokens")
            span = find_spans(make_tokens(model, ids), "text:" + needle[0])[0]
            trial = {"depth": d, "needle": needle[0], **run_trial(model, ids, span, needle[2])}
            res.trials.append(trial)
            if progress:
                print(f"  needle depth {d:.2f} trial {t + 1}/{trials}: {len(ids)} tokens, "
                      f"attention {trial['attention_on_needle']:.4f}, answer {trial['answer']!r}"
                      f" {'ok' if trial['correct'] else 'wrong'}", file=sys.stderr, flush=True)
    return res


def plot_needle(res: NeedleResult, path):
    from kvtool.viz.plots import pyplot, save

    plt = pyplot()
    rows = res.per_depth()
    x = [100 * r["depth"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [r["attention_on_needle"] for r in rows], "o-", color="C0", label="attention on needle")
    ax.set(xlabel="needle depth in context (%)", ylabel="attention on needle (answer row, mean layers/heads)",
           title=f"needle: {res.model}, ~{res.context_tokens} tokens")
    acc = ax.twinx()
    acc.plot(x, [r["accuracy"] for r in rows], "s--", color="C1", label="accuracy")
    acc.set(ylabel="accuracy", ylim=(-0.05, 1.05))
    fig.legend(loc="upper center", fontsize=8, ncol=2)
    return save(fig, path)
