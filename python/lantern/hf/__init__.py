"""Bring your own model: lantern's decoding loops (AR, Jacobi self-drafting, relaxed acceptance, drafted trees)
for the image-generating models of Hugging Face transformers. Needs the optional extra
``pip install 'lantern[hf]'``; docs/hf.md.

    target = lantern.hf.wrap(model)                       # a JanusForConditionalGeneration, Emu3..., Chameleon...
    codes, stats = lantern.generate(target, input_ids, attention_mask=mask, method="sjd", cfg_scale=5.0)
    images = target.decode_images(codes)                  # through the model's own VQ decoder
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from ..decoding.target import Target, TargetConfig

__all__ = ["wrap", "generate", "lumina_mgpt_options", "Target", "TargetConfig", "HFTarget", "NotTraceable"]


def wrap(model, *, image_size: Optional[Tuple[int, int]] = None, bos_token_id: Optional[int] = None,
         boi_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
         image_prefix: Optional[Sequence[int]] = None, row_end_token: Optional[int] = None,
         attention: str = "model"):
    """A transformers model -> ``HFTarget``, a target for ``lantern.generate`` (``Target`` protocol).

    - ``JanusForConditionalGeneration``: image_size from its vision config (num_image_tokens, a square);
      bos / boi / pad token ids from its generation config (``generation_kwargs["boi_token_id"]``) unless given.
    - ``Emu3ForConditionalGeneration``: image_size=(height, width) in tokens is required (the processor's
      ``image_sizes`` of ``return_for_image_generation=True``).
    - ``ChameleonForConditionalGeneration``: image_size default 32 x 32 (1024 tokens); ``image_prefix`` the
      tokens forced after the prompt (default: the begin-of-image token ``<racm3:break>``; Lumina-mGPT: that
      token and its two size tokens); ``row_end_token``: Lumina-mGPT's end-of-row token id (default none).

    Wrap the model after moving it to its device and dtype (Chameleon and Emu3 copy the image rows of
    ``lm_head``). The model's attention must be "sdpa" or "eager". attention="lantern" runs the tree forwards'
    attention through ``lantern.ops.tree_attention`` (the fused kernels of ``lantern.enable_fused``) instead of
    the model's own under a dense mask (needs the 1/sqrt(head_dim) scale of these models)."""
    import transformers

    from .adapter import HFTarget
    from .families import ChameleonFamily, Emu3Family, JanusFamily, square_side

    model.eval()
    if isinstance(model, transformers.JanusForConditionalGeneration):
        rules = JanusFamily(model, *_janus_tokens(model, bos_token_id, boi_token_id, pad_token_id))
        n = model.config.vision_config.num_image_tokens
        side = square_side(n, "num_image_tokens")
        height, width = image_size or (side, side)
        if height * width != n:
            raise ValueError(f"image_size {image_size} must hold Janus's num_image_tokens = {n}")
    elif isinstance(model, transformers.Emu3ForConditionalGeneration):
        if image_size is None:
            raise ValueError("Emu3 needs image_size=(height, width) in tokens (the processor's image_sizes)")
        rules = Emu3Family(model)
        height, width = image_size
    elif isinstance(model, transformers.ChameleonForConditionalGeneration):
        if image_prefix is None:
            boi = model.config.vocabulary_map.get("<racm3:break>")
            if boi is None:
                raise ValueError("the vocabulary has no <racm3:break> (begin of image): pass image_prefix")
            image_prefix = (boi,)
        rules = ChameleonFamily(model, image_prefix, row_end_token)
        height, width = image_size or (32, 32)
    else:
        raise ValueError(f"lantern.hf.wrap supports JanusForConditionalGeneration, Emu3ForConditionalGeneration and "
                         f"ChameleonForConditionalGeneration, got {type(model).__name__}")
    if row_end_token is not None and not isinstance(model, transformers.ChameleonForConditionalGeneration):
        raise ValueError("row_end_token applies to Chameleon-architecture models (Lumina-mGPT)")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in (height, width)):
        raise ValueError(f"image_size must be two ints >= 1 (tokens per column and row), got {image_size!r}")
    return HFTarget(rules, height, width, attention)


def lumina_mgpt_options(model, height: int, width: int) -> dict:
    """``wrap``'s options for a Lumina-mGPT checkpoint (Chameleon architecture) generating a height x width pixel
    image (multiples of 32): its item processor's layout, <racm3:break>, then the size tokens
    <reserved{8800 + height / 32}> and <reserved{8800 + width / 32}>, then 2 height / 32 rows of 2 width / 32 codes,
    each row followed by <reserved08799>. Token ids are looked up by name in the model's vocabulary."""
    if height % 32 or width % 32 or height < 32 or width < 32:
        raise ValueError(f"Lumina-mGPT images are multiples of 32 pixels, got {height} x {width}")
    vocab = model.config.vocabulary_map
    names = ["<racm3:break>", f"<reserved{8800 + height // 32:05d}>", f"<reserved{8800 + width // 32:05d}>",
             "<reserved08799>"]
    missing = [n for n in names if n not in vocab]
    if missing:
        raise ValueError(f"the vocabulary lacks Lumina-mGPT's tokens {missing}")
    ids = [vocab[n] for n in names]
    return dict(image_size=(height // 16, width // 16), image_prefix=tuple(ids[:3]), row_end_token=ids[3])


def _janus_tokens(model, bos, boi, pad):
    gen = model.generation_config
    bos = gen.bos_token_id if bos is None else bos
    pad = gen.pad_token_id if pad is None else pad
    boi = (getattr(gen, "generation_kwargs", None) or {}).get("boi_token_id") if boi is None else boi
    missing = [name for name, v in (("bos_token_id", bos), ("boi_token_id", boi), ("pad_token_id", pad)) if v is None]
    if missing:
        raise ValueError(f"Janus's unconditional prompt needs {', '.join(missing)}: the model's generation config "
                         f"has none; pass them to wrap")
    return bos, boi, pad


def __getattr__(name):
    if name == "HFTarget":
        from .adapter import HFTarget

        return HFTarget
    if name in ("generate", "NotTraceable"):
        import importlib

        module = importlib.import_module(".generate", __name__)
        # importing the submodule bound the package's name "generate" to it: bind the function instead
        globals().update(generate=module.generate, NotTraceable=module.NotTraceable)
        return globals()[name]
    raise AttributeError(name)
