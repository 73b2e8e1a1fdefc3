"""``HFTarget``: a Hugging Face image-generating model as a lantern ``Target`` (``target.py``).

The loop sees image codebook ids [0, V) and raster positions; the adapter turns them into the model's own
inputs (``families.py``: Janus's generation embeddings, Chameleon's and Emu3's BPE ids of the codes), runs
the model's decoder with a per-row cache (``cache.RowCache``) under a 4D mask that says what each tree node
sees, and returns the logits of the image codes (Janus's generation head; the image columns of Chameleon's
and Emu3's ``lm_head``).

Structure tokens. A model whose image has an end-of-row token after every row (Emu3; Lumina-mGPT on
Chameleon) decodes a sequence of H (W + 1) - 1 tokens: raster position p is the row end when
p % (W + 1) == W. The row end is one more id, V_img, in the loop's vocabulary; at a row end the adapter masks
every image code and at an image position it masks the row end, so its probability is exactly 1 where it
belongs and 0 elsewhere: AR and exact speculative decoding force it as the model's own
``prefix_allowed_tokens_fn`` does, a relaxed verify never accepts it in place of a code (its neighbour row
holds itself alone, ``neighbour_table``) nor a code in its place. ``generate`` drops those positions from
the result. The mask value is finite (``MASKED``), so that guidance (uncond + s (cond - uncond)) of two
masked logits stays masked without the -inf - -inf of IEEE arithmetic, in every place the loop guides
logits; exp(MASKED - max) is 0 in float32 and float64.

The prompt ([B, P] ids and a 0/1 mask, as the model's ``generate`` takes them) becomes the loop's condition
tensor through ``encode_prompt``: int64 [B, 2, 1 + W] (guided: [B, 2, 2, 1 + W], the cond and uncond
halves), row 0 the token ids (-1: no token, i.e. padding), row 1 each token's position id; column 0 holds
(-1, the position id of image token 0). The prefill drops the padding's K/V from the cache (as lantern's
t2i caption padding does), so ``cond_keys`` counts the real prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn

from .. import ops
from ..ops.reference.tree import pack_bits
from .cache import TREE_ATTENTION, RowCache, TreeStep, additive, prompt_attention_mask, tree_attention_mask
from .families import Family

MASKED = -1.0e9  # the logit of a token a position cannot hold (see the module docstring)
ATTENTION = ("sdpa", "eager")  # HF attention functions that take the adapter's 4D mask


@dataclass(frozen=True)
class HFConfig:
    """The ``TargetConfig`` of a wrapped model (``cond_len`` is set per prompt by ``for_prompt``)."""
    block_size: int  # sequence positions of one image: H W, or H (W + 1) - 1 with row ends
    vocab_size: int  # image codes, plus the row end when the image has one
    cond_len: int = 0
    model_type: str = "t2i"  # the condition is a prompt tensor, not class ids
    num_classes: int = 0
    height: int = 0  # image tokens per column and row
    width: int = 0
    row_end: bool = False  # a forced end-of-row token after every row
    family: str = ""


class _ImageEmbedding(nn.Module):
    """codes [..] -> the decoder's input embeddings (the row end id V_img: its token's embedding). ``weight``:
    the underlying table (the loops read the device from it)."""

    def __init__(self, rules: Family):
        super().__init__()
        self.rules = rules

    @property
    def weight(self) -> torch.Tensor:
        return self.rules.embedding_weight

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rules.embed_codes(codes)


class _ImageHead(nn.Module):
    """hidden [.., D] -> logits of the codes (and of the row end) [.., V] float32, before the structure mask."""

    def __init__(self, rules: Family):
        super().__init__()
        self.rules = rules

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rules.code_logits(hidden).float()


class HFTarget:
    """A transformers model wrapped for lantern's loops (build it with ``lantern.hf.wrap``). ``rules`` holds
    the model-specific rules; ``height`` x ``width`` the image's token grid."""

    family = "hf"  # lantern.generate sends a target of this family to lantern.hf.generate

    def __init__(self, rules: Family, height: int, width: int, attention: str = "model"):
        if attention not in ("model", "lantern"):
            raise ValueError(f"attention must be 'model' (the model's own, under a 4D mask) or 'lantern' "
                             f"(ops.tree_attention), got {attention!r}")
        self.rules = rules
        self.tree_attention = attention == "lantern"
        self.model = rules.model  # what lantern's cost-model cache fingerprints
        row_end = rules.row_end_id is not None
        L = height * (width + 1) - 1 if row_end else height * width
        self.config = HFConfig(block_size=L, vocab_size=rules.n_codes + int(row_end), height=height, width=width,
                               row_end=row_end, family=rules.name)
        self.tok_embeddings = _ImageEmbedding(rules)
        self.output = _ImageHead(rules)
        if row_end:  # bool [V] each, True = masked: at a code's position the row end; at a row end every code
            at_row_end = torch.ones(self.config.vocab_size, dtype=torch.bool, device=rules.embedding_weight.device)
            at_row_end[-1] = False
            self._masked_at_code, self._masked_at_row_end = ~at_row_end, at_row_end
        attention = rules.attention_implementation
        if attention not in ATTENTION:
            raise ValueError(f"the model's attention implementation is {attention!r}; lantern.hf passes a 4D tree "
                             f"mask, which {ATTENTION} take: load the model with attn_implementation='sdpa'")
        self.cache: Optional[RowCache] = None
        self.cond_keys: Optional[torch.Tensor] = None
        self.next_pos: Optional[torch.Tensor] = None  # [rows] position id of image token 0
        self.pos_offset: Optional[torch.Tensor] = None  # [rows] next_pos - cond_keys

    # -- the Target protocol ------------------------------------------------------------------------

    @property
    def kv_cache(self) -> Optional[torch.Tensor]:
        return None if self.cache is None else self.cache.kv

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None) -> torch.Tensor:
        f = self.rules
        weight = f.embedding_weight
        self.cache = RowCache(f.n_layer, batch, f.kv_heads, max_len, f.head_dim, dtype or f.dtype,
                              device if device is not None else weight.device)
        self.cond_keys = torch.zeros(batch, dtype=torch.int64, device=weight.device)
        self.next_pos = torch.zeros(batch, dtype=torch.int64, device=weight.device)
        self.pos_offset = torch.zeros(batch, dtype=torch.int64, device=weight.device)
        return self.cache.kv

    def keep_cache_rows(self, rows: torch.Tensor) -> None:
        self.cache.kv = self.cache.kv.index_select(2, rows)
        self.cond_keys = self.cond_keys.index_select(0, rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        self.pos_offset = self.pos_offset.index_select(0, rows)

    def free_cache(self) -> None:
        self.cache = self.cond_keys = self.next_pos = self.pos_offset = None

    def double_for_cfg(self, cond: torch.Tensor) -> torch.Tensor:
        """[B, 2 (cond, uncond), 2, 1 + W] -> [2B, 2, 1 + W] (``encode_prompt`` built both halves)."""
        if cond.dim() != 4:
            raise ValueError("guidance needs the prompt encoded with guided=True (encode_prompt)")
        return torch.cat([cond[:, 0], cond[:, 1]])

    @torch.no_grad()
    def __call__(self, tokens=None, cond_idx=None, *, cache_len, positions=None, tree_mask=None,
                 return_hidden=False, emb_masks=None):
        """The Target forward (``target.Target``); inference only (no autograd)."""
        if emb_masks is not None:
            raise ValueError("emb_masks is LlamaGen's caption padding; a prompt's padding is in its attention_mask")
        if self.cache is None:
            raise RuntimeError("call setup_cache(batch, max_len) before the forward")
        if cond_idx is not None:
            if tokens is not None and tokens.shape[1] > 0:
                raise ValueError("the prefill takes the prompt alone (tokens=None)")
            hidden, structure = self._prefill(cond_idx), False  # it predicts position 0, a code
        else:
            hidden, structure = self._tree(tokens, cache_len, positions, tree_mask)
        logits = self._structure(self.rules.code_logits(hidden).float(), structure)  # self.output's, inlined
        return (logits, hidden) if return_hidden else logits

    forward = __call__

    # -- forwards -----------------------------------------------------------------------------------

    def _decoder(self, embeds, mask, position_ids, cache_len, n_keys) -> torch.Tensor:
        """The model's decoder over embeds [R, T, D] writing at cache_len -> last hidden states [R, T, D]."""
        self.cache.begin(cache_len, embeds.shape[1], n_keys, uniform=mask is None)
        if mask is not None and self.rules.attention_implementation == "eager":
            mask = additive(mask, embeds.dtype)
        return self.rules.decode(embeds, mask, position_ids, self.cache)

    def _prefill(self, cond: torch.Tensor) -> torch.Tensor:
        """cond [R, 2, 1 + W] (``encode_prompt``) -> hidden state of the last prompt token [R, 1, D]; the real
        tokens' K/V stay at positions 0..n_real - 1 of each row."""
        if cond.dim() != 3 or cond.shape[1] != 2:
            raise ValueError(f"the condition must be an encoded prompt [R, 2, 1 + W] (encode_prompt), got "
                             f"{list(cond.shape)}")
        R, W = cond.shape[0], cond.shape[2] - 1
        if W + 1 > self.cache.max_len:
            raise ValueError(f"the prompt's {W} positions exceed the cache's {self.cache.max_len}")
        ids, pos = cond[:, 0, 1:], cond[:, 1, 1:]  # [R, W]
        valid = ids >= 0
        embeds = self.rules.embed_text(ids.clamp(min=0))  # [R, W, D]
        zero = torch.zeros(R, dtype=torch.int64, device=ids.device)
        hidden = self._decoder(embeds, prompt_attention_mask(valid), pos, zero, W)
        n_real = valid.sum(1)  # [R]
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # real positions first, in order
        kept = torch.where(torch.arange(W, device=ids.device) < n_real[:, None], order, -1)
        ops.compact_kv(self.cache.kv, zero, kept, n_real)
        self.cond_keys[:R] = n_real
        self.next_pos[:R] = cond[:, 1, 0]
        self.pos_offset[:R] = self.next_pos[:R] - n_real  # position id - cache position of every image token
        return hidden[:, -1:]  # the last column holds each row's last real token (encode_prompt left-pads)

    def _tree(self, tokens, cache_len, positions, tree_mask) -> Tuple[torch.Tensor, Union[torch.Tensor, bool]]:
        """-> (hidden [R, T, D], what ``_structure`` needs: the nodes' raster positions [R, T], or for an AR step
        whose rows all predict a code (or all a row end) False (True), read with the forward's host read)."""
        R, T = tokens.shape
        if cache_len.shape != (R,) or cache_len.dtype != torch.int64:
            raise ValueError(f"cache_len must be int64 [{R}], got {cache_len.dtype} {list(cache_len.shape)}")
        chain = positions is None  # a chain after the committed tokens (the loops' AR steps, catch-ups)
        if chain:  # position ids follow the cache positions
            position_ids = (self.pos_offset[:R] + cache_len)[:, None]  # [R, 1]
            position_ids = position_ids + _arange(T, tokens.device) if T > 1 else position_ids
        else:
            position_ids = self.next_pos[:R, None] + positions
        if self.tree_attention or torch.compiler.is_compiling():
            forward = self._tree_fused if self.tree_attention else self._tree_traced
            structure = self._chain_positions(cache_len, T) if chain else positions
            return forward(tokens, cache_len, position_ids, tree_mask), structure
        if tree_mask is not None and _is_chain(tree_mask, T):
            tree_mask = None  # the chain's mask without unpacking the bits (Jacobi windows, chains)
        if chain and T == 1 and self.config.row_end:  # the one host read of a forward, and the rows' raster positions
            lengths, cond_keys = torch.stack([cache_len, self.cond_keys[:R]]).tolist()
            W1 = self.config.width + 1
            row_ends = {(n - c) % W1 == W1 - 2 for n, c in zip(lengths, cond_keys)}  # position + 1 is a row end
            structure = row_ends.pop() if len(row_ends) == 1 else self._chain_positions(cache_len, T)
        else:
            lengths = cache_len.tolist()  # the one host read of a forward
            structure = self._chain_positions(cache_len, T) if chain else positions
        shortest, longest = min(lengths), max(lengths)
        n_keys = longest + T  # the attention's key count
        if n_keys > self.cache.max_len:
            raise ValueError(f"cache_len + {T} nodes exceeds the cache's {self.cache.max_len} positions")
        if ops.checks.scan_values():
            ops.checks.in_range("tokens", tokens, 0, self.config.vocab_size)
        embeds = self.rules.embed_codes(tokens)  # [R, T, D]
        # one node per row and every row as long: it sees every key, and HF's own mask for it (None: SDPA without
        # a mask) is the cache's (``RowCache.get_mask_sizes``)
        mask = None if T == 1 and shortest == longest else tree_attention_mask(cache_len, tree_mask, T, n_keys)
        return self._decoder(embeds, mask, position_ids, cache_len, n_keys), structure

    def _chain_positions(self, cache_len: torch.Tensor, T: int) -> Optional[torch.Tensor]:
        """The raster positions [R, T] of a chain of T nodes after each row's committed tokens (None without row
        ends: nothing needs them)."""
        if not self.config.row_end:
            return None
        positions = (cache_len - self.cond_keys[: cache_len.shape[0]])[:, None]  # [R, 1]
        return positions + _arange(T, cache_len.device) if T > 1 else positions

    def _tree_traced(self, tokens, cache_len, position_ids, tree_mask) -> torch.Tensor:
        """The decoder as torch.compile traces it (``decoding/compiled.py``): no host read, so the attention reads
        the whole cache (n_keys = Lmax, a graph of one shape per node count) under the dense 4D mask, which
        hides the positions past each row's nodes. The cache has room for every node (the loops size it)."""
        T, n_keys = tokens.shape[1], self.cache.max_len
        embeds = self.rules.embed_codes(tokens)  # [R, T, D]
        mask = tree_attention_mask(cache_len, tree_mask, T, n_keys)  # [R, 1, T, Lmax]
        return self._decoder(embeds, mask, position_ids, cache_len, n_keys)

    def _tree_fused(self, tokens, cache_len, position_ids, tree_mask) -> torch.Tensor:
        """The decoder with ``ops.tree_attention`` as its attention (wrap(attention="lantern")): no dense mask,
        no host read; the attention reads the whole cache up to each row's cache_len + T."""
        R, T = tokens.shape
        if tree_mask is None:
            tree_mask = _chain(T, tokens.device).expand(R, -1, -1)
        if ops.checks.scan_values():
            ops.checks.in_range("tokens", tokens, 0, self.config.vocab_size)
        config = self.rules.decoder.config
        before, TreeStep.current = config._attn_implementation, (cache_len, tree_mask)
        config._attn_implementation = TREE_ATTENTION
        try:
            self.cache.begin(cache_len, T, self.cache.max_len)
            return self.rules.decode(self.rules.embed_codes(tokens), None, position_ids, self.cache)
        finally:
            config._attn_implementation, TreeStep.current = before, None

    def _structure(self, logits: torch.Tensor, positions: Union[torch.Tensor, bool]) -> torch.Tensor:
        """Masks the codes at row ends and the row end elsewhere (models with row ends). positions [R, T] the
        raster positions the logits' nodes hold (they predict position + 1); or a bool: every node predicts a
        row end (True) or every node a code (False)."""
        if not self.config.row_end:
            return logits
        if isinstance(positions, bool):
            if positions:
                logits[..., :-1] = MASKED
            else:
                logits[..., -1] = MASKED
            return logits
        W1 = self.config.width + 1
        predicts_row_end = positions % W1 == W1 - 2  # [R, T]: position + 1 is a row end
        masked = torch.where(predicts_row_end[..., None], self._masked_at_row_end, self._masked_at_code)  # [R, T, V]
        return logits.masked_fill_(masked, MASKED)

    # -- prompts, images ----------------------------------------------------------------------------

    def for_prompt(self, prompt: torch.Tensor) -> "HFTarget":
        """This target with ``config.cond_len`` = the encoded prompt's width (the loops size the cache by it)."""
        view = object.__new__(HFTarget)
        view.__dict__.update(self.__dict__)
        view.config = replace(self.config, cond_len=prompt.shape[-1] - 1)
        view.cache = view.cond_keys = view.next_pos = view.pos_offset = None
        return view

    def image_codes(self, sequence: torch.Tensor) -> torch.Tensor:
        """The loop's tokens [B, n] (n sequence positions) -> the image codes [B, n'] (row ends dropped)."""
        if not self.config.row_end:
            return sequence
        keep = torch.arange(sequence.shape[1], device=sequence.device) % (self.config.width + 1) != self.config.width
        return sequence[:, keep]

    def sequence_length(self, n_codes: int) -> int:
        """Sequence positions that hold the first n_codes image codes (their row ends included)."""
        return n_codes + (n_codes - 1) // self.config.width if self.config.row_end else n_codes

    def encode_prompt(self, input_ids, attention_mask=None, *, guided: bool = False, negative_prompt_ids=None,
                      negative_prompt_attention_mask=None) -> torch.Tensor:
        """The loop's condition for a batch of prompts (module docstring): [B, 2, 1 + W], or [B, 2, 2, 1 + W]
        with guided=True (the unconditional prompt by the model's rule, or the negative prompt)."""
        f = self.rules
        ids, valid = _checked_prompt("input_ids", input_ids, attention_mask)
        cond = _encode(ids, valid, f.cond_positions, f.forced_prefix(ids, valid))
        if not guided:
            return cond
        if negative_prompt_ids is not None:
            if not f.takes_negative_prompt:
                raise ValueError(f"{f.name}'s generate builds its unconditional prompt itself; "
                                 f"negative_prompt_ids does not apply")
            n_ids, n_valid = _checked_prompt("negative_prompt_ids", negative_prompt_ids,
                                             negative_prompt_attention_mask)
            if n_ids.shape[0] != ids.shape[0]:
                raise ValueError(f"negative_prompt_ids must have {ids.shape[0]} rows (one per prompt), got "
                                 f"{n_ids.shape[0]}")
        else:
            n_ids, n_valid = f.unconditional_prompt(ids, valid)
        uncond = _encode(n_ids, n_valid, f.uncond_positions, f.forced_prefix(n_ids, n_valid))
        width = max(cond.shape[-1], uncond.shape[-1])
        return torch.stack([_left_pad(cond, width), _left_pad(uncond, width)], 1)

    def neighbour_table(self, K: int, **kwargs) -> torch.Tensor:
        """int32 [V, K]: each code's K nearest codes in the model's own codebook (``lantern.neighbours``, cached
        on disk; L2-normalised where the model's decoder normalises its codebook), and the row end's row
        holding the row end alone, so that relaxation never trades it for a code."""
        from ..neighbours import neighbour_table

        f = self.rules
        return self.complete_table(neighbour_table(f.codebook(), K, normalize=f.normalize_codebook, **kwargs))

    def complete_table(self, table: torch.Tensor) -> torch.Tensor:
        """A neighbour table of the codes [n_codes, K] or of the loop's ids [V, K] -> [V, K] on the model's
        device (the row end's row: itself alone)."""
        n, V = self.rules.n_codes, self.config.vocab_size
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] not in (n, V):
            raise ValueError(f"neighbours must be a table [{n}, K] of the model's codes, got "
                             f"{list(getattr(table, 'shape', [])) or type(table).__name__}")
        if table.shape[0] == n and n != V:
            table = torch.cat([table, torch.full((1, table.shape[1]), n, dtype=table.dtype, device=table.device)])
        return table.to(self.tok_embeddings.weight.device)

    def decode_images(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, H W] -> images [B, 3, h, w] in [-1, 1] through the model's own VQ decoder."""
        return self.rules.decode_images(codes, self.config.height, self.config.width)

    def generate(self, input_ids, **kwargs):
        from .generate import generate

        return generate(self, input_ids, **kwargs)


