"""What each supported transformers class needs from lantern.hf: its decoder, how an image code enters it and
leaves it, its prompts' rules and its codebook. One ``Family`` per class; ``wrap`` picks it.

- Janus / Janus-Pro (``JanusForConditionalGeneration``): image codes have their own vocabulary, embedded by
  ``generation_embeddings`` + ``generation_aligner`` and scored by ``generation_head``. Its
  ``generate(generation_mode="image")`` doubles the batch for guidance with an unconditional prompt that
  replaces every token but BOS and BOI by the pad token, keeps the prompt's attention mask, and passes no
  position ids (so positions count left padding).
- Chameleon / Anole / Lumina-mGPT (``ChameleonForConditionalGeneration``): image codes are BPE ids of the
  text vocabulary. Its forward sets every image logit to the dtype's minimum (text generation), so the
  adapter scores the codes with the image rows of ``lm_head`` itself. The begin-of-image token (and, for
  Lumina-mGPT, its size tokens: ``image_prefix``) is forced after the prompt; Lumina-mGPT's end-of-row token
  (``row_end_token``) after every row. The class holds no VQ decoder.
- Emu3 (``Emu3ForConditionalGeneration``): image codes are BPE ids of the text vocabulary; an end-of-row
  token (``<|extra_200|>``) follows every row; guidance runs a negative prompt (or the prompt's last token)
  in rows of its own, as HF's ``UnbatchedClassifierFreeGuidanceLogitsProcessor``, whose forwards pass no
  position ids.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class Family:
    """The model-specific half of ``HFTarget``. Position rules: "real" (the prompt's real tokens count, as HF's
    ``generate`` derives position ids from the attention mask) or "padded" (every column counts)."""

    name = ""
    cond_positions = "real"
    uncond_positions = "real"
    takes_negative_prompt = True
    normalize_codebook = False
    row_end_id: Optional[int] = None  # the end-of-row token's id in the model's own vocabulary

    def __init__(self, model: nn.Module, decoder: nn.Module, text_config):
        self.model, self.decoder = model, decoder
        self.n_layer = text_config.num_hidden_layers
        self.kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim = getattr(text_config, "head_dim", None) or \
            text_config.hidden_size // text_config.num_attention_heads
        self.attention_implementation = text_config._attn_implementation

    # the image codes ([0, n_codes), and n_codes = the row end where the image has one)
    n_codes: int = 0

    @property
    def embedding_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(ids)

    def decode(self, embeds, mask, position_ids, cache) -> torch.Tensor:
        """The decoder's last hidden states (after its final norm) [R, T, D]."""
        out = self.decoder(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, cache=cache,
                           use_cache=True)
        return out.last_hidden_state

    def forced_prefix(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[B, F] tokens forced after each prompt (-1: none for that row)."""
        return ids.new_empty(ids.shape[0], 0)

    def unconditional_prompt(self, ids, valid) -> Tuple[torch.Tensor, torch.Tensor]:
        """Without a negative prompt: the prompt's last column alone (HF's unbatched guidance)."""
        return ids[:, -1:], torch.ones_like(valid[:, -1:])

    def codebook(self) -> torch.Tensor:
        return self.model.model.vqmodel.quantize.embedding.weight

    def decode_images(self, codes: torch.Tensor, height: int, width: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self.model).__name__} holds no VQ decoder; decode the codes with the "
                                  f"checkpoint's own VQ model")


def _code_map(img2bpe: dict, name: str) -> torch.Tensor:
    """{code: bpe id} -> int64 [n_codes] (codes 0..n-1, each present)."""
    n = len(img2bpe)
    if n == 0 or sorted(img2bpe) != list(range(n)):
        raise ValueError(f"{name}'s vocabulary map must name image codes 0..n-1, got {n} codes "
                         f"{sorted(img2bpe)[:3]}...")
    return torch.tensor([img2bpe[c] for c in range(n)], dtype=torch.int64)


class _BPECodes(Family):
    """Image codes that are BPE ids of the text vocabulary, scored by ``lm_head``'s rows of those ids (a copy of
    those rows, made once: V_img x D)."""

    def __init__(self, model, decoder, text_config, img2bpe: dict, row_end_id: Optional[int]):
        super().__init__(model, decoder, text_config)
        codes = _code_map(img2bpe, type(model).__name__)
        self.n_codes = codes.shape[0]
        self.row_end_id = row_end_id
        if row_end_id is not None:
            codes = torch.cat([codes, torch.tensor([row_end_id])])
        weight = model.lm_head.weight
        self.bpe = codes.to(weight.device)  # [V] the BPE id of each loop id
        self.head = weight.detach()[self.bpe].clone()  # [V, D]
        self.head_bias = None if model.lm_head.bias is None else model.lm_head.bias.detach()[self.bpe].clone()

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.decoder.embed_tokens.weight

    def embed_codes(self, codes):
        return self.decoder.embed_tokens(self.bpe[codes])

    def code_logits(self, hidden):
        return F.linear(hidden, self.head, self.head_bias)


class JanusFamily(Family):
    name = "janus"
    cond_positions = uncond_positions = "padded"
    takes_negative_prompt = False
    normalize_codebook = True  # its VQ decoder L2-normalises the code vectors (get_codebook_entry)

    def __init__(self, model, bos_token_id: int, boi_token_id: int, pad_token_id: int):
        super().__init__(model, model.model.language_model, model.config.text_config)
        self.n_codes = model.config.vq_config.num_embeddings
        self.bos, self.boi, self.pad = bos_token_id, boi_token_id, pad_token_id

    @property
    def embedding_weight(self):
        return self.model.model.generation_embeddings.weight

    def embed_codes(self, codes):
        return self.model.prepare_embeddings_for_image_generation(codes)

    def code_logits(self, hidden):
        return self.model.model.generation_head(hidden)

    def unconditional_prompt(self, ids, valid):
        """Janus's rule: every token but BOS and BOI becomes the pad token; the mask stays the prompt's."""
        keep = (ids == self.bos) | (ids == self.boi)
        return torch.where(keep, ids, self.pad), valid

    def decode_images(self, codes, height, width):
        return self.model.decode_image_tokens(codes).permute(0, 3, 1, 2)


class ChameleonFamily(_BPECodes):
    name = "chameleon"

    def __init__(self, model, image_prefix: Sequence[int], row_end_token: Optional[int]):
        mapping = model.model.vocabulary_mapping
        super().__init__(model, model.model, model.config, mapping.img2bpe, row_end_token)
        self.image_prefix = torch.tensor(list(image_prefix), dtype=torch.int64)

    def forced_prefix(self, ids, valid):
        """``image_prefix`` after each prompt, unless the prompt already ends with it."""
        B, n = ids.shape[0], self.image_prefix.shape[0]
        prefix = self.image_prefix.to(ids.device).expand(B, n)
        if n == 0:
            return prefix
        last = _last_real(ids, valid, n)  # [B, n]
        done = (last == prefix).all(1, keepdim=True)
        return torch.where(done, -1, prefix)


class Emu3Family(_BPECodes):
    name = "emu3"
    uncond_positions = "padded"

    def __init__(self, model):
        mapping = model.model.vocabulary_mapping
        super().__init__(model, model.model.text_model, model.config.text_config, mapping.img2bpe,
                         mapping.eol_token_id)

    def decode_images(self, codes, height, width):
        return self.model.model.vqmodel.decode(codes.view(codes.shape[0], height, width))


def _last_real(ids: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n]: each row's last n real tokens (-1 where the row has fewer)."""
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)
    packed = torch.where(valid, ids, -1).gather(1, order)  # real tokens right-aligned
    return F.pad(packed, (max(n - packed.shape[1], 0), 0), value=-1)[:, -n:]


def square_side(n: int, what: str) -> int:
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"{what} = {n} image tokens is not a square grid; pass image_size=(height, width)")
    return side
