"""The connector in one process: a producer holds blocks, a consumer (shared memory
reader) copies them, the producer frees on release or on its deadline."""
from __future__ import annotations

import time

import torch

from duetserve.kv_transfer.compress import staging_layouts
from duetserve.kv_transfer.config import KVTransferConfig
from duetserve.kv_transfer.connector import KVConnector
from duetserve.kv_transfer.layout import KVLayout
from duetserve.kv_transfer.memory import SharedKVMemory

LAYOUT = KVLayout(2, 2, 8, 4, 8, "float32")


def _pair(timeout_s: float = 30.0, compression: str = "none"):
    pre_mem, dec_mem = SharedKVMemory(LAYOUT.nbytes), SharedKVMemory(LAYOUT.nbytes)
    pre = KVConnector(KVTransferConfig("prefill", timeout_s=timeout_s, mooncake=False,
                                       compression=compression), LAYOUT, pre_mem, "h")
    dec = KVConnector(KVTransferConfig("decode", timeout_s=timeout_s), LAYOUT, dec_mem, "h")
    dec.reader.hostname = "h"
    return pre, dec, pre_mem.view(torch.float32, (2, 2, 2, 8, 4, 8)), \
        dec_mem.view(torch.float32, (2, 2, 2, 8, 4, 8))


def _wait_load(dec: KVConnector):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        free, loads = dec.poll()
        if loads:
            return loads
        time.sleep(0.01)
    raise AssertionError("load did not end")


def test_shm_load_copies_the_blocks_and_times_the_copy() -> None:
    pre, dec, src, dst = _pair()
    src.copy_(torch.randn_like(src))
    remote = pre.hold("r", [5, 6, 2], 10, 42, None)
    dec.start_load("r", remote, [0, 1, 7], 1)          # first block: a local prefix hit
    (res,) = _wait_load(dec)
    assert res.ok and res.req_id == "r"
    assert torch.equal(dst[:, :, :, [1, 7]], src[:, :, :, [6, 2]])
    assert dst[:, :, :, 0].abs().sum() == 0
    tot = dec.totals["shm"]
    assert tot.bytes == 2 * LAYOUT.bytes_per_block and tot.transfers == 1
    assert pre.post_release(remote.transfer_id, True)
    free, _ = pre.poll()
    assert free == ["r"] and pre.num_held == 0


def test_int8_load_is_close_and_moves_fewer_bytes() -> None:
    pre, dec, src, dst = _pair(compression="int8")
    src.copy_(torch.randn_like(src))
    remote = pre.hold("r", [3, 4], 8, 1, None)
    assert remote.compression == "int8"
    dec.start_load("r", remote, [0, 1], 0)
    (res,) = _wait_load(dec)
    assert res.ok
    err = (dst[:, :, :, [0, 1]] - src[:, :, :, [3, 4]]).abs().max()
    assert err <= src.abs().max() / 127
    assert dst[:, :, :, 2:].abs().sum() == 0
    data, scales = staging_layouts(LAYOUT)
    # int8 values + float16 scales (per channel for K, per token for V), for 2 blocks
    assert dec.totals["shm"].bytes == 2 * (data.bytes_per_block + scales.bytes_per_block)
    assert dec.totals["shm"].bytes < 2 * LAYOUT.bytes_per_block / 2


def test_held_blocks_expire() -> None:
    pre, _, _, _ = _pair(timeout_s=0.05)
    remote = pre.hold("r", [1], 4, 1, None)
    deadline = time.monotonic() + 5
    free: list[str] = []
    while not free and time.monotonic() < deadline:
        free, _ = pre.poll()
    assert free == ["r"] and pre.published("r") is None
    assert not pre.post_release(remote.transfer_id, True)    # too late: not held