_ARANGES: dict = {}  # (n, device) -> arange(n): the forwards' small index vectors, made once
_CHAINS: dict = {}  # (T, device) -> the packed ancestor bits of a chain of T nodes [T, ceil(T/32)]


def _arange(n: int, device) -> torch.Tensor:
    key = (n, device)
    if key not in _ARANGES:
        _ARANGES[key] = torch.arange(n, device=device)
    return _ARANGES[key]


def _chain(T: int, device) -> torch.Tensor:
    """The packed ancestor bits of a chain of T nodes [T, ceil(T/32)]."""
    key = (T, device)
    if key not in _CHAINS:
        _CHAINS[key] = pack_bits(torch.ones(T, T, dtype=torch.bool, device=device).tril())
    return _CHAINS[key]


def _is_chain(tree_mask: torch.Tensor, T: int) -> bool:
    """Whether every row's tree is the chain 0 <- 1 <- ... <- T-1 (one host read)."""
    chain = _chain(T, tree_mask.device)
    return tree_mask.shape[1:] == chain.shape and bool((tree_mask == chain).all())


def _checked_prompt(name: str, ids, mask) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P] int64, valid [B, P] bool); ValueError naming the argument otherwise."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or \
            ids.dtype.is_complex or ids.dtype == torch.bool or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} must be integer token ids [B, P] with B, P >= 1, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {list(getattr(ids, 'shape', []))}")
    if mask is None:
        valid = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    else:
        mask_name = "attention_mask" if name == "input_ids" else "negative_prompt_attention_mask"
        if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
            raise ValueError(f"{mask_name} must have {name}'s shape {list(ids.shape)}, got "
                             f"{list(getattr(mask, 'shape', [])) or type(mask).__name__}")
        if mask.dtype.is_floating_point or mask.dtype.is_complex or bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{mask_name} must hold 0 (padding) and 1 (a token)")
        valid = (mask != 0).to(ids.device)
    if not bool(valid.any(1).all()):
        raise ValueError(f"every row of {name} needs at least one token (its attention mask is all 0)")
    return ids.to(torch.int64), valid


