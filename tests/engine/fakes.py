"""Test doubles for the engine core, in one place (no torch).

``FakeKVRunner`` stands in for the ModelRunner. Its "KV cache" stores the token written at
each slot; to sample, it reads the context back through the chunk's block table and applies
``next_token``. So an output equals ``reference_generate`` only if block tables, prefix-cache
hits, chunking and preemption-by-recompute put the right tokens in the right blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_connector import PendingSend
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.kvtransfer.scheduler_half import NoExternalLoads

VOCAB = 50


def next_token(context: list[int]) -> int:
    """Deterministic "model": the next token depends on the whole context, in order."""
    acc = len(context)
    for t in context:
        acc = (acc * 31 + t + 7) % 1_000_003
    return acc % VOCAB


def reference_generate(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(next_token(context))
    return context[len(prompt) :]


@dataclass(frozen=True)
class FakeToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class FakeKVRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.steps: list[SchedulerOutput] = []

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def write(self, block_ids: list[int], start: int, tokens: list[int]) -> None:
        for j, tok in enumerate(tokens):
            self.slots[self.slot(block_ids, start + j)] = tok

    def execute(self, out: SchedulerOutput) -> dict[str, FakeToken]:
        self.steps.append(out)
        sampled: dict[str, FakeToken] = {}
        for chunk in out.chunks:
            self.write(chunk.block_ids, chunk.start_position, chunk.token_ids)
            if chunk.sample:
                end = chunk.start_position + len(chunk.token_ids)
                context = [self.slots[self.slot(chunk.block_ids, p)] for p in range(end)]
                assert None not in context, f"{chunk.request_id} read an unwritten slot"
                tok = next_token(context)  # type: ignore[arg-type]
                top = [(tok, -0.1), ((tok + 1) % VOCAB, -2.0), ((tok + 2) % VOCAB, -3.0)]
                sampled[chunk.request_id] = FakeToken(tok, -0.1, top)
        return sampled


class RecordingConnector(NoExternalLoads):
    """Engine-side KVConnector double: records sends; completes them when told to (a
    prefill-role connector: it loads nothing, so its scheduler half answers 0)."""

    saves_kv_layers = True

    def __init__(self, complete_in_step: bool = False) -> None:
        self.registered: list[tuple[object, str]] = []  # (KV pool, model name)
        self.begun: list[PendingSend] = []
        self.layers: list[int] = []
        self.done: list[str] = []
        self.num_steps = 0
        # Report each send finished from the end_step() of the step that began it.
        self.complete_in_step = complete_in_step

    def register_kv_caches(self, kv_cache: object, model_name: str) -> None:
        self.registered.append((kv_cache, model_name))

    def begin_step(self, sends: list[PendingSend]) -> None:
        self.num_steps += 1
        self.begun.extend(sends)
        if self.complete_in_step:
            self.done.extend(s.request_id for s in sends)

    def layer_computed(self, layer_idx: int, kv_cache: object) -> None:
        self.layers.append(layer_idx)

    def end_step(self) -> list[str]:
        return self.poll_finished()

    def poll_finished(self) -> list[str]:
        done, self.done = self.done, []
        return done


PIECES = [chr(ord("a") + i % 26) * (1 + i % 3) for i in range(VOCAB)]


class FakeDetokenizer:
    """Token i -> PIECES[i]; enough to test stop strings and text deltas."""

    def __init__(self) -> None:
        self.text = ""

    def append(self, token_id: int) -> str:
        piece = PIECES[token_id]
        self.text += piece
        return piece


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    eos: frozenset[int] = frozenset(),
    prefill_only: bool = False,
    detokenize: bool = False,
    **params: object,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(**params),  # type: ignore[arg-type]
        arrival_time=0.0,
        eos_token_ids=eos,
        prefill_only=prefill_only,
        detokenizer=FakeDetokenizer() if detokenize else None,
    )


class Harness:
    """A Scheduler + KVCacheManager + FakeKVRunner wired like LLMEngine.step()."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        max_model_len: int = 256,
        connector: RecordingConnector | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            has_kv_connector=connector is not None,
        )
        self.runner = FakeKVRunner(num_blocks, block_size)
        self.connector = connector
        self.outputs: dict[str, list[RequestOutput]] = {}

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        if self.connector is not None:
            self.scheduler.finish_sends(self.connector.poll_finished())
        out = self.scheduler.schedule()
        if self.connector is not None:
            self.connector.begin_step(out.kv_sends)
        sampled = self.runner.execute(out) if out.chunks else {}
        sends_done = self.connector.end_step() if self.connector is not None else []
        for o in self.scheduler.update_from_output(sampled):
            self.outputs.setdefault(o.request_id, []).append(o)
        self.scheduler.finish_sends(sends_done)
        self.scheduler.check_integrity()
        return out

    def run(self, max_steps: int = 500) -> int:
        """Step until nothing is left to do; returns the number of steps."""
        for n in range(max_steps):
            if not self.scheduler.has_work():
                return n
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def final(self, request_id: str) -> RequestOutput:
        last = self.outputs[request_id][-1]
        assert last.finished
        return last

    def assert_empty(self) -> None:
        """Nothing queued, no block referenced, pool counts consistent."""
        s = self.scheduler
        assert not s.running and not s.waiting and not s.remote and not s.sending
        assert not s.requests
        s.check_integrity()
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)
        assert self.kv.num_free_blocks == self.kv.num_total_blocks
