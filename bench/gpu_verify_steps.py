"""The steps of ``pdserve.bench.gpu_verify`` (each returns report rows; CUDA only).

Imports nothing heavier than torch at module level: the driver's ``--dry-run`` imports this
module and, from ``DEVICE_MODULES``, everything the steps import on the device.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

# H200 datasheet ceilings, the yardsticks of the report (the kernel check also measures its own).
H200_COPY_GBS = 4300.0
H200_BF16_TFLOPS = 790.0
VARIANTS = ("llama3-gqa", "qwen2", "mqa")  # the three test configs of tests/engine
NUM_NEW = 8
# (arrival step, prompt length): mixed lengths, some arriving mid-prefill or mid-decode.
ARRIVALS = [(0, 600), (0, 1), (0, 45), (1, 130), (2, 17), (4, 301), (7, 2), (9, 64)]
# A pool of 48 blocks of 16: medium prompts first, then a long one that needs their blocks.
PREEMPT_ARRIVALS = [(0, 130), (0, 200), (0, 45), (1, 600), (2, 17), (3, 1), (5, 64), (6, 2)]
# bf16 engine logits vs transformers fp32: max |diff| / max |ref logit|, per prompt.
BF16_REL_TOL = 0.05
NUMERICS_MODEL = "small"  # the model of the numerics table in docs/benchmarks.md
THROUGHPUT_BATCHES = (1, 8, 32, 128)
THROUGHPUT_MODEL = "small"  # a test-model size (engine.testmodel.SIZES)
# Where the steps run: "cuda" on the device; the CPU smoke test points steps 2-3 at "cpu".
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclass
class Row:
    """One line of the report: ``ok`` None = skipped (``note`` says why)."""

    step: str
    check: str
    ok: bool | None
    value: float | None = None
    unit: str = ""
    limit: float | None = None
    note: str = ""


# ---- 1. kernels --------------------------------------------------------------------------


def kernels(quick: bool) -> list[Row]:
    """Every Triton kernel vs its torch reference and timed (``kernels.triton.gpu_check``),
    speeds also as a fraction of the H200's datasheet ceilings."""
    from pdserve.kernels.triton import gpu_check as g

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ceil, rows = g._measure_ceilings(dev, quick)
    rows += g._check_attention(dev)
    from pdserve.kernels.triton.gpu_check_kvquant import check_quantized_kv

    rows += check_quantized_kv(dev)
    rows.append(g._bench_decode(dev, quick, ceil))
    torch.cuda.empty_cache()
    rows += g._bench_prefill(dev, quick, ceil)
    torch.cuda.empty_cache()
    rows += g._bench_blocks(dev, quick, ceil)
    rows += g._bench_elementwise(dev, ceil)
    torch.cuda.empty_cache()
    from pdserve.kernels.triton.gpu_check_moe import bench_moe

    rows += bench_moe(dev, quick, ceil)
    out = quant_kernels(dev, quick)
    for r in rows:
        nominal = None
        if r.value is not None and r.metric == "GB/s":
            nominal = r.value / H200_COPY_GBS
        elif r.value is not None and r.metric == "TFLOP/s":
            nominal = r.value / H200_BF16_TFLOPS
        note = f"{r.shape}; {r.ms:.3f} ms" if r.ms is not None else r.shape
        if nominal is not None:
            note += f"; {r.value:.0f} {r.metric} = {nominal:.0%} of H200 datasheet"
            if r.fraction is not None:
                note += f", {r.fraction:.0%} of this run's ceiling"
        out.append(
            Row("kernels", r.name, r.ok, r.error, "max err", r.tolerance, note)
            if r.error is not None
            else Row(
                "kernels", r.name, None if nominal is None else True, nominal, "of H200", None, note
            )  # fmt: skip
        )
    return out


def _time_ms(fn: Any, iters: int) -> float:
    fn()
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - start) / iters * 1e3


