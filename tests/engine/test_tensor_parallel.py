"""Tensor parallelism on CPU (gloo between real processes): the split model still gives
transformers' tokens and logprobs, and a rank's death ends the replica instead of hanging it.

Each run combines a small token budget (chunked prefill of the 600-token prompt) with a
pool small enough to force preemption, over three head layouts: GQA whose 2 KV heads are
replicated at TP=4, MQA (one KV head on every rank), MHA; and Qwen2 (qkv bias, tied
vocab-parallel embedding) at TP=2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parallel import TPShard, check_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tp_executor import TPWorkerError
from tests.engine.transformers_reference import (
    PREEMPT_ARRIVALS,
    Reference,
    assert_clean,
    assert_matches,
    make_prompt,
    run,
)
from tests.support import wait_until

CASES = [
    ("mha", 1),
    ("llama3-gqa", 2),
    ("llama3-gqa", 4),
    ("mqa", 2),
    ("mqa", 4),
    ("mha", 4),
    ("qwen2", 2),
]
SMALL_POOL = {"num_kv_blocks": 48, "max_model_len": 640, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def references(test_model: Callable[[str], Path]) -> Callable[[str], tuple[Path, Reference]]:
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple[Path, Reference]] = {}

    def get(name: str) -> tuple[Path, Reference]:
        if name not in cache:
            model_dir = test_model(name)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            cache[name] = (model_dir, Reference(hf, hf.config.vocab_size))
        return cache[name]

    return get


@pytest.mark.parametrize(("variant", "tp"), CASES, ids=[f"{v}-tp{t}" for v, t in CASES])
def test_tp_greedy_and_logprobs_match_transformers(references, variant: str, tp: int) -> None:
    model_dir, ref = references(variant)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=tp, **SMALL_POOL)
    )
    try:
        kv = engine.runner.model_config.num_kv_heads
        assert engine.kv_cache.shape[-2] == len(TPShard(0, tp).kv_heads(kv))
        arrivals = [
            (at, f"r{i}", make_prompt(n, seed=i, vocab=ref.vocab_size))
            for i, (at, n) in enumerate(PREEMPT_ARRIVALS)
        ]
        final = run(engine, arrivals)
        for _, rid, prompt in arrivals:
            assert_matches(ref, prompt, final[rid])
        assert engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
        assert_clean(engine)
    finally:
        engine.shutdown()


def test_shard_arithmetic() -> None:
    assert [TPShard(r, 2).kv_heads(8) for r in range(2)] == [range(0, 4), range(4, 8)]
    # Fewer KV heads than ranks: each head on tp/H consecutive ranks, the first canonical.
    assert [TPShard(r, 4).kv_heads(2) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [TPShard(r, 4).kv_replica(2) for r in range(4)] == [0, 1, 0, 1]
    assert [TPShard(r, 4).kv_replica(1) for r in range(4)] == [0, 1, 2, 3]
    # The vocabulary pads to a multiple of the ranks; the last rank's tail is padding.
    assert [TPShard(r, 4).vocab(10) for r in range(4)] == [
        range(0, 3),
        range(3, 6),
        range(6, 9),
        range(9, 12),
    ]
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*tensor_parallel_size \(4\)"):
        TPShard(0, 4).split(6, "num_attention_heads")
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(6\).*num_key_value_heads \(4\)"):
        TPShard(0, 6).kv_heads(4)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TPShard(2, 2)


def test_unsplittable_model_is_refused_before_any_worker_starts(test_model) -> None:
    from pdserve.engine.loader import load_model_config

    cfg = load_model_config(test_model("mqa"))  # 4 heads
    check_model(cfg, 4)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(8\)"):
        check_model(cfg, 8)


def test_a_dead_worker_fails_the_step_instead_of_hanging(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", tensor_parallel_size=2)
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        engine.add_request("a", list(range(10, 60)), params)
        engine.step()
        worker = engine.runner.workers[0].process
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(TPWorkerError, match="rank 1 died"):
            engine.check_health()  # the replica's health check sees it between steps
        start = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.shutdown()


def test_workers_exit_when_rank_0_is_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pdserve.engine.llm_engine import LLMEngine
            from pdserve.engine.config import EngineConfig
            from pdserve.engine.sampling_params import SamplingParams
            if __name__ == "__main__":
                e = LLMEngine(EngineConfig(model={str(tiny_model_dir)!r}, device="cpu",
                                           tensor_parallel_size=2))
                print(e.runner.workers[0].process.pid, flush=True)
                e.add_request("a", list(range(10, 60)),
                              SamplingParams(max_tokens=10**6 // 2, ignore_eos=True))
                e.step()
                print("stepping", flush=True)
                while True:  # killed mid-step
                    e.step()
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-P", str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        worker_pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "stepping"  # both ranks are computing
        proc.kill()
        proc.wait(10)
        wait_until(
            lambda: not _alive(worker_pid),
            timeout=30,
            interval=0.2,
            what="the worker to exit after rank 0 (it outlived rank 0)",
        )
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
