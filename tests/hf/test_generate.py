"""lantern.generate on wrapped transformers models: greedy AR and greedy SJD equal each model's own image
generation token for token (Janus's generate(generation_mode="image") with its unconditional prompt, on a
left-padded batch too; Emu3's generate with prefix_allowed_tokens_fn and a negative prompt; Chameleon, whose
generate masks image tokens, against its decoder's step-by-step greedy loop over lm_head's image rows);
ragged rows (a batch equals its rows run alone); relaxed runs never put a structure token where a code
belongs nor a code at a row end; SJD takes fewer target forwards than AR; a drafter through the adapter;
the arguments' errors. Float64 models, so that a near tie cannot flip a greedy token between two batch
shapes."""
import pytest
import torch
from hf_models import EMU3_HW, JANUS_BOI, emu3_prompt, janus_prompt, left_padded, model, parts, wrap
from transformers import DynamicCache, GenerationConfig

import lantern
import lantern.hf
from lantern.decoding import SpecConfig, generate_spec

CFG = 2.0


def janus_hf(m, ids, mask, cfg=CFG):
    config = GenerationConfig(do_sample=False, guidance_scale=cfg, bos_token_id=1, pad_token_id=0,
                              generation_kwargs={"boi_token_id": JANUS_BOI})
    return m.generate(ids, attention_mask=mask, generation_config=config, generation_mode="image")


@pytest.mark.parametrize("texts", [[[5, 6, 7], [9, 10, 11]], [[5, 6, 7], [9], [12, 13, 14, 15, 16]]],
                         ids=["even", "left-padded"])
@pytest.mark.parametrize("method,options", [("ar", {}), ("sjd", dict(tree="chain", window=3)),
                                            ("sjd", dict(tree="chain", window=8, init="sample"))])
def test_janus_greedy_equals_its_own_image_generation(texts, method, options):
    m = model("janus")
    ids, mask = janus_prompt(texts)
    expected = janus_hf(m, ids, mask)
    codes, _ = lantern.generate(wrap(m), ids, attention_mask=mask, method=method, cfg_scale=CFG, temperature=0,
                                **options)
    assert codes.tolist() == expected.tolist()


def emu3_hf(m, ids, mask, cfg, negative=None):
    H, W = EMU3_HW
    vm = m.config.vocabulary_map
    eol, eof, wrapper = vm["<|extra_200|>"], vm["<|extra_201|>"], vm["<|image token|>"]
    visual = m.model.vocabulary_mapping.image_tokens

    def allowed(batch_id, seq):  # the rule of Emu3's documentation
        offset = seq.shape[0] - torch.nonzero(seq == wrapper)[0, 0]
        if offset % (W + 1) == 0:
            return (eol,)
        return (eof,) if offset == (W + 1) * H + 1 else visual

    kwargs = {}
    if cfg != 1:
        kwargs = dict(guidance_scale=cfg)
        if negative is not None:
            kwargs.update(negative_prompt_ids=negative[0], negative_prompt_attention_mask=negative[1])
    out = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=H * (W + 1),
                     prefix_allowed_tokens_fn=allowed, pad_token_id=0, **kwargs)
    seq = out[:, ids.shape[1]:].view(-1, H, W + 1)
    assert (seq[:, :, W] == eol).all()
    return m.model.vocabulary_mapping.convert_bpe2img(seq).reshape(ids.shape[0], -1)


@pytest.mark.parametrize("cfg,negative", [(1.0, False), (3.0, True), (3.0, False)],
                         ids=["unguided", "negative-prompt", "last-token-uncond"])
@pytest.mark.parametrize("method,options", [("ar", {}), ("sjd", dict(tree="chain", window=4))])
def test_emu3_greedy_equals_its_own_image_generation(cfg, negative, method, options):
    m = model("emu3")
    ids, mask = emu3_prompt(m, [[5, 6], [11, 12, 13]])
    neg = left_padded([[1, 3, 4], [1, 20, 21]]) if negative else None
    expected = emu3_hf(m, ids, mask, cfg, neg)
    kwargs = dict(negative_prompt_ids=neg[0], negative_prompt_attention_mask=neg[1]) if negative else {}
    codes, _ = lantern.generate(wrap(m), ids, attention_mask=mask, method=method, cfg_scale=cfg, temperature=0,
                                **options, **kwargs)
    assert codes.tolist() == expected.tolist()


