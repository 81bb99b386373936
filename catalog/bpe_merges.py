"""The merges of a BPE vocabulary that llama.cpp can ever apply: the gateway's copy keeps only those.

llama.cpp's BPE (`llm_tokenizer_bpe_session` in `llama-vocab.cpp`) starts each pre-tokenized
word as its UTF-8 characters and merges, again and again, the adjacent pair of lowest rank (of
equal ranks, the leftmost), until no adjacent pair is a merge.

**Which merges can apply.** Say merge `a b` is applied somewhere: at that moment some span of a
word is exactly the two symbols `a` and `b`. Every merge that built them lay inside the span (a
merge across its edge would have taken part of it), and among those the lowest was always chosen
first, so they were the same merges, in the same order, as when the text `a+b` is merged on its
own. Merged on its own, `a+b` therefore reaches `[a, b]`, and its last merge is `a b`. So a merge
can apply in some text only if it is the last merge of its own text merged alone. A merge that
never applies is never the lowest pair present, so dropping it changes no tokenization of any
text (`catalog/tests/test_bpe_merges.py` checks this against llama.cpp on real vocabularies).

Vocabularies converted from tiktoken list every way of splitting each token in two: Llama 3 has
280,147 merges for 128,000 tokens, and llama.cpp keeps each one in a hash map of string pairs.
No Django, no llama.cpp: bytes in, bytes out.
"""

from __future__ import annotations

from collections.abc import Sequence

# llama.cpp's `unicode_len_utf8`: a UTF-8 sequence's length from its first byte's high nibble
# (a stray continuation byte counts as one character, as there).
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


def merges_applicable(merges: Sequence[bytes]) -> list[bytes]:
    """The entries of `merges` (each "left right", in rank order, as `tokenizer.ggml.merges`
    holds them) that llama.cpp can apply, in their order. Dropped: each merge that is not the
    last merge of its own text merged alone (see the module's docstring), and repeats of a pair
    (llama.cpp keeps a pair's first rank). An entry llama.cpp reads as no pair is kept as it is."""
    ranks: dict[tuple[bytes, bytes], int] = {}
    pairs: list[tuple[bytes, bytes] | None] = []
    for rank, entry in enumerate(merges):
        pair = _pair(entry)
        pairs.append(pair)
        if pair is not None:
            ranks.setdefault(pair, rank)
    last: dict[bytes, tuple[bytes, bytes] | None] = {}
    kept = []
    for rank, (entry, pair) in enumerate(zip(merges, pairs, strict=True)):
        if pair is None:
            kept.append(entry)
            continue
        if ranks[pair] != rank:
            continue  # a repeat: llama.cpp's map keeps the first
        text = pair[0] + pair[1]
        if text not in last:
            last[text] = _last_merge(text, ranks)
        if last[text] == pair:
            kept.append(entry)
    return kept


def _pair(entry: bytes) -> tuple[bytes, bytes] | None:
    """llama.cpp's reading of a merge: a C string (it ends at a NUL byte), split at the first
    space after the first byte."""
    entry = entry.split(b"\0", 1)[0]
    cut = entry.find(b" ", 1)
    return None if cut < 0 else (entry[:cut], entry[cut + 1 :])


def _last_merge(text: bytes, ranks: dict[tuple[bytes, bytes], int]) -> tuple[bytes, bytes] | None:
    """The last merge llama.cpp's BPE applies to `text` as a word on its own, when it merges the
    word into one symbol; None when it stops short of one."""
    symbols = _characters(text)
    while len(symbols) > 1:
        best, at = -1, -1
        for index in range(len(symbols) - 1):
            rank = ranks.get((symbols[index], symbols[index + 1]), -1)
            if rank >= 0 and (best < 0 or rank < best):  # strictly lower: the leftmost of equals
                best, at = rank, index
        if at < 0:
            return None
        if len(symbols) == 2:
            return symbols[0], symbols[1]
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    return None


def _characters(text: bytes) -> list[bytes]:
    """`text` cut where llama.cpp cuts a word into its first symbols."""
    symbols, offset = [], 0
    while offset < len(text):
        size = min(len(text) - offset, _UTF8_LEN[text[offset] >> 4])
        symbols.append(text[offset : offset + size])
        offset += size
    return symbols
