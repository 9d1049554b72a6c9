"""IncrementalDetokenizer on the test model's byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.loader import load_tokenizer

TEXT = "Hello Léa, 東京の朝 🙂 def foo(x):\n  return 😀😀 naïve — Łódź 😀!"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def stream(
    tok, prompt: list[int], ids: list[int], skip: bool = True
) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return [d.append(t) for t in ids], d


def test_deltas_concatenate_to_the_full_decode(tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    deltas, d = stream(tokenizer, tokenizer.encode("Prompt:"), ids)
    assert "".join(deltas) == d.text == TEXT
    assert not any("\ufffd" in delta for delta in deltas)


def test_split_character_is_held_back_until_complete(tokenizer) -> None:
    ids = tokenizer.encode(" 😀")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the emoji should span several byte tokens"
    d = IncrementalDetokenizer(tokenizer, [], True)
    for i in ids[:-1]:
        assert d.append(i) == ""
        assert d.pending
    assert d.append(ids[-1]) == " 😀"
    assert not d.pending


def test_flush_emits_an_incomplete_tail(tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")
    deltas, d = stream(tokenizer, [], ids[:-1])
    assert d.pending and "\ufffd" not in d.text
    tail = d.flush()
    assert tail.endswith("\ufffd") and d.text == "ok" + tail


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [im_end] + tokenizer.encode(" again")
    assert "".join(stream(tokenizer, [], ids, skip=True)[0]) == "Hi there again"
    assert "".join(stream(tokenizer, [], ids, skip=False)[0]) == "Hi there<|im_end|> again"


def test_first_token_keeps_its_leading_space_after_the_prompt(tokenizer) -> None:
    prompt = tokenizer.encode("The lamp was")
    deltas, d = stream(tokenizer, prompt, tokenizer.encode(" carried slowly"))
    assert d.text == " carried slowly" and deltas[0].startswith(" ")


@pytest.mark.parametrize("seed", range(5))
def test_random_token_streams_match_batch_decode(tokenizer, seed: int) -> None:
    """Whatever the model emits (random ids, broken bytes included), the streamed text plus
    the final flush equals decoding all the ids at once, and no delta splits a character."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(tokenizer), (200,), generator=g).tolist()
    deltas, d = stream(tokenizer, [5, 6, 7], ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) + d.flush() == full
    for delta in deltas:
        assert not delta.endswith("\ufffd")


def _migrated(tok, prompt: list[int], ids: list[int], cut: int, prior: bool = True) -> list[str]:
    """The deltas a client gets when the first ``cut`` outputs come from one replica and the
    rest from another, which receives them at the end of its prompt."""
    before, _ = stream(tok, prompt, ids[:cut])
    after = IncrementalDetokenizer(
        tok, prompt + ids[:cut], num_prior_output_tokens=cut if prior else 0
    )
    return before + [after.append(t) for t in ids[cut:]]


def _straddling_cut(tok, ids: list[int]) -> int:
    """The first cut that falls inside a character's bytes."""
    for cut in range(1, len(ids)):
        if stream(tok, [], ids[:cut])[1].pending:
            return cut
    raise AssertionError("no character spans several tokens")


def test_a_character_straddling_the_migration_point_comes_out_whole_once(tokenizer) -> None:
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(" wait 😀 done")
    cut = _straddling_cut(tokenizer, ids)
    uninterrupted = stream(tokenizer, prompt, ids)[0]
    migrated = _migrated(tokenizer, prompt, ids, cut)
    assert "".join(migrated) == "".join(uninterrupted) == " wait 😀 done"
    assert migrated == uninterrupted  # the same delta for every token


def test_without_the_prior_count_the_straddling_character_would_break(tokenizer) -> None:
    """The check above can fail: a detokenizer that takes the streamed tokens for prompt
    loses the character's first bytes."""
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(" wait 😀 done")
    cut = _straddling_cut(tokenizer, ids)
    assert "".join(_migrated(tokenizer, prompt, ids, cut, prior=False)) != " wait 😀 done"


def test_every_migration_point_continues_the_uninterrupted_text(tokenizer) -> None:
    prompt = tokenizer.encode("Prompt:")
    ids = tokenizer.encode(TEXT)
    uninterrupted = stream(tokenizer, prompt, ids)[0]
    for cut in range(len(ids) + 1):
        assert _migrated(tokenizer, prompt, ids, cut) == uninterrupted, cut


def test_the_prior_outputs_are_counted_in_the_prompt(tokenizer) -> None:
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        IncrementalDetokenizer(tokenizer, [1, 2], num_prior_output_tokens=3)
