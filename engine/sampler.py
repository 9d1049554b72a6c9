"""Turn one step's logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs.

Each row is sampled independently of the others in the batch. A request with a seed draws
its randomness from a generator derived from ``(seed, num_output_tokens)``, so it gets the
same tokens whatever else is batched with it, after a preemption recomputes it, and after a
migration continues it on another engine (``num_prior_output_tokens`` counts the outputs
produced before, which end the continuation's prompt).
Logprobs are the log-softmax of the raw logits (vLLM's default), taken before
logit bias, penalties, temperature, min_p, top-k/top-p and the min_tokens mask (see
``logit_adjust`` for the adjustments). This module never touches the KV cache.

On a GPU a step reads back once: every row's token (greedy and random alike, no loop over
rows on the device) and the requested logprobs travel in one device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.grammar import GrammarBackend
from pdserve.engine.logit_adjust import adjust_logits, apply_min_p
from pdserve.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampledToken:
    """The token picked for one request this step."""

    token_id: int
    logprob: float | None  # log-prob of token_id (None unless the request asked for logprobs)
    top_logprobs: list[tuple[int, float]] | None  # the top-n (id, log-prob), best first


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    num_output_tokens: int  # tokens generated before this one
    # The request's tokens so far, read by the penalties only (empty when it has none).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    request_id: str = ""  # keys a structured request's grammar state

    @property
    def output_index(self) -> int:
        """Index of the token sampled now among all the request's outputs, migrations
        included (the seeded draw's step)."""
        return self.params.num_prior_output_tokens + self.num_output_tokens

    def history(self) -> tuple[Sequence[int], Sequence[int]]:
        """(prompt, output) ids as the original request saw them: the prior outputs that
        end a continuation's prompt count as output."""
        k = self.params.num_prior_output_tokens
        if not k or not self.prompt_token_ids:
            return self.prompt_token_ids, self.output_token_ids
        prompt = list(self.prompt_token_ids)
        return prompt[:-k], [*prompt[-k:], *self.output_token_ids]


def seed_for_step(seed: int, num_output_tokens: int) -> int:
    """A well-mixed 63-bit generator seed for token ``num_output_tokens`` of a seeded request."""
    x = (seed * 0x9E3779B97F4A7C15 + num_output_tokens + 1) & _MASK64  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class Sampler:
    """Picks one token per row. ``eos_token_ids`` are masked until min_tokens is reached."""

    def __init__(
        self, eos_token_ids: Sequence[int], seed: int = 0, grammar: GrammarBackend | None = None
    ) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self.grammar = grammar
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        """Generator for unseeded rows: seeded once from the engine seed, then advancing."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V] (any float dtype)
        rows: Sequence[SamplingRow],
    ) -> list[SampledToken]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits: {logits.shape[0]} rows for {len(rows)} requests")
        if not rows:
            return []
        logits = logits.float()
        raw = logits
        histories = [r.history() for r in rows]
        if any(r.params.adjusts_logits for r in rows):
            logits = adjust_logits(logits.clone(), [r.params for r in rows], histories)
        logits = self._mask_min_tokens(logits, rows)
        structured = [(r.request_id, r.params, h[1]) for r, h in zip(rows, histories, strict=True)]
        use_grammar = self.grammar is not None and any(r.params.structured for r in rows)
        if use_grammar:
            if logits is raw:
                logits = logits.clone()
            logits = self.grammar.mask(logits, structured)  # type: ignore[union-attr]
        token_ids = self._pick(logits, rows)
        out = self._with_logprobs(raw, token_ids, rows)
        if use_grammar:
            self.grammar.accept(structured, [t.token_id for t in out])  # type: ignore[union-attr]
        return out

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop per-request state (grammar matchers) of requests that left the engine."""
        if self.grammar is not None and request_ids:
            self.grammar.forget(request_ids)

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Forbid every stop token of a request that has not reached min_tokens yet."""
        banned: list[tuple[int, int]] = []
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            if row.num_output_tokens >= row.params.min_tokens:
                continue
            stops = list(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                stops += self.eos_token_ids
            banned.extend((i, t) for t in stops if 0 <= t < vocab)
        if not banned:
            return logits
        logits = logits.clone()
        idx = torch.tensor(banned, device=logits.device).T
        logits[idx[0], idx[1]] = float("-inf")
        return logits

    def _pick(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The token of every row, on the device ([S] int64): nothing is read back here."""
        greedy_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return greedy_ids
        dev = logits.device
        index = torch.tensor(random_rows, device=dev)
        sub = logits.index_select(0, index)
        temps = torch.tensor(
            [rows[i].params.temperature for i in random_rows], device=dev
        ).unsqueeze(1)
        scaled = apply_min_p(sub / temps, [rows[i].params.min_p for i in random_rows])
        probs = _top_k_top_p(scaled, [rows[i].params for i in random_rows]).softmax(dim=-1)
        # Sample with the exponential race: argmax(p / E), E ~ Exp(1). Each row's noise is a
        # counter-based hash of its own key and the token index, all rows at once: a seeded
        # row's key comes from (seed, num_output_tokens), so its draw does not depend on the
        # batch (nor on the device); unseeded rows take keys from the engine's generator.
        keys = torch.randint(
            -(1 << 62), 1 << 62, (len(random_rows),), generator=self._shared_generator(dev),
            device=dev,
        )  # fmt: skip
        seeded = [j for j, i in enumerate(random_rows) if rows[i].params.seed is not None]
        if seeded:
            seeded_rows = [rows[random_rows[j]] for j in seeded]
            own = [seed_for_step(r.params.seed or 0, r.output_index) for r in seeded_rows]
            keys[torch.tensor(seeded, device=dev)] = torch.tensor(own, device=dev)
        noise = exponential_noise(keys, probs.shape[1])
        picked = (probs / noise).argmax(dim=-1)
        return greedy_ids.index_copy(0, index, picked)

    def _with_logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> list[SampledToken]:
        """Read the step's results back in one device-to-host transfer: the tokens, and the
        logprobs of the rows that asked for them packed beside them."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return [SampledToken(t, None, None) for t in token_ids.tolist()]
        index = torch.tensor(want, device=raw.device)
        logprobs = torch.log_softmax(raw.index_select(0, index), dim=-1)
        max_n = max(rows[i].params.logprobs or 0 for i in want)
        chosen = logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
        parts = [token_ids.double(), chosen.double()]
        if max_n:
            top_vals, top_ids = logprobs.topk(max_n, dim=-1)
            parts += [top_vals.double().flatten(), top_ids.double().flatten()]
        flat = torch.cat(parts).tolist()  # the one transfer (ids < 2^53 are exact)
        s, w = len(rows), len(want)
        ids = [int(t) for t in flat[:s]]
        chosen_l = flat[s : s + w]
        top_vals_l = flat[s + w : s + w + w * max_n]
        top_ids_l = flat[s + w + w * max_n :]
        out = [SampledToken(t, None, None) for t in ids]
        for j, i in enumerate(want):
            n = rows[i].params.logprobs or 0
            lo = j * max_n
            top = [
                (int(t), v)
                for t, v in zip(top_ids_l[lo : lo + n], top_vals_l[lo : lo + n], strict=True)
            ]
            out[i] = SampledToken(ids[i], chosen_l[j], top)
        return out


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiplies; shifts made logical by masks)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws [S, V]: row r, column c from a hash of (keys[r], c), in float64 then
    float32 (53 random bits; never 0 or inf)."""
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _mix(keys.unsqueeze(1) + (cols.unsqueeze(0) + 1) * -7046029254386353131)
    u = (((bits >> 11) & ((1 << 53) - 1)).double() + 0.5) / float(1 << 53)
    return (-torch.log(u)).float()


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf ([S, V] -> [S, V])."""
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    width = max(ks)
    if width < vocab:  # every row has a top-k: a partial sort of its max k is enough
        sorted_logits, order = logits.topk(width, dim=-1)
    else:  # some row's nucleus may reach anywhere in the vocabulary
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(width, device=logits.device).unsqueeze(0)
    k = torch.tensor(ks, device=logits.device).unsqueeze(1)
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass of the
    # tokens before it already reaches p. The first token is always kept.
    before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    drop = drop | ((before >= p) & (p < 1.0))
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
