"""The adapter's forwards equal the model's own step-by-step decoding: a prompt prefill then a chain of codes in
one forward, a ragged batch (rows with different prompt lengths and padding), a two-branch tree (each branch
equals that branch alone; negative control: the same nodes under a causal mask differ), and rows whose caches
hold different lengths. Float32 models; references: HF's DynamicCache one token per forward (hf_models.py)."""
import pytest
import torch

from hf_models import emu3_prompt, janus_prompt, left_padded, model, reference_logits, wrap
from lantern import ops
from lantern.hf.adapter import MASKED

KINDS = ["janus", "chameleon", "emu3"]
TOL = dict(rtol=1e-4, atol=1e-4)


def prompts(kind, m):
    texts = [[5, 6, 7], [9, 10], [11, 12, 13, 14, 15]]
    if kind == "janus":
        return janus_prompt(texts)
    if kind == "emu3":
        return emu3_prompt(m, texts)
    return left_padded([[1, *t] for t in texts])  # chameleon: the adapter forces <racm3:break> after it


def prefilled(kind, codes_per_row: int, n_rows: int = 3):
    m = model(kind, torch.float32)
    target = wrap(m)
    ids, mask = prompts(kind, m)
    ids, mask = ids[:n_rows], mask[:n_rows]
    cond = target.encode_prompt(ids, mask)
    view = target.for_prompt(cond)
    view.setup_cache(n_rows, view.config.cond_len + codes_per_row + 8)
    zero = torch.zeros(n_rows, dtype=torch.int64)
    first = view(None, cond, cache_len=zero)
    return m, view, ids, mask, first


def real_prompt(kind, view, ids, mask, b):
    """Row b's prompt as the model sees it: its real tokens, then the forced prefix."""
    row = ids[b][mask[b].bool()]
    if kind == "chameleon":
        row = torch.cat([row, torch.tensor([1])])  # <racm3:break>
    return row


def allowed(logits):
    return logits != MASKED


@pytest.mark.parametrize("kind", KINDS)
def test_chain_forward_equals_step_by_step_decoding(kind):
    n = 7
    m, view, ids, mask, first = prefilled(kind, n)
    V = view.config.vocab_size
    torch.manual_seed(1)
    codes = torch.randint(0, view.rules.n_codes, (3, n))
    if view.config.row_end:  # the row ends where they belong
        W1 = view.config.width + 1
        codes[:, torch.arange(n) % W1 == W1 - 1] = V - 1
    logits = view(codes, cache_len=view.cond_keys.clone())  # [3, n, V]
    for b in range(3):
        ref = reference_logits(m, real_prompt(kind, view, ids, mask, b), codes[b])  # [n + 1, V]
        got = torch.cat([first[b], logits[b]]).double()
        keep = allowed(got)
        assert keep.any(1).all()
        torch.testing.assert_close(got[keep], ref[keep], **TOL)


def test_row_ends_are_forced_by_the_mask():
    """Emu3: at a row end only the end-of-row token has a finite logit; elsewhere every code and not it."""
    n = 9
    m, view, ids, mask, first = prefilled("emu3", n)
    V, W1 = view.config.vocab_size, view.config.width + 1
    codes = torch.zeros(3, n, dtype=torch.int64)
    codes[:, torch.arange(n) % W1 == W1 - 1] = V - 1
    logits = torch.cat([first, view(codes, cache_len=view.cond_keys.clone())], 1)  # predicts 0..n
    for p in range(n + 1):
        ok = allowed(logits[:, p])  # [3, V]
        if p % W1 == W1 - 1:
            assert ok[:, V - 1].all() and not ok[:, : V - 1].any()
        else:
            assert ok[:, : V - 1].all() and not ok[:, V - 1].any()


