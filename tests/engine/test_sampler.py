"""Sampler: greedy, temperature/top-k/top-p distributions, seeds, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplingRow, seed_for_step
from pdserve.engine.sampling_params import SamplingParams

EOS = 1


def rows(*params: SamplingParams, n_out: int = 0) -> list[SamplingRow]:
    return [SamplingRow(p, n_out) for p in params]


def random_logits(s: int, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(s, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_per_row() -> None:
    logits = random_logits(5)
    out = Sampler([EOS])(logits, rows(*[SamplingParams(temperature=0.0)] * 5))
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


def test_seeded_request_gets_same_tokens_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234)
    target = random_logits(1, seed=1)[0]

    def tokens(batch_others: int, sampler_seed: int) -> list[int]:
        sampler = Sampler([EOS], seed=sampler_seed)
        got = []
        for step in range(20):
            others = random_logits(batch_others, seed=100 + step) if batch_others else None
            logits = target[None] if others is None else torch.cat([others, target[None]])
            params = [SamplingParams(temperature=0.7)] * batch_others + [seeded]
            out = sampler(logits, [SamplingRow(p, step) for p in params])
            got.append(out[-1].token_id)
        return got

    alone = tokens(0, sampler_seed=0)
    assert tokens(3, sampler_seed=99) == alone
    assert tokens(7, sampler_seed=5) == alone
    assert len(set(alone)) > 3  # really sampling, not greedy


def test_different_seeds_and_steps_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any fixed answer would be a bug
    sampler = Sampler([EOS])
    a = [sampler(logits, rows(SamplingParams(seed=1), n_out=i))[0].token_id for i in range(10)]
    b = [sampler(logits, rows(SamplingParams(seed=2), n_out=i))[0].token_id for i in range(10)]
    assert a != b and len(set(a)) > 5
    assert seed_for_step(1, 0) != seed_for_step(1, 1) != seed_for_step(2, 0)


def _empirical(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    sampler = Sampler([EOS], seed=3)
    batch = logits.expand(n, -1).contiguous()
    out = sampler(batch, rows(*[params] * n))
    return torch.bincount(torch.tensor([t.token_id for t in out]), minlength=logits.shape[-1]) / n


def test_temperature_matches_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temp in (0.5, 1.0, 2.0):
        freq = _empirical(logits, SamplingParams(temperature=temp))
        expected = torch.softmax(logits[0] / temp, -1)
        assert torch.allclose(freq, expected, atol=0.03), (temp, freq, expected)


def test_top_k_and_top_p_restrict_the_support() -> None:
    # probabilities ~ [0.5, 0.3, 0.15, 0.05]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    freq = _empirical(logits, SamplingParams(top_k=2))
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.03
    freq = _empirical(logits, SamplingParams(top_p=0.75))  # 0.5 + 0.3 reaches 0.75
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    freq = _empirical(logits, SamplingParams(top_p=0.5))  # the top token alone reaches 0.5
    assert freq[0] == 1.0
    freq = _empirical(logits, SamplingParams(top_p=0.9, top_k=3))
    assert freq[3] == 0 and freq[2] > 0.1


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 4] = 8.0
    sampler = Sampler([EOS])
    p = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[7])
    assert sampler(logits, rows(p, n_out=0))[0].token_id == 4
    assert sampler(logits, rows(p, n_out=2))[0].token_id == 4
    assert sampler(logits, rows(p, n_out=3))[0].token_id == EOS
    ignore = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[7])
    assert sampler(logits, rows(ignore, n_out=0))[0].token_id == EOS  # eos is no stop then


def test_logprobs_are_raw_log_softmax_with_top_n() -> None:
    logits = random_logits(3, v=30, seed=4)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.3, top_k=2, logprobs=0, seed=5),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler([EOS])(logits, rows(*params))
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(out[0].logprob, ref[0, out[0].token_id].item(), abs_tol=1e-6)
    top = ref[0].topk(3)
    assert [t for t, _ in out[0].top_logprobs] == top.indices.tolist()
    assert [v for _, v in out[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-6)
    # Temperature and top-k do not change the reported logprob (vLLM's raw logprobs).
    assert math.isclose(out[1].logprob, ref[1, out[1].token_id].item(), abs_tol=1e-6)
    assert out[1].top_logprobs == []
    assert out[2].logprob is None


def test_unseeded_sampling_is_reproducible_from_engine_seed() -> None:
    logits = torch.zeros(8, 100)
    p = rows(*[SamplingParams()] * 8)
    a = [t.token_id for t in Sampler([EOS], seed=7)(logits, p)]
    b = [t.token_id for t in Sampler([EOS], seed=7)(logits, p)]
    c = [t.token_id for t in Sampler([EOS], seed=8)(logits, p)]
    assert a == b != c


def test_row_count_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="rows"):
        Sampler([EOS])(torch.zeros(2, 5), rows(SamplingParams()))


def test_one_read_back_per_step_and_no_full_sort_under_top_k(monkeypatch) -> None:
    """Greedy, seeded random and logprob rows together: the step reads the device once
    (one ``tolist``), and top-k rows take a partial sort (``topk``), never a full one."""
    from pdserve.engine import sampler as sampler_mod

    reads: list[int] = []
    sorts: list[int] = []
    real_tolist, real_sort = torch.Tensor.tolist, torch.Tensor.sort

    def counting_tolist(self):
        reads.append(self.numel())
        return real_tolist(self)

    def counting_sort(self, *a, **k):
        sorts.append(self.shape[-1])
        return real_sort(self, *a, **k)

    logits = random_logits(4, v=64, seed=9)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=11),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.9, logprobs=2),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    rows = [SamplingRow(p, 0) for p in params]
    expected = Sampler([EOS], seed=1)(logits, rows)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    got = Sampler([EOS], seed=1)(logits, rows)
    assert len(reads) == 1 and sorts == []
    assert got == expected
    assert got[0].token_id == int(logits[0].argmax())
    assert got[1].token_id in logits[1].topk(5).indices.tolist()
    assert got[2].top_logprobs is not None and len(got[2].top_logprobs) == 2
    assert sampler_mod.exponential_noise(torch.tensor([1, 2]), 8).min() > 0


def test_seeded_noise_is_the_same_on_any_batch_position() -> None:
    from pdserve.engine.sampler import exponential_noise

    keys = torch.tensor([seed_for_step(5, 0), seed_for_step(6, 3)])
    both = exponential_noise(keys, 1000)
    assert torch.equal(both[1], exponential_noise(keys[1:], 1000)[0])
    # Exp(1): mean ~1 over many draws.
    assert abs(float(both.double().mean()) - 1.0) < 0.1


def test_prior_outputs_shift_the_seeded_step_and_count_for_penalties() -> None:
    """A continued request (its first outputs at the end of its prompt) samples as the
    original did at the same output index, penalties included."""
    base = dict(temperature=1.0, seed=42, presence_penalty=2.0, frequency_penalty=2.0)
    original = SamplingRow(SamplingParams(**base), 3, [1, 2], [7, 7, 8])
    continued = SamplingRow(
        SamplingParams(**base, num_prior_output_tokens=3), 0, [1, 2, 7, 7, 8], []
    )
    assert continued.output_index == original.output_index == 3
    assert continued.history() == ([1, 2], [7, 7, 8])
    for seed in range(20):
        logits = random_logits(1, seed=seed)
        a = Sampler([EOS])(logits, [original])[0].token_id
        b = Sampler([EOS])(logits, [continued])[0].token_id
        assert a == b
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        SamplingParams(num_prior_output_tokens=-1)
