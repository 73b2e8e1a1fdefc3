"""The cached forward (prefill, AR steps, chain/tree verification, ragged rows, compact_kv) equals the
no-cache full-sequence forward; CFG by doubled batch; class dropout; t2i."""
import pytest
import torch

import lantern
from gpt_testing import small_gpt
from lantern.guidance import guide_halves
from lantern.models import double_for_cfg

ATOL = 1e-4


def zeros(B):
    return torch.zeros(B, dtype=torch.int64)


def chain_mask(B, T):
    parents = torch.arange(-1, T - 1).expand(B, T).contiguous()
    return lantern.ops.ancestor_mask(parents)


@pytest.fixture(scope="module")
def model():
    return small_gpt(0)


@torch.no_grad()
def test_prefill_then_one_token_at_a_time(model):
    B, L = 2, 15
    labels = torch.tensor([1, 4])
    tokens = torch.randint(0, 64, (B, L))
    full, full_hidden = model.forward_full(tokens, labels, return_hidden=True)  # [B, L + 1, V]
    assert full.dtype == torch.float32 and full.shape == (B, L + 1, 64)
    model.setup_cache(B, 1 + 16)
    logits, hidden = model(None, labels, cache_len=zeros(B), return_hidden=True)
    assert logits.shape == (B, 1, 64) and hidden.shape == (B, 1, 64)
    torch.testing.assert_close(logits, full[:, :1], atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden, full_hidden[:, :1], atol=ATOL, rtol=0)
    for t in range(L):
        cache_len = torch.full((B,), 1 + t)
        step, hidden = model(tokens[:, t:t + 1], cache_len=cache_len, return_hidden=True)  # default positions
        torch.testing.assert_close(step[:, 0], full[:, t + 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(hidden[:, 0], full_hidden[:, t + 1], atol=ATOL, rtol=0)
    # logits = output(hidden): hidden is after the final norm
    torch.testing.assert_close(model.output(full_hidden).float(), full, atol=1e-5, rtol=0)


@torch.no_grad()
def test_prefill_with_tokens_and_chunked_chain_steps(model):
    B, L = 2, 15
    labels = torch.tensor([0, 2])
    tokens = torch.randint(0, 64, (B, L))
    full = model.forward_full(tokens, labels)
    model.setup_cache(B, 1 + 16)
    first = model(tokens[:, :4], labels, cache_len=zeros(B))  # [B, 1 + 4, V]
    torch.testing.assert_close(first, full[:, :5], atol=ATOL, rtol=0)
    done = 4
    for T in (3, 5, 1, 2):
        cache_len = torch.full((B,), 1 + done)
        positions = (done + torch.arange(T)).expand(B, T)
        out = model(tokens[:, done:done + T], cache_len=cache_len, positions=positions, tree_mask=chain_mask(B, T))
        torch.testing.assert_close(out, full[:, done + 1:done + T + 1], atol=ATOL, rtol=0)
        done += T
    # the default causal mask is the chain's ancestor mask
    assert torch.equal(model._full_tree_mask(None, 0, 5, B, "cpu"), chain_mask(B, 5))


@torch.no_grad()
def test_condition_prefill_with_a_tree_mask(model):
    B = 2
    labels = torch.tensor([3, 1])
    tokens = torch.randint(0, 64, (B, 4))
    full = model.forward_full(tokens, labels)
    model.setup_cache(B, 17)
    out = model(tokens, labels, cache_len=zeros(B), tree_mask=chain_mask(B, 4))
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)


@torch.no_grad()
def test_ragged_rows(model):
    """Rows with different committed lengths step together; each matches its own full forward."""
    B = 3
    labels = torch.tensor([1, 2, 3])
    tokens = torch.randint(0, 64, (B, 15))
    committed = torch.tensor([6, 2, 9])  # image tokens already in each row's cache
    model.setup_cache(B, 17)
    model(tokens[:, :9], labels, cache_len=zeros(B))  # row b's cache beyond 1 + committed[b] is stale
    cache_len = 1 + committed
    T = 4
    positions = committed[:, None] + torch.arange(T)
    step_tokens = torch.gather(tokens, 1, positions)
    out = model(step_tokens, cache_len=cache_len, positions=positions)
    for b in range(B):
        n = int(committed[b]) + T
        full = model.forward_full(tokens[b:b + 1, :n], labels[b:b + 1])
        torch.testing.assert_close(out[b], full[0, int(committed[b]) + 1:n + 1], atol=ATOL, rtol=0)
    # the default positions give the same answer
    torch.testing.assert_close(model(step_tokens, cache_len=cache_len), out, atol=1e-6, rtol=0)


@torch.no_grad()
def test_tree_verification_then_compact(model):
    """A branching tree: every node's logits equal the full forward along its root path; after
    compact_kv of an accepted path, decoding continues as if that path had been fed as a chain."""
    B = 2
    labels = torch.tensor([4, 0])
    prefix = torch.randint(0, 64, (B, 5))
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4, -1]])  # row 1: node 6 is padding
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3], [0, 1, 2, 3, 1, 2, 0]])
    tree_tokens = torch.randint(0, 64, (B, 7))
    tree_tokens[1, 6] = 0  # padding node: a valid token id, its own bit only
    committed = torch.tensor([5, 3])
    model.setup_cache(B, 17)
    model(prefix, labels, cache_len=zeros(B))
    cache_len = 1 + committed
    positions = committed[:, None] + depth
    out = model(tree_tokens, cache_len=cache_len, positions=positions,
                tree_mask=lantern.ops.ancestor_mask(parents))  # [B, 7, V]

    def path(b, i):
        nodes = []
        while i >= 0:
            nodes.append(i)
            i = int(parents[b, i])
        return nodes[::-1]

    for b in range(B):
        for i in range(7):
            if b == 1 and i == 6:
                continue
            seq = torch.cat([prefix[b, :committed[b]], tree_tokens[b, path(b, i)]])
            full = model.forward_full(seq[None], labels[b:b + 1])
            torch.testing.assert_close(out[b, i], full[0, -1], atol=ATOL, rtol=0)

    # accept root -> 1 -> 3 -> 6 in row 0, root -> 4 -> 5 in row 1
    path_nodes = torch.tensor([[0, 1, 3, 6], [0, 4, 5, -1]])
    n_keep = torch.tensor([4, 3])
    new_len = lantern.ops.compact_kv(model.kv_cache, cache_len, path_nodes, n_keep)
    nxt = torch.randint(0, 64, (B, 1))
    step = model(nxt, cache_len=new_len)
    for b in range(B):
        kept = path_nodes[b, :n_keep[b]]
        seq = torch.cat([prefix[b, :committed[b]], tree_tokens[b, kept], nxt[b]])
        full = model.forward_full(seq[None], labels[b:b + 1])
        torch.testing.assert_close(step[b, 0], full[0, -1], atol=ATOL, rtol=0)


