"""Logit bias, penalties and min_p against reference implementations: transformers' logits
processors (repetition penalty, sequence bias, min_p) and OpenAI's documented formula for
presence/frequency; then the engine's greedy tokens against ``transformers.generate`` with
the same repetition penalty and bias."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine.logit_adjust import adjust_logits, apply_min_p
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 64


def case(seed: int) -> tuple[torch.Tensor, list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, VOCAB, generator=gen) * 4
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    output = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    return logits, prompt, output


def openai_penalties(logits: torch.Tensor, output: list[int], freq: float, pres: float):
    """OpenAI's formula, token by token: mu[j] - c[j] * freq - (c[j] > 0) * pres."""
    out = logits.clone()
    for token in set(output):
        count = output.count(token)
        out[0, token] -= count * freq + (1.0 if count > 0 else 0.0) * pres
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_and_bias_equal_transformers(seed: int, penalty: float) -> None:
    logits, prompt, output = case(seed)
    bias = {3: 5.0, 17: -100.0, prompt[0]: 2.5}
    params = SamplingParams(repetition_penalty=penalty, logit_bias=bias)
    ours = adjust_logits(logits.clone(), [params], [(prompt, output)])
    ids = torch.tensor([prompt + output])
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(ids, logits.clone())
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, ref)
    torch.testing.assert_close(ours, ref)
    greedy = Sampler([1])(
        logits, [SamplingRow(params.__class__(**_greedy(params)), 9, prompt, output)]
    )
    assert greedy[0].token_id == int(ref.argmax())


def _greedy(params: SamplingParams) -> dict:
    return {
        "temperature": 0.0,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": params.logit_bias,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("freq", "pres"), [(0.7, 0.0), (0.0, 1.5), (-0.5, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_follow_openais_formula(seed: int, freq: float, pres: float) -> None:
    logits, prompt, output = case(seed)
    params = SamplingParams(frequency_penalty=freq, presence_penalty=pres)
    ours = adjust_logits(logits.clone(), [params], [(prompt, output)])
    torch.testing.assert_close(ours, openai_penalties(logits, output, freq, pres))


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_masks_what_transformers_masks(min_p: float) -> None:
    scaled = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    ours = apply_min_p(scaled.clone(), [min_p] * 3)
    ref = MinPLogitsWarper(min_p, min_tokens_to_keep=1)(
        torch.zeros(3, 1, dtype=torch.long), scaled.clone()
    )
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    # A sampled row never picks a masked token.
    params = SamplingParams(temperature=1.0, min_p=min_p, seed=3)
    for step in range(30):
        token = Sampler([1])(scaled[:1], [SamplingRow(params, step)])[0].token_id
        assert not torch.isinf(ours[0, token])


def test_rows_without_adjustments_are_untouched_in_a_mixed_batch() -> None:
    logits, prompt, output = case(0)
    batch = torch.cat([logits, logits])
    plain = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={5: 100.0})
    out = Sampler([1])(batch, [SamplingRow(plain, 0), SamplingRow(biased, 0)])
    assert out[0].token_id == int(logits.argmax()) and out[1].token_id == 5


@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {3: 101}},
    ],
)
def test_out_of_range_values_raise_naming_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_engine_greedy_with_penalty_and_bias_equals_transformers_generate() -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.testmodel import ensure_test_model

    model_dir = ensure_test_model("tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prompt = [5, 9, 13, 9, 21, 5, 40, 41, 42, 9]
    ids = torch.tensor([prompt])

    def generate(**adjust) -> list[int]:
        gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, **adjust)
        with torch.no_grad():
            out = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        return out[0, len(prompt) :].tolist()

    plain = generate()
    # Forbid plain greedy's second token and push another one, so the adjustments matter.
    bias = {plain[1]: -100.0, 7: 3.0}
    ref = generate(repetition_penalty=1.4, sequence_bias={(t,): b for t, b in bias.items()})
    assert ref != plain
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.4, logit_bias=bias
    )
    engine = LLMEngine.from_pretrained(str(model_dir), num_kv_blocks=32, max_model_len=128)
    engine.add_request("r", prompt, params)
    ours: list[int] = []
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                ours = list(out.token_ids)
        if ours:
            break
    assert ours == ref
