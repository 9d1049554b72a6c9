"""transformers as the engine's correctness oracle: the reference model's greedy tokens and
logits (memoised), workloads of prompts arriving at given steps, and the checks that an
engine's outputs match the reference and that it holds nothing afterwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

ATOL = 1e-4
NUM_NEW = 6
# (arrival step, prompt length); several arrive while others are mid-prefill or decoding.
ARRIVALS = [(0, 600), (0, 1), (0, 45), (1, 130), (2, 17), (4, 301), (7, 2), (9, 64)]
# For the small pool: medium prompts first, then the long one that needs the blocks they hold.
PREEMPT_ARRIVALS = [(0, 130), (0, 200), (0, 45), (1, 600), (2, 17), (3, 1), (5, 64), (6, 2)]


@dataclass
class Reference:
    """A transformers model and the greedy continuations it produced (memoised)."""

    model: torch.nn.Module
    vocab_size: int
    greedy: dict[tuple[tuple[int, ...], int], list[int]] = field(default_factory=dict)
    full_logits: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def generate(self, prompt: list[int], n: int = NUM_NEW) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self.greedy:
            from transformers import GenerationConfig

            ids = torch.tensor([prompt])
            gc = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None)
            with torch.no_grad():
                out = self.model.generate(
                    ids, generation_config=gc, attention_mask=torch.ones_like(ids)
                )
            self.greedy[key] = out[0, len(prompt) :].tolist()
        return self.greedy[key]

    def logits(self, token_ids: list[int]) -> torch.Tensor:  # [len, V]
        key = tuple(token_ids)
        if key not in self.full_logits:
            with torch.no_grad():
                self.full_logits[key] = self.model(torch.tensor([token_ids])).logits[0].float()
        return self.full_logits[key]


def make_prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=g).tolist()  # ids 0..3 are special


def run(
    engine: LLMEngine,
    arrivals: list[tuple[int, str, list[int]]],
    logprobs: int = 2,
    num_new: int = NUM_NEW,
) -> dict[str, RequestOutput]:
    """Add each request at its step, step until all finish; returns final outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, logprobs=logprobs)
    final: dict[str, RequestOutput] = {}
    logprob_log: dict[str, list] = {}
    for step in range(2000):
        for at, rid, prompt in arrivals:
            if at == step:
                engine.add_request(rid, prompt, params)
        if step > max(a[0] for a in arrivals) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            logprob_log.setdefault(out.request_id, []).extend(out.logprobs or [])
            if out.finished:
                final[out.request_id] = out
    else:
        raise AssertionError("engine did not finish within 2000 steps")
    # The streamed logprob deltas, concatenated, are what a client sees.
    for rid, out in final.items():
        object.__setattr__(out, "logprobs", logprob_log[rid])
    return final


def assert_clean(engine: LLMEngine) -> None:
    engine.check_integrity()
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_total_blocks, "a block is still held"


def assert_matches(
    ref: Reference, prompt: list[int], out: RequestOutput, num_new: int = NUM_NEW
) -> None:
    assert out.finish_reason == "length"
    expected = ref.generate(prompt, num_new)
    assert out.token_ids == expected, f"{out.request_id}: greedy tokens differ"
    hf = torch.log_softmax(ref.logits(prompt + out.token_ids[:-1]), dim=-1)[len(prompt) - 1 :]
    assert out.logprobs is not None and len(out.logprobs) == num_new
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - hf[i, lp.token_id].item()) <= ATOL
        assert lp.top_logprobs is not None and len(lp.top_logprobs) == 2
        for tid, value in lp.top_logprobs:
            assert abs(value - hf[i, tid].item()) <= ATOL
        assert lp.top_logprobs[0][0] == out.token_ids[i]  # greedy = the top-1


def load_reference(model_dir: Path) -> Reference:
    """transformers' own model of ``model_dir`` in float32, as the oracle."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return Reference(hf, hf.config.vocab_size)


def tiny_model_and_reference(
    name: str, spec: str, overrides: dict, tiny_model_dir: Path, tmp_root: Path
) -> tuple[Path, Reference]:
    """A tiny random ``spec`` model built by transformers (with ``overrides``) under
    ``tmp_root/name``, and transformers' float32 model of it as the oracle."""
    from tests.engine.tiny_hf_models import build_tiny_model

    model_dir = build_tiny_model(spec, tmp_root / name, tiny_model_dir, **overrides)
    return model_dir, load_reference(model_dir)


