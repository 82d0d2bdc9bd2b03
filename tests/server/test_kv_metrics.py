"""The KV pool in /metrics: kestrel_kv_cache_bytes_total, kestrel_kv_cache_bytes_used and
kestrel_kv_bytes_per_token count what the pool really holds, so an int8 cache (codes and one f32
scale per cached row) shows its smaller footprint next to f32; kestrel_kv_cache_info names the
element type. stories260K: 5 layers, 4 KV heads of 8 dimensions (its README)."""

import pytest

from conftest import Server, kestrel_binary, require, stories_model

N_LAYER, N_HEAD_KV, HEAD_DIM = 5, 4, 8
BLOCKS, BLOCK_SIZE = 64, 16


def bytes_per_token(dtype):
    """K and V rows of every layer and KV head: head_dim elements, plus a 4-byte scale for int8."""
    row = {"f32": 4 * HEAD_DIM, "f16": 2 * HEAD_DIM, "int8": HEAD_DIM + 4}[dtype]
    return 2 * N_LAYER * N_HEAD_KV * row


@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_kv_pool_bytes(dtype):
    require(kestrel_binary())
    require(stories_model())
    s = Server(stories_model(), "--max-model-len", "512", "--num-kv-blocks", str(BLOCKS), "--block-size",
               str(BLOCK_SIZE), "--kv-cache-dtype", dtype, name=f"stories-kv-{dtype}")
    try:
        r = s.post("/v1/completions", {"model": s.name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        m = s.metrics()
        assert m["kestrel_kv_bytes_per_token"] == bytes_per_token(dtype)
        assert m["kestrel_kv_blocks_total"] == BLOCKS
        assert m["kestrel_kv_cache_bytes_total"] == BLOCKS * BLOCK_SIZE * bytes_per_token(dtype)
        assert m["kestrel_kv_cache_bytes_used"] == m["kestrel_kv_blocks_used"] * BLOCK_SIZE * bytes_per_token(dtype)
        assert m[f'kestrel_kv_cache_info{{dtype="{dtype}"}}'] == 1
        assert not any(k.startswith("kestrel_kv_cache_info") and dtype not in k for k in m)
    finally:
        rc, out = s.stop()
    assert rc == 0, out