@torch.no_grad()
def chameleon_greedy(m, prompt, n):
    """Chameleon's decoder one token per forward (HF's DynamicCache), greedy over lm_head's image rows, after
    <racm3:break>."""
    decoder, embed_text, embed_codes, head = parts(m)
    cache = DynamicCache(config=decoder.config)
    x = embed_text(torch.cat([prompt, torch.tensor([1])])[None])
    codes = []
    for _ in range(n):
        hidden = decoder(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state[:, -1]
        codes.append(int(head(hidden).argmax()))
        x = embed_codes(torch.tensor([[codes[-1]]]))
    return codes


@pytest.mark.parametrize("method,options", [("ar", {}), ("sjd", dict(tree="chain", window=5))])
def test_chameleon_greedy_equals_its_step_by_step_decoding(method, options):
    m = model("chameleon")
    ids, mask = left_padded([[3, 5, 6, 7], [3, 9]])
    codes, _ = lantern.generate(wrap(m), ids, attention_mask=mask, method=method, temperature=0, length=10,
                                **options)
    for b in range(2):
        assert codes[b].tolist() == chameleon_greedy(m, ids[b][mask[b].bool()], 10)


def test_chameleon_prompt_ending_in_begin_of_image_gets_no_second_one():
    m = model("chameleon")
    target = wrap(m)
    plain = target.encode_prompt(torch.tensor([[3, 5]]))[0]
    ending = target.encode_prompt(torch.tensor([[3, 5, 1]]))[0]

    def tokens(enc):  # (id, position) of each token, and image token 0's position
        return [tuple(c) for c in enc[:, 1:].T.tolist() if c[0] >= 0], int(enc[1, 0])

    assert tokens(plain) == tokens(ending) == ([(3, 0), (5, 1), (1, 2)], 3)  # <racm3:break> forced once


@pytest.mark.parametrize("kind", ["janus", "emu3"])
def test_a_ragged_batch_equals_its_rows_run_alone(kind):
    """Sampled SJD with a fixed window: prompts of different lengths, rows accepting different numbers of
    drafts per step; with image_ids each row's codes depend on its id and the settings only."""
    m = model(kind)
    texts = [[5, 6, 7], [9], [12, 13, 14, 15]]
    ids, mask = janus_prompt(texts) if kind == "janus" else emu3_prompt(m, texts)
    options = dict(method="sjd", tree="chain", window=4, cfg_scale=CFG, temperature=1.0, seed=7)
    target = wrap(m)
    batch, stats = lantern.generate(target, ids, attention_mask=mask, image_ids=torch.arange(3), **options)
    assert len({tuple(a.tolist()) for a in stats.accept_lens if len(a) == 3}) > 1  # ragged acceptance
    for b in range(3):
        alone, _ = lantern.generate(target, ids[b:b + 1][:, mask[b].bool()], image_ids=torch.tensor([b]),
                                    **options)
        assert alone[0].tolist() == batch[b].tolist()


@pytest.mark.parametrize("kind,lumina", [("emu3", False), ("chameleon", True)], ids=["emu3", "lumina-mgpt"])
def test_relaxed_runs_keep_row_ends_and_codes_in_place(kind, lumina):
    """The loop's raw sequences of relaxed SJD (δ = 0.9, so relaxation accepts often): a row end exactly
    at every row end, a code everywhere else. Negative control: without the structure mask the same runs
    put row ends and codes out of place."""
    m = model(kind)
    if lumina:  # Lumina-mGPT at 96 x 128 pixels: size tokens <reserved08803>, <reserved08804>
        options = lantern.hf.lumina_mgpt_options(m, 96, 128)
        assert options == dict(image_size=(6, 8), image_prefix=(1, 7, 8), row_end_token=4)
        options["image_size"] = (3, 4)  # a shorter image, the same layout
    else:
        options = dict(image_size=(3, 4))
    target = wrap(m, **options)
    ids = torch.tensor([[1, 5, 6, 7]] * 8)
    cond = target.encode_prompt(ids, guided=True)
    view = target.for_prompt(cond)
    table = view.neighbour_table(6)
    V, W1 = view.config.vocab_size, view.config.width + 1
    row_end = torch.arange(view.config.block_size) % W1 == W1 - 1

    def run():
        config = SpecConfig(method="sjd", tree="chain", window=6, k=6, delta=0.9)
        out, _ = generate_spec(view, None, cond, table, config=config, cfg_scale=CFG, seed=3)
        return out

    out = run()
    assert (out[:, row_end] == V - 1).all() and (out[:, ~row_end] < V - 1).all()
    assert target.image_codes(out).shape == (8, 12)

    view._structure = lambda logits, positions: logits  # negative control: no structure mask
    bad = run()
    assert not ((bad[:, row_end] == V - 1).all() and (bad[:, ~row_end] < V - 1).all())


def test_sjd_takes_fewer_target_forwards_than_ar_at_batch_4(capsys):
    """Sampled SJD (temperature 1, exact) on a tiny random Janus of 8 x 8 codes, batch 4."""
    m = model("janus", torch.float32, side=8)
    ids, mask = janus_prompt([[5, 6, 7], [9, 10], [11], [12, 13, 14]])
    target = wrap(m)
    _, stats = lantern.generate(target, ids, attention_mask=mask, method="sjd", tree="chain", window=8,
                                cfg_scale=CFG, seed=0)
    ar_forwards = 64  # a prefill and one forward per code after the first
    with capsys.disabled():
        print(f"\n[hf] tiny Janus 8x8 batch 4, sjd window 8: tau {stats.tau:.2f}, "
              f"{stats.target_forwards} target forwards vs AR {ar_forwards}")
    assert stats.target_forwards < ar_forwards and stats.tau > 1.0


def test_a_drafter_drafts_through_the_adapter():
    """An EAGLE head bound to the wrapped Janus (its image embedding and generation head): greedy exact
    speculative decoding equals greedy AR, whatever the (random) drafter proposes."""
    from lantern.models.drafter import EagleDrafter
    from lantern.models.gpt import GPTConfig

    m = model("janus")
    target = wrap(m)
    D = m.config.text_config.hidden_size
    drafter = EagleDrafter(GPTConfig(n_layer=1, n_head=4, dim=D, vocab_size=48, block_size=16)).double()
    drafter.bind(target)
    ids, mask = janus_prompt([[5, 6, 7], [9]])
    ar, _ = lantern.generate(target, ids, attention_mask=mask, method="ar", cfg_scale=CFG, temperature=0)
    spec, stats = lantern.generate(target, ids, attention_mask=mask, method="spec", drafter=drafter,
                                   tree="chain", depth=3, cfg_scale=CFG, temperature=0)
    assert spec.tolist() == ar.tolist() and stats.draft_forwards > 0


@pytest.mark.parametrize("call,match", [
    (lambda t: lantern.generate(t, torch.tensor([1.0, 2.0]), method="ar"), "input_ids"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1]]), method="ar"),
     "attention_mask"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), attention_mask=torch.tensor([[0, 0]]), method="ar"),
     "at least one token"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), method="beam"), "method"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), method="ar", length=99), "length"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), method="spec", neighbours=torch.zeros(48, 2)),
     "exact"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), method="sjd", cfg_scale=2.0,
                                negative_prompt_ids=torch.tensor([[1]])), "negative_prompt_ids"),
    (lambda t: lantern.generate(t, torch.tensor([[1, 2]]), method="lantern", neighbours=torch.zeros(7, 2)),
     "neighbours"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(wrap(model("janus")))


def test_wrap_names_what_it_needs():
    import lantern.hf

    with pytest.raises(ValueError, match="image_size"):
        lantern.hf.wrap(model("emu3"))
    with pytest.raises(ValueError, match="supports"):
        lantern.hf.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="boi_token_id"):
        lantern.hf.wrap(model("janus"), bos_token_id=1, pad_token_id=0)