def quant_kernels(dev: torch.device, quick: bool) -> list[Row]:
    """The quantized GEMMs (``kernels/triton/quant_gemm.py``) vs their torch references,
    and their time against the bf16 matmul of the same shape (decode and prefill rows)."""
    from pdserve.kernels import quant_reference as R
    from pdserve.kernels.triton.quant_gemm import dequant_gemm, int8_w8a8_gemm

    rows: list[Row] = []
    g = torch.Generator(device=dev).manual_seed(0)
    n, k = 4096, 4096
    w = torch.randn(n, k, device=dev, generator=g) * 0.02
    cases = {
        "int8 w8a8": (torch.int8, None),
        "int8 weight-only": (torch.int8, None),
        "int8 group128": (torch.int8, 128),
        "fp8 per-channel": (R.FP8_DTYPE, None),
        "fp8 block128": (R.FP8_DTYPE, 128),
    }
    iters = 5 if quick else 50
    for m in (1, 8, 32, 512):
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        dense = w.to(torch.bfloat16)
        bf16_ms = _time_ms(lambda x=x, dense=dense: x @ dense.t(), iters)
        for name, (qdtype, group) in cases.items():
            q, scale = R.quantize_weight(w, qdtype, group)
            if name == "int8 w8a8":
                xq, xs = R.quantize_per_token_int8(x)
                got = int8_w8a8_gemm(xq, xs, q, scale, None, torch.float32)
                want = R.w8a8_linear(x, q, scale)
                run = functools.partial(int8_w8a8_gemm, xq, xs, q, scale, None, torch.bfloat16)
                ms = _time_ms(run, iters)
            else:
                got = dequant_gemm(x, q, scale, None).float()
                want = R.weight_only_linear(x, q, scale)
                ms = _time_ms(functools.partial(dequant_gemm, x, q, scale, None), iters)
            err = ((got - want).norm() / want.norm()).item()
            limit = 1e-5 if name == "int8 w8a8" else 1e-2
            shape = f"M={m} N={n} K={k}"
            rows.append(Row("kernels", f"quant {name} vs reference", err <= limit, err,
                            "rel L2", limit, shape))  # fmt: skip
            rows.append(Row("kernels", f"quant {name} speed vs bf16", None, bf16_ms / ms, "x",
                            None, f"{shape}; {ms:.3f} ms vs bf16 {bf16_ms:.3f} ms"))  # fmt: skip
    return rows


# ---- 2. the engine on CUDA vs transformers -------------------------------------------------


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def _run_arrivals(engine: Any, arrivals: list[tuple[int, str, list[int]]]) -> dict[str, list]:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    final: dict[str, list[int]] = {}
    step = 0
    pending = sorted(arrivals)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
        step += 1
        if step > 10_000:
            raise RuntimeError("engine did not finish")
    return final


def _hf_greedy(hf: Any, prompt: list[int], dev: torch.device) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=dev)
    gc = GenerationConfig(max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None)
    with torch.no_grad():
        out = hf.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt) :].tolist()


def greedy_row(
    hf: Any,
    model_dir: Path,
    name: str,
    label: str,
    schedule: list[tuple[int, int]],
    overrides: dict[str, Any],
    seed: int = 100,
) -> Row:
    """One engine (fp32, ``DEVICE``) run of ``schedule``: every request's greedy tokens equal
    ``hf``'s, and a "preemption" case preempted."""
    from pdserve.engine.llm_engine import LLMEngine

    dev = torch.device(DEVICE)
    vocab = hf.config.vocab_size
    arrivals = [(t, f"r{i}", _prompt(n, seed + i, vocab)) for i, (t, n) in enumerate(schedule)]
    expected = {rid: _hf_greedy(hf, p, dev) for _, rid, p in arrivals}
    engine = LLMEngine.from_pretrained(
        model_dir, dtype="float32", device=DEVICE, block_size=16, **overrides
    )
    got = _run_arrivals(engine, arrivals)
    same = sum(got[rid] == expected[rid] for rid in expected)
    preempted = engine.stats().num_preemptions
    ok = same == len(expected) and ("preemption" not in label or preempted > 0)
    return Row("engine", f"{name} greedy == transformers, {label}", ok, same,
               f"of {len(expected)} requests", None, f"{preempted} preemptions")  # fmt: skip