# A tiny Gemma 3: two sliding layers and a full one, each kind with its own RoPE (linearly
# scaled on the full layers), q/k norms and a tied output embedding.
GEMMA3_TINY: tuple[str, dict[str, Any]] = (
    "gemma3",
    {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        "tie_word_embeddings": True,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
)


def tiny_models_fixture(
    models: dict[str, tuple[str, dict[str, Any]]], folder: str
) -> Callable[..., tuple[Path, Reference]]:
    """A module-scoped fixture over ``models`` (name -> (tiny spec, config overrides)):
    each model built under a fresh ``folder`` and its transformers reference."""

    @pytest.fixture(scope="module", params=list(models))
    def fixture(
        request: pytest.FixtureRequest,
        tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> tuple[Path, Reference]:
        spec, extra = models[request.param]
        return tiny_model_and_reference(
            request.param, spec, extra, tiny_model_dir, tmp_path_factory.mktemp(folder)
        )

    return fixture


def check_schedule(
    engine: LLMEngine, ref: Reference, schedule: list[tuple[int, int]], num_new: int, impl: str
) -> None:
    """Seeded prompts of the schedule's lengths join at its steps on the ``impl`` path:
    every request's greedy tokens and logprobs match ``ref``; the engine ends clean."""
    assert engine.runner.model_config.impl == impl
    arrivals = [
        (at, f"r{i}", make_prompt(n, seed=i, vocab=ref.vocab_size))
        for i, (at, n) in enumerate(schedule)
    ]
    final = run(engine, arrivals, num_new=num_new)
    assert sorted(final) == sorted(rid for _, rid, _ in arrivals)
    for _, rid, prompt in arrivals:
        assert_matches(ref, prompt, final[rid], num_new)
    assert_clean(engine)


def small_pool_config(model_dir: Path) -> EngineConfig:
    """A 32-token chunked-prefill budget and a pool small enough that PREEMPT_ARRIVALS
    force preemption and recompute."""
    return EngineConfig(
        model=str(model_dir), num_kv_blocks=40, max_model_len=640, max_num_batched_tokens=32
    )


def assert_first_tokens_agree(engine: LLMEngine, ref: Reference) -> None:
    """ARRIVALS' prompts all at once: the first greedy token equals ``ref``'s on all but at
    most one (a reduced-precision engine against a float32 reference); the engine ends
    clean."""
    prompts = [make_prompt(n, seed=i, vocab=ref.vocab_size) for i, (_, n) in enumerate(ARRIVALS)]
    final = run(engine, [(0, f"r{i}", p) for i, p in enumerate(prompts)], num_new=4)
    agree = sum(final[f"r{i}"].token_ids[0] == ref.generate(p)[0] for i, p in enumerate(prompts))
    assert agree >= len(prompts) - 1, f"only {agree} of {len(prompts)} first tokens agree"
    assert_clean(engine)


def check_native_engine(
    engine: LLMEngine, ref: Reference, schedule: list[tuple[int, int]], num_new: int
) -> None:
    """``check_schedule`` on pdserve's own class."""
    check_schedule(engine, ref, schedule, num_new, "native")


def assert_bf16_first_tokens_agree(model_dir: str, ref: Reference) -> LLMEngine:
    """``assert_first_tokens_agree`` for a bfloat16 engine of ``model_dir``; returns the
    engine (for checks of what it loaded)."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16"))
    assert engine.runner.model_config.dtype == torch.bfloat16
    assert_first_tokens_agree(engine, ref)
    return engine


def assert_experts_packed(engine: LLMEngine) -> None:
    """Every MoE block of a bf16 CPU engine runs on oneDNN-prepacked experts where the CPU
    packs bf16 (``pack_moe_experts``), its stacked copy freed; else none is packed."""
    from pdserve.kernels.cpu.linear import can_pack

    blocks = [m for m in engine.runner.model.modules() if hasattr(m, "packed_experts")]
    assert blocks, "the model has no MoE block"
    packs = can_pack(torch.bfloat16, torch.device("cpu"))
    for block in blocks:
        assert (block.packed_experts is not None) == packs
        assert block.w13.is_meta == packs