@torch.no_grad()
def test_gqa_variant_matches_full():
    m = small_gpt(3, n_head=4, n_kv_head=2)
    tokens = torch.randint(0, 64, (1, 8))
    labels = torch.tensor([2])
    full = m.forward_full(tokens, labels)
    m.setup_cache(1, 17)
    out = m(tokens, labels, cache_len=zeros(1))
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)
    assert m.kv_cache.shape[3] == 2


@torch.no_grad()
def test_cfg_doubled_batch(model):
    B = 2
    labels = torch.tensor([1, 3])
    doubled = double_for_cfg(model, labels)
    assert doubled.tolist() == [1, 3, 5, 5]  # null class = num_classes
    tokens = torch.randint(0, 64, (B, 6))
    model.setup_cache(2 * B, 17)
    logits = model(torch.cat([tokens, tokens]), doubled, cache_len=zeros(2 * B))  # [2B, 7, V]
    cond = model.forward_full(tokens, labels)
    uncond = model.forward_full(tokens, torch.full((B,), 5))
    for s in (1.0, 3.0, 4.0):
        torch.testing.assert_close(guide_halves(logits, s), uncond + (cond - uncond) * s, atol=5e-4, rtol=0)
    scale = torch.tensor([2.0, 4.0])
    g = guide_halves(logits, scale)
    torch.testing.assert_close(g[1], (uncond + (cond - uncond) * 4.0)[1], atol=5e-4, rtol=0)


