"""Where bfloat16 error enters: the engine's bf16 path and transformers' bf16 against float32.

    python -P -m pdserve.bench.numerics [--model DIR | --size small] [--prompts 160]
                                        [--model-impl auto|native|transformers]
                                        [--min-len 8] [--max-len 300] [--seed 0]
                                        [--device cpu|cuda] [--out FILE.json]
                                        [--quantization int8 int8-weight-only fp8 int8+head ...]
                                        [--quantized NAME=DIR ...]
                                        [--kv-cache-dtype fp8_e4m3 int8]

Each prompt (random token ids, lengths uniform in ``[--min-len, --max-len]``, fixed seed)
runs once through each system; the reference is transformers in float32 (the engine's
float32 path matches it exactly, which the ``pdserve fp32`` row shows). Forward hooks
record, for every prompt token, the output of each decoder layer's attention (after
``o_proj``), its MLP, the residual stream after the layer (what the next layer adds to;
for the engine the exact sum of the two parts it carries), the final norm, and the logits
of the last prompt token (the first sampled token's distribution).

Two tables:

- **first token**: share of prompts whose top-1 token equals the
  reference's; top-1 flips costing more than 0.05 nats (the reference log-probability of
  the reference's top token minus that of the chosen one); mean |log-probability error| of
  the chosen token; mean KL(reference || system).
- **per layer**: relative L2 error (pooled over all tokens of all prompts) and max absolute
  error of each stage, for the engine's bf16 path and for transformers' bf16.

Quantized variants join the first-token table against the same float32 reference:
``--quantization`` quantizes the float model at load, ``--quantized NAME=DIR`` loads a
quantized checkpoint of it (``engine/testmodel_quant.py`` writes them) in pdserve and, where
transformers can run that format here, in transformers too. ``--kv-cache-dtype`` runs
pdserve bf16 over an int8 / float8 KV cache (``EngineConfig.kv_cache_dtype``): the prompt's
own attention reads the quantized cache, so the first token carries its error.

Writes the tables as JSON with ``--out``. On CUDA the engine runs its Triton kernels, so the
same command compares the GPU path (``bench/gpu_verify.py`` runs it as its ``numerics``
step).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import BatchInputs, ModelRunner
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.testmodel import SIZES, ensure_test_model

FLIP_NATS = 0.05  # a top-1 change that costs more than this is a real flip, not a tie


@dataclass
class StageError:
    """Error of one stage against the reference, pooled over every token seen."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    max_abs: float = 0.0

    def add(self, value: torch.Tensor, ref: torch.Tensor) -> None:
        diff = value - ref
        self.sq_err += float(diff.square().sum())
        self.sq_ref += float(ref.square().sum())
        self.max_abs = max(self.max_abs, float(diff.abs().max()))

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref else 0.0


@dataclass
class FirstToken:
    """How the first sampled token's distribution compares with the reference's."""

    prompts: int = 0
    top1_agree: int = 0
    costly_flips: int = 0
    abs_logprob_err: float = 0.0
    kl: float = 0.0

    def add(self, logits: torch.Tensor, ref_logits: torch.Tensor) -> None:
        lp = torch.log_softmax(logits.double(), -1)
        ref = torch.log_softmax(ref_logits.double(), -1)
        chosen, best = int(lp.argmax()), int(ref.argmax())
        self.prompts += 1
        self.top1_agree += chosen == best
        self.costly_flips += float(ref[best] - ref[chosen]) > FLIP_NATS
        self.abs_logprob_err += abs(float(lp[chosen] - ref[chosen]))
        self.kl += float((ref.exp() * (ref - lp)).sum())

    def summary(self) -> dict[str, float]:
        n = max(self.prompts, 1)
        return {
            "prompts": self.prompts,
            "top1_agree": self.top1_agree / n,
            "costly_flips": self.costly_flips,
            "mean_abs_logprob_err": self.abs_logprob_err / n,
            "mean_kl": self.kl / n,
        }