def engine_vs_transformers(model_root: Path) -> list[Row]:
    """Greedy tokens of the engine (fp32, CUDA) equal transformers' on the three test
    configs: mixed lengths with chunked prefill, then a pool small enough to preempt. bf16
    logits within ``BF16_REL_TOL`` of the fp32 reference."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
    from pdserve.engine.testmodel import ensure_test_model

    dev = torch.device(DEVICE)
    rows: list[Row] = []
    for variant in VARIANTS:
        model_dir = ensure_test_model(variant, model_root)
        # typeshed's functools.wraps leaves transformers' PreTrainedModel.to unbound.
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()  # type: ignore[arg-type]
        vocab = hf.config.vocab_size
        cases: list[tuple[str, list[tuple[int, int]], dict[str, Any]]] = [
            ("chunked prefill (64-token steps)", ARRIVALS, {"max_num_batched_tokens": 64}),
            (
                "chunked prefill, CUDA graphs off",
                ARRIVALS,
                {"max_num_batched_tokens": 64, "cuda_graphs": False},
            ),
            (
                "preemption (48-block pool)",
                PREEMPT_ARRIVALS,
                {"num_kv_blocks": 48, "max_model_len": 640, "max_num_batched_tokens": 128},
            ),
        ]
        for label, schedule, overrides in cases:
            rows.append(greedy_row(hf, model_dir, f"{variant} fp32", label, schedule, overrides))
        # bf16: the runner's logits for whole prompts vs transformers fp32.
        engine = LLMEngine.from_pretrained(model_dir, dtype="bfloat16", device=DEVICE)
        # object first: the engine types its runner by a protocol that ModelRunner's frozen
        # SampledToken does not match yet, so narrowing from it would read as unreachable.
        runner: object = engine.runner
        assert isinstance(runner, ModelRunner)
        worst = 0.0
        for i, n in enumerate((5, 77, 300)):
            prompt = _prompt(n, 500 + i, vocab)
            blocks = list(range(-(-n // engine.block_size)))
            chunk = ScheduledChunk("b", prompt, 0, blocks, True, SamplingParams(temperature=0.0), 0)
            _, logits = runner.compute_logits(SchedulerOutput([chunk], n))
            with torch.no_grad():
                ref = hf(torch.tensor([prompt], device=dev)).logits[0, -1].float()
            worst = max(worst, float((logits[0] - ref).abs().max() / ref.abs().max()))
        rows.append(
            Row(
                "engine",
                f"{variant} bf16 logits vs fp32",
                worst <= BF16_REL_TOL,
                worst,
                "max|diff|/max|ref|",
                BF16_REL_TOL,
            )  # fmt: skip
        )
        del engine, hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def numerics(model_root: Path, quick: bool) -> list[Row]:
    """``bench.numerics`` on the device: the engine's bf16 path (Triton kernels) and
    transformers' bf16, each against transformers in float32, on the ``small`` test model.
    Prints both tables; checks that the engine is at least as close as transformers."""
    from pdserve.bench import numerics as nm
    from pdserve.engine.testmodel import ensure_test_model

    model_dir = ensure_test_model(NUMERICS_MODEL, model_root)
    count = 40 if quick else 160
    reference = nm.TransformersProbe(model_dir, torch.float32, DEVICE)
    systems = {
        "pdserve bf16": nm.EngineProbe(model_dir, "bfloat16", DEVICE),
        "transformers bf16": nm.TransformersProbe(model_dir, torch.bfloat16, DEVICE),
    }
    prompts = nm.make_prompts(count, 8, 300, reference.model.config.vocab_size, seed=0)
    errors = nm.compare(prompts, reference, systems)
    print(nm.first_token_table(errors))
    print(nm.layer_table(errors, list(systems)))
    ours, theirs = (errors[name].first.summary() for name in systems)
    last = f"{len(reference.model.model.layers) - 1:02d} stream"
    stream = [errors[name].stages[last].rel_l2 for name in systems]
    return [
        Row(
            "numerics",
            "bf16 top-1 flips > 0.05 nats <= transformers bf16's",
            ours["costly_flips"] <= theirs["costly_flips"],
            ours["costly_flips"],
            f"of {count} prompts",
            theirs["costly_flips"],
        ),
        Row(
            "numerics",
            "bf16 mean KL to fp32 <= transformers bf16's",
            ours["mean_kl"] <= theirs["mean_kl"],
            ours["mean_kl"],
            "nats",
            theirs["mean_kl"],
        ),
        Row(
            "numerics",
            "bf16 last residual stream rel. L2 <= transformers bf16's",
            stream[0] <= stream[1],
            stream[0],
            "rel. L2",
            stream[1],
        ),
    ]


# ---- 3. prefill and decode engines in two processes ----------------------------------------


def prefill_process(conn: Connection, model_dir: str, device: str) -> None:
    """Prefill-role engine (spawned): for each batch [(rid, prompt, target_json)] prefill
    with the targets registered and answer [(rid, first_token, result_json)]."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer.connector import PrefillKVConnector

    connector = PrefillKVConnector()
    engine = LLMEngine.from_pretrained(
        model_dir, kv_connector=connector, device=device, dtype="float32", num_kv_blocks=256
    )
    conn.send("ready")
    while (batch := conn.recv()) is not None:
        conn.send(prefill_batch(engine, connector, [(r, p, NUM_NEW, t) for r, p, t in batch]))