def _encode(ids: torch.Tensor, valid: torch.Tensor, positions: str, prefix: torch.Tensor) -> torch.Tensor:
    """Prompt rows -> [B, 2, 1 + W]: the real tokens right-aligned (padding left, id -1), then ``prefix``
    [B, F] (-1: none) forced after them. Position ids: "real" counts the real tokens (HF's generate: the
    attention mask's cumsum - 1); "padded" is the column index (a custom generate that passes no position ids
    and so counts the padding)."""
    B, P = ids.shape
    col = torch.arange(P, device=ids.device).expand(B, P)
    pos = valid.cumsum(1) - 1 if positions == "real" else col
    after = valid.sum(1) if positions == "real" else torch.full((B,), P, device=ids.device)  # [B] next position
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)  # padding first, then the tokens in order
    ids = torch.where(valid, ids, -1).gather(1, order)
    pos = torch.where(valid, pos, 0).gather(1, order)
    has = prefix >= 0  # [B, F]
    prefix_pos = after[:, None] + has.cumsum(1) - 1
    ids = torch.cat([ids, prefix], 1)
    pos = torch.cat([pos, torch.where(has, prefix_pos, 0)], 1)
    # move each row's forced tokens next to its prompt (rows without one keep a -1 there): real ones last
    order = torch.argsort((ids >= 0).to(torch.int8), dim=1, stable=True)
    ids, pos = ids.gather(1, order), pos.gather(1, order)
    header = torch.stack([torch.full((B,), -1, device=ids.device), after + has.sum(1)], 1)[..., None]  # [B, 2, 1]
    return torch.cat([header, torch.stack([ids, pos], 1)], 2)


def _left_pad(encoded: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 2, 1 + W] -> [B, 2, width] with -1 ids (no token) inserted after the header."""
    pad = width - encoded.shape[-1]
    if pad == 0:
        return encoded
    B = encoded.shape[0]
    filler = torch.stack([torch.full((B, pad), -1), torch.zeros(B, pad, dtype=torch.int64)], 1).to(encoded.device)
    return torch.cat([encoded[..., :1], filler, encoded[..., 1:]], 2)