@dataclass
class SystemErrors:
    first: FirstToken = field(default_factory=FirstToken)
    stages: dict[str, StageError] = field(default_factory=dict)

    def add_stages(self, seen: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
        for name, value in seen.items():
            self.stages.setdefault(name, StageError()).add(value, ref[name])


# ---- capturing the stages -------------------------------------------------------------------


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def _hooks(layers: Any, norm: torch.nn.Module, engine: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Record every stage of one forward pass into the yielded dict (float64, [T, H])."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, fn: Callable[[Any], torch.Tensor]) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            value = fn(output).detach()
            seen[name] = value.reshape(-1, value.shape[-1]).double().cpu()

        return hook

    def stream(output: Any) -> torch.Tensor:
        if engine:  # (mlp_out, residual): the stream is their sum, taken exactly
            mlp_out, residual = output
            return mlp_out.double() + residual.double()
        return _first(output)

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.register_forward_hook(keep(f"{i:02d} attn", _first)))
        handles.append(layer.mlp.register_forward_hook(keep(f"{i:02d} mlp", _first)))
        handles.append(layer.register_forward_hook(keep(f"{i:02d} stream", stream)))
    handles.append(norm.register_forward_hook(keep("final norm", _first)))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


class EngineProbe:
    """The engine's path (its kernels, packed linears, fused ops) for one prompt at a time."""

    def __init__(self, model_dir: Path, dtype: str, device: str, **config: Any) -> None:
        config = {
            "enable_prefix_caching": False,  # every prompt computed whole
            "max_num_batched_tokens": 4096,  # run() alone: one prefill step per prompt
            "cuda_graphs": False,
            **config,
        }
        self.engine = LLMEngine.from_pretrained(model_dir, dtype=dtype, device=device, **config)
        # object first: the engine types its runner by a protocol that ModelRunner's frozen
        # SampledToken does not match yet, so narrowing from it would read as unreachable.
        runner: object = self.engine.runner
        assert isinstance(runner, ModelRunner)
        # The native class carries the residual stream beside each layer's output; on the
        # transformers path the layers are transformers' own (hooked like the reference's).
        self.native = isinstance(runner.model, LlamaForCausalLM)
        self.inner: Any = runner.model.model if self.native else runner.model.base
        self._logits: dict[str, torch.Tensor] = {}  # request id -> its first token's logits
        compute_logits = runner.compute_logits

        def recording(out: SchedulerOutput) -> tuple[BatchInputs, torch.Tensor]:
            batch, logits = compute_logits(out)
            for rid, row in zip(batch.sample_request_ids, logits, strict=True):
                self._logits.setdefault(rid, row.detach().float().cpu())
            return batch, logits

        runner.compute_logits = recording  # type: ignore[method-assign]

    def run(self, prompt: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One prompt alone: every stage, and the first token's logits."""
        self._logits.clear()
        inner = self.inner
        with _hooks(inner.layers, inner.norm, engine=self.native) as seen:
            self.engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        return dict(seen), next(iter(self._logits.values()))

    def first_tokens(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """All prompts queued at once and scheduled as a server would (continuous batching,
        chunked prefill within the step budget): each one's first-token logits."""
        self._logits.clear()
        outs = self.engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
        return [self._logits[o.request_id] for o in outs]


class TransformersProbe:
    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str) -> None:
        from transformers import AutoModelForCausalLM

        # typeshed's functools.wraps leaves transformers' PreTrainedModel.to unbound.
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)  # type: ignore[arg-type]
        self.model.eval()
        self.device = device

    @torch.inference_mode()
    def run(self, prompt: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inner = self.model.model
        ids = torch.tensor([prompt], device=self.device)
        with _hooks(inner.layers, inner.norm, engine=False) as seen:
            logits = self.model(ids).logits[0, -1]
        return dict(seen), logits.float().cpu()


# ---- the run -------------------------------------------------------------------------------


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    # ids below 4 are the test tokenizers' special tokens
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for length in lens]


def compare(
    prompts: list[list[int]], reference: TransformersProbe, systems: dict[str, Any]
) -> dict[str, SystemErrors]:
    """Each prompt alone through the reference and every system; the batched systems
    (``EngineProbe`` under a name ending in "batched") get all prompts at once after."""
    errors = {name: SystemErrors() for name in systems}
    ref_first: list[torch.Tensor] = []
    alone = {name: p for name, p in systems.items() if not name.endswith("batched")}
    for i, prompt in enumerate(prompts):
        ref_stages, ref_logits = reference.run(prompt)
        ref_first.append(ref_logits)
        for name, probe in alone.items():
            stages, logits = probe.run(prompt)
            errors[name].first.add(logits, ref_logits)
            errors[name].add_stages(stages, ref_stages)
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
    for name, probe in systems.items():
        if name not in alone:
            for logits, ref_logits in zip(probe.first_tokens(prompts), ref_first, strict=True):
                errors[name].first.add(logits, ref_logits)
    return errors


def first_token_table(errors: dict[str, SystemErrors]) -> str:
    lines = [
        f"{'system':<22}{'top-1 agrees':>14}{'flips > 0.05 nats':>19}"
        f"{'mean |logprob err|':>20}{'mean KL':>11}"
    ]
    for name, e in errors.items():
        s = e.first.summary()
        lines.append(
            f"{name:<22}{s['top1_agree']:>14.1%}{s['costly_flips']:>13} / {s['prompts']:<3}"
            f"{s['mean_abs_logprob_err']:>20.4f}{s['mean_kl']:>11.5f}"
        )
    return "\n".join(lines)


def layer_table(errors: dict[str, SystemErrors], systems: list[str]) -> str:
    stages = list(errors[systems[0]].stages)
    head = f"{'stage':<14}" + "".join(f"{name + ' rel L2':>24}{'max abs':>10}" for name in systems)
    lines = [head]
    for stage in stages:
        row = f"{stage:<14}"
        for name in systems:
            s = errors[name].stages[stage]
            row += f"{s.rel_l2:>24.2e}{s.max_abs:>10.3g}"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bf16 error by stage: pdserve vs transformers")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a local Hugging Face model directory")
    src.add_argument("--size", choices=sorted(SIZES), default="small", help="a test model")
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--skip-fp32", action="store_true", help="no pdserve fp32 row")
    parser.add_argument(
        "--batch",
        type=int,
        default=64,
        help="also run all prompts at once, at most this many in flight (0: skip)",
    )
    parser.add_argument(
        "--quantization",
        nargs="*",
        default=[],
        choices=[f"{m}{h}" for m in ("int8", "int8-weight-only", "fp8") for h in ("", "+head")],
        help="also run pdserve with the float model quantized at load by each method "
        "(+head: and quantize_lm_head)",
    )
    parser.add_argument(
        "--quantized",
        nargs="*",
        default=[],
        metavar="NAME=DIR",
        help="also run these quantized checkpoints of the same model (pdserve, and "
        "transformers where it loads them)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="*",
        default=[],
        choices=["fp8_e4m3", "int8"],
        help="also run pdserve bf16 over a KV cache of each dtype",
    )
    parser.add_argument(
        "--model-impl",
        choices=["auto", "native", "transformers"],
        default="auto",
        help="pdserve's model code (EngineConfig.model_impl)",
    )
    parser.add_argument("--out", type=Path, help="write the tables as JSON here")
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        parser.error(f"--min-len {args.min_len} / --max-len {args.max_len}: need 1 <= min <= max")
    model_dir = args.model or ensure_test_model(args.size)
    reference = TransformersProbe(model_dir, torch.float32, args.device)
    vocab = reference.model.config.vocab_size
    impl = {"model_impl": args.model_impl}
    systems: dict[str, Any] = {
        "pdserve bf16": EngineProbe(model_dir, "bfloat16", args.device, **impl),
        "transformers bf16": TransformersProbe(model_dir, torch.bfloat16, args.device),
    }
    if args.batch:
        systems["pdserve bf16 batched"] = EngineProbe(
            model_dir,
            "bfloat16",
            args.device,
            max_num_batched_tokens=2048,
            max_num_seqs=args.batch,
            **impl,
        )
    if not args.skip_fp32:
        systems["pdserve fp32"] = EngineProbe(model_dir, "float32", args.device, **impl)
    for method in args.quantization:
        systems[f"pdserve {method}"] = EngineProbe(
            model_dir,
            "auto",
            args.device,
            quantization=method.removesuffix("+head"),
            quantize_lm_head=method.endswith("+head"),
        )
    for kv_dtype in args.kv_cache_dtype:
        systems[f"pdserve bf16 kv {kv_dtype}"] = EngineProbe(
            model_dir, "bfloat16", args.device, kv_cache_dtype=kv_dtype, **impl
        )
    for spec in args.quantized:
        name, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"--quantized {spec!r}: want NAME=DIR")
        systems[f"pdserve {name}"] = EngineProbe(Path(path), "auto", args.device)
        try:
            systems[f"transformers {name}"] = TransformersProbe(
                Path(path), torch.float32, args.device
            )
        except Exception as exc:  # noqa: BLE001 - a format transformers cannot run here
            print(f"transformers cannot load {name}: {exc}", file=sys.stderr)
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, vocab, args.seed)
    errors = compare(prompts, reference, systems)
    print(
        f"first token vs transformers float32, {len(prompts)} prompts "
        f"of {args.min_len}-{args.max_len} tokens, {args.device}"
    )
    print(first_token_table(errors))
    print()
    print("per stage, all prompt tokens")
    print(layer_table(errors, ["pdserve bf16", "transformers bf16"]))
    if args.out:
        report = {
            "device": args.device,
            "model": str(model_dir),
            "prompts": len(prompts),
            "lengths": [args.min_len, args.max_len],
            "seed": args.seed,
            "first_token": {name: e.first.summary() for name, e in errors.items()},
            "stages": {
                name: {
                    stage: {"rel_l2": s.rel_l2, "max_abs": s.max_abs} | asdict(s)
                    for stage, s in e.stages.items()
                }
                for name, e in errors.items()
            },
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