def prefill_batch(
    engine: Any,
    connector: Any,
    batch: list[tuple[str, list[int], int, Any]],
) -> list[tuple[str, int | None, str | None]]:
    """Prefill ``[(rid, prompt, max_tokens, target_json)]`` with the KV targets registered
    (one target, a list of them: one per rank of a tensor-parallel decode replica, or a
    tuple (target, window pool's target), each of those one target or a list per rank),
    step until every send ended; ``[(rid, first token, transfer result json)]``."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.kvtransfer import KVTarget

    firsts: dict[str, int] = {}
    for rid, prompt, max_tokens, target_json in batch:
        if isinstance(target_json, tuple):
            full, window = (
                KVTarget.model_validate_json(t)
                if isinstance(t, str)
                else tuple(KVTarget.model_validate_json(x) for x in t)
                for t in target_json
            )
            connector.register_target(rid, full, window_target=window)
        elif isinstance(target_json, str):
            connector.register_target(rid, KVTarget.model_validate_json(target_json))
        else:
            targets = tuple(KVTarget.model_validate_json(t) for t in target_json)
            connector.register_target(rid, targets)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(rid, prompt, params, prefill_only=True)
    deadline = time.time() + 60
    while (engine.has_pending_work() or len(firsts) < len(batch)) and time.time() < deadline:
        for out in engine.step():
            if out.finished and out.token_ids:
                firsts[out.request_id] = out.token_ids[0]
        if not engine.has_unfinished_requests():
            time.sleep(0.002)  # only sends left: let them land
    answers = []
    for rid, *_ in batch:
        result = connector.take_result(rid, timeout=10)
        answers.append((rid, firsts.get(rid), result.model_dump_json() if result else None))
    return answers


def disaggregated(model_root: Path) -> list[Row]:
    """Prefill in a child process, decode here, KV over CUDA IPC on one GPU: tokens equal
    the single engine's. Then the transports' byte checks (``kvtransfer.gpu_check``): CUDA
    IPC, and NCCL when two GPUs are visible."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.testmodel import ensure_test_model
    from pdserve.kvtransfer import KVTransferConfig, gpu_check
    from pdserve.kvtransfer.blocks import pool_layout
    from pdserve.kvtransfer.receiver import KVReceiver

    rows: list[Row] = []
    model_dir = ensure_test_model("llama3-gqa", model_root)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    single = LLMEngine.from_pretrained(model_dir, device=DEVICE, dtype="float32")
    vocab = single.vocab_size
    prompts = [_prompt(n, 900 + n, vocab) for n in (3, 40, 257, 700)]
    expected = [list(o.token_ids) for o in single.generate(prompts, params)]
    del single
    decode = LLMEngine.from_pretrained(model_dir, device=DEVICE, dtype="float32", num_kv_blocks=256)
    layout = pool_layout(decode.kv_cache, decode.model_config.kv_identity)
    receiver = KVReceiver(decode.kv_cache, layout, KVTransferConfig())
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(child, str(model_dir), DEVICE))
    proc.start()
    try:
        if not conn.poll(180) or conn.recv() != "ready":
            raise RuntimeError("the prefill process did not start")
        batch = []
        for i, prompt in enumerate(prompts):
            blocks = decode.reserve_remote_prefill(f"d{i}", prompt, params)
            assert blocks is not None, "the decode pool has no room for the prompt"
            target = receiver.expect(f"d{i}", blocks, time.time() + 120, num_tokens=len(prompt))
            batch.append((f"d{i}", prompt, target.model_dump_json()))
        conn.send(batch)
        if not conn.poll(180):
            raise RuntimeError("the prefill process did not answer")
        transports = set()
        for rid, first, result_json in conn.recv():
            if first is None or result_json is None or '"ok":true' not in result_json:
                raise RuntimeError(f"{rid}: hand-off failed: {result_json}")
            transports.add(result_json.split('"transport":"')[1].split('"')[0])
            receiver.wait(rid)
            decode.complete_remote_prefill(rid, first)
        final: dict[str, list[int]] = {}
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.finished:
                    final[out.request_id] = list(out.token_ids)
        same = sum(final.get(f"d{i}") == expected[i] for i in range(len(prompts)))
        # One GPU, CuPy installed: CUDA IPC (a CPU smoke run goes over gloo).
        want = "cuda_ipc" if DEVICE == "cuda" else "torch_dist"
        ok = same == len(prompts) and transports == {want}
        rows.append(
            Row(
                "disagg",
                "prefill process -> decode engine, tokens == single engine",
                ok,
                same,
                f"of {len(prompts)}",
                None,
                f"transport {sorted(transports)}",
            )  # fmt: skip
        )
    finally:
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        receiver.close()
    if DEVICE != "cuda":
        return rows
    ipc = gpu_check._transfer_check("CUDA IPC, one GPU", "cuda:0", "cuda:0", "cuda_ipc")
    rows.append(Row("disagg", "CUDA IPC pool-to-pool bytes identical (2 processes)", ipc))
    tp_ipc = gpu_check.tp_transfer_check("CUDA IPC, TP ranks", "cuda:0", "cuda:0", "cuda_ipc")
    rows.append(Row("disagg", "CUDA IPC TP head slices (TP=4/TP=1 -> TP=2 rank)", tp_ipc))
    if torch.cuda.device_count() >= 2:
        nccl = gpu_check._transfer_check("NCCL pair", "cuda:0", "cuda:1", "torch_dist")
        rows.append(Row("disagg", "NCCL pair cuda:0 -> cuda:1 bytes identical", nccl))
        tp_nccl = gpu_check.tp_transfer_check("NCCL, TP ranks", "cuda:0", "cuda:1", "torch_dist")
        rows.append(Row("disagg", "NCCL TP head slices (TP=4/TP=1 -> TP=2 rank)", tp_nccl))
    else:
        rows.append(
            Row(
                "disagg",
                "NCCL pair",
                None,
                note=f"skipped: {torch.cuda.device_count()} GPU visible, the pair needs two",
            )  # fmt: skip
        )
    return rows


