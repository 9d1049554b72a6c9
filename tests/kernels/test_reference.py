"""The torch references themselves, checked against independent naive or HF implementations."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import reference as R
from tests.kernels.cases import assert_close, make_batch


def naive_attention(batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Position by position, head by head dense softmax in float64."""
    q, kc, vc = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    block_size = kc.shape[1]
    group = q.shape[1] // kc.shape[2]
    out = torch.zeros_like(q)
    cu = batch.cu_seqlens_q.tolist()
    for s, ctx in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[s].tolist()
        keys = torch.stack([kc[table[p // block_size], p % block_size] for p in range(ctx)])
        values = torch.stack([vc[table[p // block_size], p % block_size] for p in range(ctx)])
        q_len = cu[s + 1] - cu[s]
        for j in range(q_len):
            pos = ctx - q_len + j
            for h in range(q.shape[1]):
                scores = [
                    float(q[cu[s] + j, h] @ keys[p, h // group]) * batch.scale
                    for p in range(pos + 1)
                ]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                for p, w in enumerate(weights):
                    out[cu[s] + j, h] += w / total * values[p, h // group]
    return out.to(batch.q.dtype)


@pytest.mark.parametrize(("ratio", "block_size"), [(1, 16), (4, 32), (8, 16)])
def test_reference_attention_matches_naive_softmax(ratio: int, block_size: int) -> None:
    batch = make_batch(
        seed=ratio,
        q_lens=[1, 9, 1, 17],
        ctx_lens=[5, 9, 40, 33],
        num_q_heads=2 * ratio,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
        dtype=torch.float32,
    )
    got = R.paged_attention_ref(*batch.attention_args())
    assert_close(got, naive_attention(batch), 1e-5)


def test_decode_reference_is_last_position_of_general_reference() -> None:
    batch = make_batch(
        seed=3,
        q_lens=[1, 1, 1],
        ctx_lens=[1, 17, 50],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
    )
    got = R.paged_decode_attention_ref(*batch.decode_args())
    assert_close(got, naive_attention(batch), 1e-5)


def test_write_kv_places_rows_at_slots_and_skips_padding() -> None:
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key = torch.randn(3, 2, 16)
    value = torch.randn(3, 2, 16)
    R.write_kv_ref(key, value, k_cache, v_cache, torch.tensor([19, -1, 0]))
    assert torch.equal(k_cache[2, 3], key[0]) and torch.equal(v_cache[2, 3], value[0])
    assert torch.equal(k_cache[0, 0], key[2]) and torch.equal(v_cache[0, 0], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # the padding token wrote nothing


def test_gather_then_scatter_round_trips_blocks_of_all_layers() -> None:
    kv = torch.randn(3, 2, 6, 4, 2, 8)  # [L, 2, N, B, Hkv, D]
    ids = torch.tensor([5, 0, 3])
    packed = R.gather_blocks_ref(kv, ids)
    assert packed.shape == (3, 2, 3, 4, 2, 8) and packed.is_contiguous()
    assert torch.equal(packed[1, 0, 2], kv[1, 0, 3])
    dest = torch.zeros_like(kv)
    R.scatter_blocks_ref(packed, dest, torch.tensor([1, 2, 4]))
    assert torch.equal(dest[:, :, 1], kv[:, :, 5])
    assert torch.equal(dest[:, :, 4], kv[:, :, 3])
    assert torch.equal(dest[:, :, 0], torch.zeros_like(dest[:, :, 0]))


def test_rms_norm_matches_hf_llama_rmsnorm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    norm.weight.data = torch.randn(64)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    with torch.no_grad():
        expected = norm(x + residual)
    out, new_residual = R.rms_norm_ref(x, norm.weight.data, 1e-5, residual)
    assert torch.equal(new_residual, x + residual)
    assert_close(out, expected, 1e-6)
    assert_close(R.rms_norm_ref(x, norm.weight.data, 1e-5), norm(x).detach(), 1e-6)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {  # gpt-oss's parameters (no truncation of the ramp)
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },  # fmt: skip
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 128,
        },  # fmt: skip
    ],
    ids=lambda p: f"{p['rope_type']}-{len(p)}",
)
def test_rope_matches_hf_llama(rope_parameters: dict) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads = 32, 2
    config = LlamaConfig(
        hidden_size=head_dim * heads,
        num_attention_heads=heads,
        max_position_embeddings=512,
        rope_parameters=dict(rope_parameters),
    )
    positions = torch.tensor([0, 1, 7, 100, 511])
    q = torch.randn(5, heads, head_dim)
    k = torch.randn(5, 1, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, D]
    # HF works on [batch, heads, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = R.build_rope_cache_ref(
        head_dim, 512, rope_parameters["rope_theta"], rope_parameters, torch.float32, "cpu"
    )
    q_ours, k_ours = R.apply_rotary_ref(positions, q, k, cache)
    assert_close(q_ours, q_hf[0].transpose(0, 1), 1e-5)
    assert_close(k_ours, k_hf[0].transpose(0, 1), 1e-5)


def test_rope_rejects_unknown_scaling() -> None:
    with pytest.raises(ValueError, match="rope_type"):
        R.build_rope_cache_ref(16, 8, 10000.0, {"rope_type": "longrope"}, torch.float32, "cpu")
