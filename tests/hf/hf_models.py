"""Tiny random transformers models (no download) and their own step-by-step decoding, the references of
tests/hf: ``reference_logits`` runs the model's decoder one token at a time with HF's DynamicCache and scores
the image codes as the model's own generation does."""
from __future__ import annotations

from functools import lru_cache

import torch
from transformers import DynamicCache

import lantern.hf
from lantern.hf.random_models import janus_tokens, random_model

JANUS_BOI = 62  # tiny janus: vocab 64, BOI = vocab - 2
EMU3_HW = (3, 4)


@lru_cache(maxsize=None)
def model(kind: str, dtype=torch.float64, **overrides):
    return random_model(kind, dtype=dtype, **overrides)


def wrap(m, **kwargs):
    if type(m).__name__.startswith("Janus"):
        kwargs = {**janus_tokens(m.config), **kwargs}
    if type(m).__name__.startswith("Emu3"):
        kwargs = {"image_size": EMU3_HW, **kwargs}
    return lantern.hf.wrap(m, **kwargs)


def emu3_prompt(m, texts):
    """Emu3's generation prompt: BOS, the text, <|image start|> H * W <|image token|> (left-padded)."""
    vm = m.config.vocabulary_map
    suffix = [vm["<|image start|>"], 7, 8, 9, vm["<|image token|>"]]
    return left_padded([[1, *t, *suffix] for t in texts])


def janus_prompt(texts):
    return left_padded([[1, *t, JANUS_BOI] for t in texts])


def left_padded(rows, pad: int = 0):
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def parts(m):
    """(decoder, embed prompt ids, embed image codes, score hidden states -> code logits) of the model's own
    image generation."""
    name = type(m).__name__
    if name.startswith("Janus"):
        lm = m.model.language_model
        return lm, lm.embed_tokens, m.prepare_embeddings_for_image_generation, m.model.generation_head
    mapping = m.model.vocabulary_mapping
    bpe = torch.tensor([mapping.img2bpe[c] for c in range(len(mapping.img2bpe))])
    decoder = m.model.text_model if name.startswith("Emu3") else m.model
    eol = getattr(mapping, "eol_token_id", None)
    if eol is not None:
        bpe = torch.cat([bpe, torch.tensor([eol])])
    return (decoder, decoder.embed_tokens, lambda codes: decoder.embed_tokens(bpe[codes]),
            lambda h: m.lm_head(h)[..., bpe])


@torch.no_grad()
def reference_logits(m, ids, codes):
    """One prompt ids [P] and codes [n] -> the code logits [n + 1, V] predicting codes 0..n (float64), one
    token per forward through HF's DynamicCache and positions 0, 1, ..."""
    decoder, embed_text, embed_codes, head = parts(m)
    cache = DynamicCache(config=decoder.config)
    out = decoder(inputs_embeds=embed_text(ids[None]), cache=cache, use_cache=True)
    rows = [head(out.last_hidden_state[:, -1])]
    for c in codes:
        out = decoder(inputs_embeds=embed_codes(c.view(1, 1)), cache=cache, use_cache=True)
        rows.append(head(out.last_hidden_state[:, -1]))
    return torch.cat(rows).double()


WORDS = ["a", "red", "cat", "on", "blue", "mat", "dog"]
JANUS_BOI_TOKEN = "<begin_of_image>"


def tiny_processor():
    """A Janus processor over a word-level tokenizer of WORDS, built in-process (the tiny Janus's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import JanusImageProcessor, JanusProcessor, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<end_of_image>": 61, JANUS_BOI_TOKEN: JANUS_BOI,
             "<image_placeholder>": 63, **{w: 3 + i for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image_placeholder>",
                                                         "boi_token": JANUS_BOI_TOKEN, "eoi_token": "<end_of_image>"})
    return JanusProcessor(image_processor=JanusImageProcessor(), tokenizer=fast, num_image_tokens=16)


def save_janus_dir(directory) -> None:
    """The tiny float32 Janus, its generation config and tiny_processor() saved as a model directory."""
    from transformers import GenerationConfig

    m = model("janus", torch.float32)
    m.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0,
                                           generation_kwargs={"boi_token_id": JANUS_BOI})
    m.save_pretrained(directory)
    tiny_processor().save_pretrained(directory)


EMU3_SPECIAL = {"image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
                "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"}
# Emu3Processor's generation size is a class attribute (ratio, image_area: 720 x 720 pixels, 90 x 90 tokens), which
# save_pretrained does not keep: the tests set it to EMU3_HW's (image_area = 8 * 8 pixels per token)
EMU3_GENERATION_SIZE = dict(ratio=f"{EMU3_HW[1]}:{EMU3_HW[0]}", image_area=64 * EMU3_HW[0] * EMU3_HW[1])


def tiny_emu3_processor():
    """An Emu3 processor over a word-level tokenizer of WORDS, the digits and "*" (its prompt's "H*W"), built
    in-process; its special tokens have the tiny Emu3's ids (random_models.emu3_config's vocabulary map), and it
    pads on the left, as Emu3's tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Emu3ImageProcessor, Emu3Processor, PreTrainedTokenizerFast

    from lantern.hf.random_models import emu3_config

    vocabulary_map = emu3_config().vocabulary_map
    text = ["<pad>", "<bos>", "<eos>", *WORDS, *"0123456789", "*", "<|image end|>"]  # text ids 0, 1, ...
    vocab = {token: i for i, token in enumerate(text)}
    vocab.update({token: vocabulary_map[token] for token in EMU3_SPECIAL.values() if token in vocabulary_map})
    vocab["<|extra_200|>"] = vocabulary_map["<|extra_200|>"]
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   padding_side="left", extra_special_tokens=EMU3_SPECIAL)
    return Emu3Processor(image_processor=Emu3ImageProcessor(), tokenizer=fast)


def save_emu3_dir(directory) -> None:
    """The tiny float32 Emu3 and tiny_emu3_processor() saved as a model directory."""
    model("emu3", torch.float32).save_pretrained(directory)
    tiny_emu3_processor().save_pretrained(directory)