@torch.no_grad()
def test_class_dropout_in_training():
    m = small_gpt(4, class_dropout_prob=1.0)
    tokens = torch.randint(0, 64, (2, 5))
    null = m.forward_full(tokens, torch.tensor([5, 5]))
    m.train()
    torch.testing.assert_close(m.forward_full(tokens, torch.tensor([0, 1])), null)
    m.eval()
    assert not torch.allclose(m.forward_full(tokens, torch.tensor([0, 1])), null)
    forced = m.forward_full(tokens, torch.tensor([0, 1]), force_drop_ids=torch.tensor([1, 0]))
    torch.testing.assert_close(forced[0], null[0])
    assert not torch.allclose(forced[1], null[1])
    m.train()
    with torch.enable_grad():
        loss = m.loss(tokens, torch.tensor([0, 1]))
        loss.backward()
    assert loss.ndim == 0 and m.output.weight.grad is not None


@torch.no_grad()
def test_t2i_runs_and_uncond_uses_uncond_embedding():
    m = small_gpt(5, model_type="t2i")  # real caption shape: 120 tokens of 2048-d
    assert m.cond_len == 120
    B = 2
    captions = torch.randn(B, 120, 2048)
    tokens = torch.randint(0, 64, (B, 6))
    full = m.forward_full(tokens, captions)
    m.setup_cache(2 * B, 120 + 16)
    out = m(tokens, captions, cache_len=zeros(B))
    assert out.shape == (B, 7, 64)
    torch.testing.assert_close(out, full, atol=ATOL, rtol=0)
    step = m(tokens[:, :1], cache_len=torch.full((B,), 120 + 6))  # an AR step after the prefill
    full7 = m.forward_full(torch.cat([tokens, tokens[:, :1]], 1), captions)
    torch.testing.assert_close(step[:, 0], full7[:, -1], atol=ATOL, rtol=0)
    # guidance rows: the uncond half is exactly the uncond_embedding caption
    doubled = double_for_cfg(m, captions)
    assert torch.equal(doubled[B:], m.cls_embedding.uncond_embedding.expand(B, -1, -1))
    logits = m(torch.cat([tokens, tokens]), doubled, cache_len=zeros(2 * B))
    uncond = m.forward_full(tokens, m.cls_embedding.uncond_embedding.expand(B, -1, -1).clone())
    torch.testing.assert_close(logits[B:], uncond, atol=ATOL, rtol=0)
    dropped = m.forward_full(tokens, captions, force_drop_ids=torch.ones(B))
    torch.testing.assert_close(dropped, uncond, atol=1e-6, rtol=0)
    assert not torch.allclose(logits[:B], uncond, atol=1e-3)


def test_forward_needs_cache_and_valid_shapes(model):
    model.free_cache()
    with pytest.raises(RuntimeError, match="setup_cache"):
        model(torch.zeros(1, 1, dtype=torch.int64), cache_len=zeros(1))
    model.setup_cache(1, 17)
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(1, 2, dtype=torch.int64), cache_len=torch.tensor([1]),
              positions=torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache_len"):
        model(torch.zeros(1, 2, dtype=torch.int64), cache_len=torch.tensor([16]), positions=torch.tensor([[14, 15]]))
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(1, 2, dtype=torch.int64), cache_len=torch.tensor([1]), positions=torch.tensor([[15, 16]]))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.tensor([[64]]), cache_len=torch.tensor([1]))


@torch.no_grad()
def test_bf16_weights_float32_logits():
    m = small_gpt(6)
    tokens = torch.randint(0, 64, (2, 10))
    labels = torch.tensor([1, 2])
    ref = m.forward_full(tokens, labels)
    m = m.to(torch.bfloat16)
    m.setup_cache(2, 17)
    out = m(tokens, labels, cache_len=zeros(2))
    assert out.dtype == torch.float32 and m.kv_cache.dtype == torch.bfloat16
    assert m.freqs_cis.dtype == torch.float32  # RoPE stays float32
    torch.testing.assert_close(out, ref, atol=0.15, rtol=0)
    torch.testing.assert_close(m.forward_full(tokens, labels), ref, atol=0.15, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_cache_rows_is_index_select_along_the_rows(dtype):
    """The cache rows kept when finished rows leave the batch: in the order given, a new contiguous tensor."""
    from lantern.models.gpt import select_cache_rows

    cache = torch.randn(3, 2, 5, 2, 7, 4).to(dtype)
    for rows in ([0, 2, 3], [4], [3, 1], [0, 1, 2, 3, 4]):
        index = torch.tensor(rows)
        got = select_cache_rows(cache, index)
        assert torch.equal(got, cache.index_select(2, index)) and got.is_contiguous()
        assert got.data_ptr() != cache.data_ptr()