# ---- 5. tensor parallelism over two GPUs ---------------------------------------------------

TP_VARIANTS = ("llama3-gqa", "mqa")  # KV heads split over the ranks; one KV head replicated


def tensor_parallel(model_root: Path) -> list[Row]:
    """TP=2 (NCCL between two GPUs, ranks as child processes): greedy tokens equal
    transformers (fp32) with chunked prefill and preemption, on GQA and MQA. Skipped with
    the reason when fewer than two GPUs are visible."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.testmodel import ensure_test_model

    visible = torch.cuda.device_count() if DEVICE == "cuda" else 2
    if visible < 2:
        return [
            Row(
                "tp",
                "TP=2 greedy == transformers",
                None,
                note=f"skipped: {visible} GPU visible, TP=2 needs two",
            )
        ]
    dev = torch.device(DEVICE)
    rows: list[Row] = []
    for variant in TP_VARIANTS:
        model_dir = ensure_test_model(variant, model_root)
        # typeshed's functools.wraps leaves transformers' PreTrainedModel.to unbound.
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()  # type: ignore[arg-type]
        arrivals = [
            (t, f"r{i}", _prompt(n, 300 + i, hf.config.vocab_size))
            for i, (t, n) in enumerate(PREEMPT_ARRIVALS)
        ]
        expected = {rid: _hf_greedy(hf, p, dev) for _, rid, p in arrivals}
        engine = LLMEngine.from_pretrained(
            model_dir,
            dtype="float32",
            device=DEVICE,
            tensor_parallel_size=2,
            tp_workers="mp",
            num_kv_blocks=48,
            max_model_len=640,
            max_num_batched_tokens=128,
        )
        try:
            got = _run_arrivals(engine, arrivals)
            preempted = engine.stats().num_preemptions
        finally:
            engine.shutdown()
        same = sum(got[rid] == expected[rid] for rid in expected)
        rows.append(
            Row(
                "tp",
                f"{variant} TP=2 fp32 greedy == transformers, chunked + preemption",
                same == len(expected) and preempted > 0,
                same,
                f"of {len(expected)} requests",
                None,
                f"{preempted} preemptions",
            )  # fmt: skip
        )
        del hf
    return rows


# ---- 4. decode throughput and compilations after warm-up ----------------------------------


def _engine_decode_tps(engine: Any, batch: int, prompt_len: int, new: int) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(
            f"t{batch}-{i}", [rng.randrange(3, engine.vocab_size) for _ in range(prompt_len)],
            params,
        )  # fmt: skip
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill and first tokens: not timed
    _sync()
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    _sync()
    return tokens / (time.perf_counter() - t0)


def _hf_decode_tps(hf: Any, batch: int, prompt_len: int, new: int) -> float:
    from transformers import GenerationConfig

    ids = torch.randint(3, hf.config.vocab_size, (batch, prompt_len), device=DEVICE)
    gc1 = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, generation_config=gc1)  # warm-up
        _sync()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, generation_config=gc1)
        _sync()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, generation_config=gc)
        _sync()
        total = time.perf_counter() - t0
    return batch * (new - 1) / max(total - prefill, 1e-9)


def throughput(model_root: Path, quick: bool) -> list[Row]:
    """Decode tokens/s at batch 1/8/32/128 (bf16, the 'small' test model), engine with and
    without CUDA graphs vs transformers ``generate``; Triton compilations while serving
    after warm-up (must be 0)."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.testmodel import ensure_test_model
    from pdserve.kernels.triton.jit_count import CompileCounter

    model_dir = ensure_test_model(THROUGHPUT_MODEL, model_root)
    new = 16 if quick else 64
    rows: list[Row] = []
    engines = {
        graphs: LLMEngine.from_pretrained(
            model_dir,
            device=DEVICE,
            dtype="bfloat16",
            max_num_seqs=max(THROUGHPUT_BATCHES),
            max_num_batched_tokens=4096,
            cuda_graphs=graphs,
        )  # fmt: skip  (kernels compiled and graphs captured in the constructor)
        for graphs in (False, True)
    }
    # typeshed's functools.wraps leaves transformers' PreTrainedModel.to unbound.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE).eval()  # type: ignore[arg-type]
    with CompileCounter() as compiles:
        for batch in THROUGHPUT_BATCHES:
            theirs = _hf_decode_tps(hf, batch, 32, new)
            for graphs, engine in engines.items():
                ours = _engine_decode_tps(engine, batch, 32, new)
                label = "CUDA graphs" if graphs else "eager"
                rows.append(
                    Row(
                        "throughput",
                        f"decode tok/s batch {batch}, {label}",
                        True,
                        ours,
                        "tok/s",
                        None,
                        f"transformers generate {theirs:.0f} tok/s, x{ours / theirs:.2f}",
                    )  # fmt: skip
                )
    rows.append(
        Row(
            "throughput",
            "Triton compilations after warm-up",
            compiles.total == 0,
            compiles.total,
            "compilations",
            0,
            str(dict(compiles.by_kernel)),
        )  # fmt: skip
    )
    return rows