def test_one_node_steps_force_the_row_ends_as_a_chain_does():
    """Emu3's AR steps (one node per row; the rows' raster positions come with the forward's host read) give the
    chain forward's logits, row-end masks included: rows at the same raster position (every row predicting a
    code, or every row a row end), and rows at different positions in one step (one predicting a row end, one a
    code, one at a row end itself)."""
    n = 9
    m, view, ids, mask, first = prefilled("emu3", n)
    V, W1 = view.config.vocab_size, view.config.width + 1
    torch.manual_seed(4)
    codes = torch.randint(0, view.rules.n_codes, (3, n))
    codes[:, torch.arange(n) % W1 == W1 - 1] = V - 1
    committed = view.cond_keys.clone()
    chain = view(codes, cache_len=committed)  # [3, n, V] predicts positions 1..n
    steps = torch.cat([view(codes[:, p: p + 1], cache_len=committed + p) for p in range(n)], 1)
    torch.testing.assert_close(steps, chain, rtol=1e-5, atol=1e-5)
    at = torch.tensor([W1 - 2, W1 - 3, W1 - 1])  # each row's node: predicts a row end, a code, a code
    mixed = view(codes.gather(1, at[:, None]), cache_len=committed + at)  # [3, 1, V]
    torch.testing.assert_close(mixed[:, 0], chain[torch.arange(3), at], rtol=1e-5, atol=1e-5)
    assert allowed(mixed[0, 0]).tolist() == [False] * (V - 1) + [True]  # the row end alone
    assert allowed(mixed[1:, 0]).tolist() == [[True] * (V - 1) + [False]] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_tree_forward_equals_each_branch_and_a_causal_mask_does_not(kind):
    """Nodes: root, a1, a2 (branch a), b1, b2 (branch b). Rows 0 and 1 differ in prompt and branches."""
    m, view, ids, mask, first = prefilled(kind, 8, n_rows=2)
    torch.manual_seed(2)
    n_codes = view.rules.n_codes
    tokens = torch.randint(0, n_codes, (2, 5))
    parents = torch.tensor([[-1, 0, 1, 0, 3]] * 2)
    depth = torch.tensor([[0, 1, 2, 1, 2]] * 2)
    cache_len = view.cond_keys.clone()
    positions = depth  # raster positions 0, 1, 2
    tree = view(tokens, cache_len=cache_len, positions=positions, tree_mask=ops.ancestor_mask(parents))
    causal = view(tokens, cache_len=cache_len, positions=positions)
    for b in range(2):
        prompt = real_prompt(kind, view, ids, mask, b)
        for branch in ([0, 1, 2], [0, 3, 4]):
            ref = reference_logits(m, prompt, tokens[b, branch])[1:]  # predicts after each node
            got = tree[b, branch].double()
            keep = allowed(got)
            torch.testing.assert_close(got[keep], ref[keep], **TOL)
        ref_b = reference_logits(m, prompt, tokens[b, [0, 3, 4]])[1:]
        got = causal[b, [3, 4]].double()
        assert (got - ref_b[1:])[allowed(got)].abs().max() > 1e-3  # b1, b2 saw a1, a2


@pytest.mark.parametrize("kind", ["janus", "emu3"])
def test_rows_with_different_cache_lengths(kind):
    """Row 0 commits 1 code, row 1 commits 4 (a ragged verify step), then both decode one more chain: each
    equals its own step-by-step decoding."""
    m, view, ids, mask, first = prefilled(kind, 10, n_rows=2)
    torch.manual_seed(3)
    codes = torch.randint(0, view.rules.n_codes, (2, 6))
    cache_len = view.cond_keys.clone()
    view(codes[:, :4], cache_len=cache_len)
    kept = torch.tensor([1, 4])
    cache_len = cache_len + kept  # the K/V past each row's kept prefix is overwritten by the next forward
    nxt = torch.stack([codes[0, 1:3], codes[1, 4:6]])  # row 0 continues at position 1, row 1 at 4
    positions = kept[:, None] + torch.arange(2)
    logits = view(nxt, cache_len=cache_len, positions=positions)
    for b in range(2):
        prefix = torch.cat([codes[b, : kept[b]], nxt[b]])
        ref = reference_logits(m, real_prompt(kind, view, ids, mask, b), prefix)[-2:]
        got = logits[b].double()
        keep = allowed(got)
        torch.testing.assert_close(got[keep], ref[keep], **TOL)


@pytest.mark.parametrize("kind,backend", [("janus", "reference"), ("janus", "cpu"), ("chameleon", "reference"),
                                          ("emu3", "cpu")])
def test_lantern_tree_attention_equals_the_models_attention(kind, backend):
    """wrap(attention="lantern"): the tree forward's attention through ops.tree_attention (the reference op, and
    the fused CPU kernel) gives the logits of the model's own attention under the 4D mask; the op ran (a spy
    counts its calls) and the model's attention setting is restored after the forward."""
    import lantern

    m = model(kind, torch.float32)
    ids, mask = prompts(kind, m)
    torch.manual_seed(5)
    tokens = torch.randint(0, 40, (3, 5))
    parents = torch.tensor([[-1, 0, 1, 0, 3]] * 3)
    depth = torch.tensor([[0, 1, 2, 1, 2]] * 3)
    out = {}
    calls = []
    original = ops.tree_attention
    for attention in ("model", "lantern"):
        target = wrap(m, attention=attention)
        cond = target.encode_prompt(ids, mask)
        view = target.for_prompt(cond)
        view.setup_cache(3, view.config.cond_len + 12)
        view(None, cond, cache_len=torch.zeros(3, dtype=torch.int64))
        with lantern.fused(backend):
            try:
                ops.tree_attention = lambda *a: calls.append(1) or original(*a)
                out[attention] = view(tokens, cache_len=view.cond_keys.clone() + torch.tensor([0, 2, 1]),
                                      positions=depth, tree_mask=ops.ancestor_mask(parents))
            finally:
                ops.tree_attention = original
    assert len(calls) == m.config.get_text_config().num_hidden_layers  # the lantern forward only
    torch.testing.assert_close(out["lantern"], out["model"], **TOL)
    assert target.rules.decoder.config._attn_implementation == "sdpa"
