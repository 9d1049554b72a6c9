"""GPU transports check: ``python -m pdserve.kvtransfer.gpu_check``.

1. CUDA IPC between two processes on one GPU: a decode-side process exports its pool, this
   process writes random blocks into it; the decode side checks they are byte-identical at
   the destination ids; bandwidth is printed next to a plain device-to-device copy.
2. NCCL between two GPUs (decode pool on cuda:1, prefill on cuda:0) when there are two;
   otherwise it says so.
Each also moves KV between tensor-parallel ranks (``tp_transfer_check``: head slices on
both sides), which runs on CPU over gloo as well (tests/kvtransfer/test_tp_transfer.py).

Without CUDA it says so and exits 0. Exits 1 if any check fails.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import sys
import time
from multiprocessing.connection import Connection

import torch

from pdserve.kvtransfer import KVLayout, KVTarget, KVTransferConfig
from pdserve.kvtransfer.types import TransportName

LAYOUT = KVLayout(
    model="gpu-check", num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"
)
NUM_BLOCKS = 1024  # 64 KiB per block per layer: a 512 MiB pool


def _pool(device: str, seed: int | None, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    shape = (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
             LAYOUT.head_dim)  # fmt: skip
    if seed is None:
        return torch.zeros(shape, dtype=torch.float16, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.float16).to(device)


def _decode_side(conn: Connection, device: str, transport: TransportName) -> None:
    from pdserve.kvtransfer.receiver import KVReceiver

    torch.cuda.set_device(device)
    pool = _pool(device, None)
    receiver = KVReceiver(pool, LAYOUT, KVTransferConfig(transport=transport))
    try:
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            rid, dst_ids, src_ids, seed = cmd
            conn.send(receiver.expect(rid, dst_ids, time.time() + 120).model_dump_json())
            result = receiver.wait(rid)
            expected = _pool(device, seed)
            index = torch.tensor(dst_ids, device=device)
            got = pool.index_select(2, index)
            want = expected.index_select(2, torch.tensor(src_ids, device=device))
            same = torch.equal(got.view(torch.int16), want.view(torch.int16))
            conn.send((result.ok, same, result.bytes))
    finally:
        receiver.close()


def _transfer_check(name: str, src_device: str, dst_device: str, transport: TransportName) -> bool:
    from pdserve.kvtransfer.sender import KVSender

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, dst_device, transport))
    proc.start()
    ok = True
    try:
        torch.cuda.set_device(src_device)
        seed = 17
        src = _pool(src_device, seed)
        sender = KVSender(LAYOUT, device=src_device)
        rng = random.Random(seed)
        times = []
        nbytes = 0
        for rep in range(4):  # the first one sets up the mapping / communicator
            n = NUM_BLOCKS // 2
            src_ids, dst_ids = rng.sample(range(NUM_BLOCKS), n), rng.sample(range(NUM_BLOCKS), n)
            conn.send((f"r{rep}", dst_ids, src_ids, seed))
            target = KVTarget.model_validate_json(conn.recv())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = sender.open(target, src_ids)
            for layer in range(LAYOUT.num_layers):
                sender.send_layer(handle, layer, src)
            result = sender.finish(handle)
            elapsed = time.perf_counter() - t0
            landed, same, nbytes = conn.recv()
            if not (result.ok and landed and same):
                print(f"FAIL {name}: ok={result.ok} landed={landed} byte-identical={same}")
                ok = False
            if rep:
                times.append(elapsed)
        sender.close()
        a = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        torch.cuda.synchronize()
        copy_s = (time.perf_counter() - t0) / 5
        best = min(times)
        print(
            f"{'ok  ' if ok else 'FAIL'} {name}: {nbytes / 2**20:.0f} MiB, byte-identical, "
            f"{nbytes / best / 1e9:.1f} GB/s (best of {len(times)}) vs device copy "
            f"{nbytes / copy_s / 1e9:.1f} GB/s"
        )
    finally:
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return ok


def _tp_decode_side(
    conn: Connection, device: str, transport: TransportName, layout_json: str, num_blocks: int
) -> None:
    """A decode rank holding some of the heads: expects each request, checks that its pool
    holds exactly its heads of the seeded source blocks."""
    from pdserve.kvtransfer.receiver import KVReceiver

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    layout = KVLayout.model_validate_json(layout_json)
    heads = slice(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
    pool = _pool(device, None, num_blocks)[..., heads, :].contiguous()
    receiver = KVReceiver(pool, layout, KVTransferConfig(transport=transport))
    try:
        while (cmd := conn.recv()) is not None:
            rid, dst_ids, src_ids, seed = cmd
            conn.send(receiver.expect(rid, dst_ids, time.time() + 120).model_dump_json())
            result = receiver.wait(rid)
            want = _pool(device, seed, num_blocks)[..., heads, :]
            want = want.index_select(2, torch.tensor(src_ids, device=device))
            got = pool.index_select(2, torch.tensor(dst_ids, device=device))
            same = torch.equal(got.view(torch.int16), want.view(torch.int16))
            conn.send((result.ok, same, result.bytes))
    finally:
        receiver.close()


def tp_transfer_check(
    name: str,
    src_device: str,
    dst_device: str,
    transport: TransportName,
    num_blocks: int = NUM_BLOCKS,
) -> bool:
    """Head slices between tensor-parallel ranks: decode rank 1 of TP=2 (heads [4, 8))
    gets one request from prefill ranks 2 and 3 of TP=4 (a quarter of the heads each,
    landing at head offsets 0 and 2 of the decode pool) and one from a TP=1 pool (sending
    its heads [4, 8) only). Byte-identical, and each decode head's bytes sent once."""
    from pdserve.kvtransfer.sender import KVSender
    from pdserve.kvtransfer.tp_plan import rank_layout

    decode = rank_layout(LAYOUT, 2, 1)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=_tp_decode_side,
        args=(child, dst_device, transport, decode.model_dump_json(), num_blocks),
    )
    proc.start()
    ok = True
    senders: list[KVSender] = []
    try:
        if src_device.startswith("cuda"):
            torch.cuda.set_device(src_device)
        seed = 23
        full = _pool(src_device, seed, num_blocks)
        rng = random.Random(seed)
        cases = {
            "tp4-ranks-2-3": [rank_layout(LAYOUT, 4, 2), rank_layout(LAYOUT, 4, 3)],
            "tp1": [LAYOUT],
        }
        for rid, layouts in cases.items():
            n = num_blocks // 4
            src_ids, dst_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
            conn.send((rid, dst_ids, src_ids, seed))
            target = KVTarget.model_validate_json(conn.recv())
            handles = []
            for layout in layouts:
                heads = slice(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)
                pool = full[..., heads, :].contiguous()
                sender = KVSender(layout, device=src_device)
                senders.append(sender)
                handle = sender.open(target, src_ids)
                for layer in range(LAYOUT.num_layers):
                    sender.send_layer(handle, layer, pool)
                handles.append((sender, handle))
            sent = [s.finish(h, check=False) for s, h in handles]
            landed, same, nbytes = conn.recv()
            want = LAYOUT.num_layers * n * decode.block_bytes()
            good = all(r.ok for r in sent) and sum(r.bytes for r in sent) == want == nbytes
            if not (good and landed and same):
                print(
                    f"FAIL {name} {rid}: sent ok={[r.ok for r in sent]} "
                    f"bytes={sum(r.bytes for r in sent)}/{want} landed={landed} "
                    f"byte-identical={same}"
                )
                ok = False
        if ok:
            print(f"ok   {name}: head slices 4->2 and 1->2 land byte-identical, each head once")
    finally:
        for sender in senders:
            sender.close()
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA is not available: skipping the CUDA IPC and NCCL checks.")
        return 0
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("FAIL cuda_ipc: CuPy is not installed (pip install 'pdserve[cuda]')")
        ipc_ok = False
    else:
        ipc_ok = _transfer_check("CUDA IPC, one GPU, two processes", "cuda:0", "cuda:0", "cuda_ipc")
        ipc_ok &= tp_transfer_check("CUDA IPC, TP ranks", "cuda:0", "cuda:0", "cuda_ipc")
    if torch.cuda.device_count() >= 2:
        nccl_ok = _transfer_check("NCCL, cuda:0 -> cuda:1", "cuda:0", "cuda:1", "torch_dist")
        nccl_ok &= tp_transfer_check("NCCL, TP ranks", "cuda:0", "cuda:1", "torch_dist")
    else:
        print(f"NCCL check skipped: {torch.cuda.device_count()} GPU(s) visible, it needs two.")
        nccl_ok = True
    return 0 if ipc_ok and nccl_ok else 1


if __name__ == "__main__":
    sys.exit(main())