# ---- 7. the transformers model path under decode CUDA graphs -----------------------------


class _ReplayCounter:
    """Counts the decode steps a runner's ``DecodeGraphs`` replays."""

    def __init__(self, graphs: Any) -> None:
        self.replays = 0
        self._run = graphs.run
        graphs.run = self

    def __call__(self, *args: Any) -> torch.Tensor:
        self.replays += 1
        out: torch.Tensor = self._run(*args)
        return out


def transformers_graphs(model_root: Path) -> list[Row]:
    """``model_impl="transformers"`` with decode CUDA graphs: greedy tokens (fp32, mixed
    lengths, chunked prefill) equal transformers' for a dense Llama, whose graphs must be
    captured and replayed, and for a Qwen3-MoE run by transformers' own experts code, which
    is reported either way (captured, or decode steps eager after a failed capture); decode
    tok/s at batch 1 and 8 (bf16, the 'small' test model) with graphs on and off."""
    import argparse

    from transformers import AutoModelForCausalLM

    from pdserve.bench.moe import write_model
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.testmodel import ensure_test_model

    dev = torch.device(DEVICE)
    moe_shape = argparse.Namespace(hidden=128, inter=64, experts=8, top_k=2, arch="qwen3-moe")
    models = [
        ("llama3-gqa", ensure_test_model("llama3-gqa", model_root), True),
        ("qwen3-moe", write_model(model_root / "qwen3-moe", moe_shape), False),
    ]
    rows: list[Row] = []
    for name, model_dir, must_capture in models:
        # typeshed's functools.wraps leaves transformers' PreTrainedModel.to unbound.
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()  # type: ignore[arg-type]
        vocab = hf.config.vocab_size
        arrivals = [(t, f"r{i}", _prompt(n, 100 + i, vocab)) for i, (t, n) in enumerate(ARRIVALS)]
        expected = {rid: _hf_greedy(hf, p, dev) for _, rid, p in arrivals}
        engine = LLMEngine.from_pretrained(
            model_dir, dtype="float32", device=DEVICE, block_size=16,
            model_impl="transformers", max_num_batched_tokens=64,
        )  # fmt: skip
        # object first: the engine types its runner by a protocol (see engine_vs_transformers).
        runner: object = engine.runner
        assert isinstance(runner, ModelRunner)
        graphs = runner.decode_graphs
        counter = _ReplayCounter(graphs) if graphs is not None else None
        got = _run_arrivals(engine, arrivals)
        same = sum(got[rid] == expected[rid] for rid in expected)
        replays = counter.replays if counter is not None else 0
        how = f"{replays} decode steps replayed" if graphs is not None else "eager"
        if graphs is None and DEVICE == "cuda":
            how = "eager: the capture failed"
        rows.append(
            Row("tfgraphs", f"{name} transformers path fp32 greedy == transformers, graphs on",
                same == len(expected), same, f"of {len(expected)} requests", None, how)
        )  # fmt: skip
        if must_capture:
            on_gpu = DEVICE == "cuda"
            rows.append(
                Row("tfgraphs", f"{name} transformers path decode steps replayed from graphs",
                    replays > 0 if on_gpu else None, replays, "replays", None,
                    "" if on_gpu else "skipped: no CUDA graphs on a CPU")
            )  # fmt: skip
        del engine, hf
        torch.cuda.empty_cache()
    model_dir = ensure_test_model(THROUGHPUT_MODEL, model_root)
    engines = {
        on: LLMEngine.from_pretrained(
            model_dir,
            device=DEVICE,
            dtype="bfloat16",
            max_num_seqs=8,
            model_impl="transformers",
            cuda_graphs=on,
        )  # fmt: skip
        for on in (False, True)
    }
    for batch in (1, 8):
        tps = {on: _engine_decode_tps(engine, batch, 32, 32) for on, engine in engines.items()}
        gain = f"eager {tps[False]:.0f} tok/s, x{tps[True] / tps[False]:.2f}"
        rows.append(
            Row("tfgraphs", f"transformers path decode tok/s batch {batch}, CUDA graphs", True,
                tps[True], "tok/s", None, gain)
        )  # fmt: skip
    return rows
