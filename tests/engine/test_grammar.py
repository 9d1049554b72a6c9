"""Grammar-constrained sampling against references: the engine's greedy tokens under a JSON
schema equal ``transformers.generate`` with xgrammar's own Hugging Face logits processor,
the text validates with ``jsonschema``, and sampled JSON mode always parses."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.testmodel import ensure_test_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained(
        str(ensure_test_model("tiny")), num_kv_blocks=64, max_model_len=256
    )


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, object] = {}
    for _ in range(400):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) == len(requests):
            return done
    raise AssertionError(f"unfinished: {set(requests) - set(done)}")


def test_greedy_json_schema_equals_transformers_with_xgrammar(engine: LLMEngine) -> None:
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, GenerationConfig
    from xgrammar.contrib.hf import LogitsProcessor

    model_dir = ensure_test_model("tiny")
    prompt = [5, 9, 13, 21]
    params = SamplingParams(max_tokens=40, temperature=0.0, json_schema=json.dumps(SCHEMA))
    out = run(engine, {"schema": (prompt, params)})["schema"]
    assert out.finish_reason == "stop", out.text  # the grammar ended it with EOS
    jsonschema.validate(json.loads(out.text), SCHEMA)

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tokenizer = engine.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer,
        vocab_size=model.config.vocab_size,
        stop_token_ids=list(engine.runner.model_config.eos_token_ids),
    )
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False
    )
    ids = torch.tensor([prompt])
    gc = GenerationConfig(max_new_tokens=40, do_sample=False)
    with torch.no_grad():
        ref = model.generate(
            ids,
            generation_config=gc,
            attention_mask=torch.ones_like(ids),
            logits_processor=[LogitsProcessor(grammar)],
        )
    ref_ids = ref[0, len(prompt) :].tolist()
    eos = set(engine.runner.model_config.eos_token_ids)
    while ref_ids and ref_ids[-1] in eos:  # generate() pads/ends with EOS; ours stops on it
        ref_ids.pop()
    assert [t for t in out.token_ids if t not in eos] == ref_ids


def test_sampled_json_mode_always_parses_and_state_is_dropped(engine: LLMEngine) -> None:
    requests = {
        f"j{i}": ([5 + i, 9, 13], SamplingParams(max_tokens=60, seed=i, json_object=True))
        for i in range(4)
    }
    # A plain request in the same batch is not constrained.
    requests["plain"] = ([5, 9, 13], SamplingParams(max_tokens=5, temperature=0.0))
    done = run(engine, requests)
    for rid in requests:
        if rid != "plain" and done[rid].finish_reason == "stop":
            json.loads(done[rid].text)
    assert sum(done[r].finish_reason == "stop" for r in requests if r != "plain") >= 1
    engine.step()  # the step after they finished drops their matchers
    assert not engine.runner.sampler.grammar._states


def test_bad_structured_params_raise() -> None:
    from pdserve.engine.grammar import check_json_schema

    with pytest.raises(ValueError, match="json_schema"):
        check_json_schema('{"type": "no-such-type"}')
    with pytest.raises(ValueError, match="json_object"):
        SamplingParams(json_object="yes")
