"""Writes to the catalog."""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from catalog.gguf_file import GgufFacts, GgufUnreadable, gguf_facts, gguf_vocab_copy
from catalog.models import CatalogModel
from catalog.money import usd_per_million_to_ucents
from catalog.tokenizer import GGUF_SPEC, tokenizer_for
from core.errors import DomainError
from protocol.catalog import AUDITABLE_CONTEXT_TOKENS, file_sha256
from protocol.rendering import ChatFormat, TemplateRefused, chat_format_read

VOCAB_DIR = "catalog"  # under VAR_DIR: the vocabulary-only copies the gateway counts tokens with
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,99}")


class CatalogAddRefused(DomainError):
    """A model that cannot enter the catalog as asked; the message says why, in one line."""

    code = "catalog_add_refused"


def catalog_model_add(
    *,
    path: Path,
    name: str,
    input_price: str,
    output_price: str,
    template_path: Path | None = None,
    context_length: int | None = None,
) -> CatalogModel:
    """Add a chat model from its own GGUF: its facts read from the file, the file pinned by
    sha256, a vocabulary-only copy kept under VAR_DIR for counting. Prices are USD per million
    tokens as typed. The context sold is the file's own, at most AUDITABLE_CONTEXT_TOKENS (what
    mahout's runner and every audit's verifier read: a longer job could not be audited, so it is
    not sold); `context_length` caps it lower. Refuses (CatalogAddRefused) with nothing written: a
    bad price or name, a file that is not a GGUF model, no chat template, a context past either
    bound, a name or file already in the catalog. What the file alone decides is checked before
    the database is asked."""
    prices = {"input_price_ucents": _price(input_price, "input"), "output_price_ucents": _price(output_price, "output")}
    if not _NAME.fullmatch(name):
        raise CatalogAddRefused(
            f"{name!r} is not a model name: 1-100 letters, digits and . _ : / + -, starting with a letter or digit"
        )
    template = _template_read(template_path)
    facts = _facts(path)
    template = template or facts.chat_template
    if not template:
        raise CatalogAddRefused(
            f"{path} has no chat template (tokenizer.chat_template); supply one with --template FILE"
        )
    most = min(facts.context_length, AUDITABLE_CONTEXT_TOKENS)
    if context_length is not None and not 0 < context_length <= most:
        raise CatalogAddRefused(
            f"--context-length {context_length} is not within 1 and {most} tokens (the file's own "
            f"context is {facts.context_length}; audits and hosts read at most {AUDITABLE_CONTEXT_TOKENS})"
        )
    if CatalogModel.objects.filter(name=name).exists():
        raise CatalogAddRefused(f"{name} is already in the catalog")
    sha256 = file_sha256(path)
    already = CatalogModel.objects.filter(sha256=sha256).first()
    if already is not None:
        raise CatalogAddRefused(f"{path} is already in the catalog as {already.name} (sha256 {sha256})")
    return _entry_create(
        path=path,
        name=name,
        facts=facts,
        template=template,
        sha256=sha256,
        fields={**prices, "context_length": context_length or most},
    )


def _price(amount: str, which: str) -> int:
    try:
        return usd_per_million_to_ucents(amount)
    except ValueError as error:
        raise CatalogAddRefused(f"bad {which} price: {error}") from None


def _template_read(template_path: Path | None) -> str:
    if template_path is None:
        return ""
    try:
        template = template_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CatalogAddRefused(f"cannot read the template {template_path}: {error}") from None
    if not template.strip():
        raise CatalogAddRefused(f"the template {template_path} is empty")
    return template


def _facts(path: Path) -> GgufFacts:
    if not path.is_file():
        raise CatalogAddRefused(f"{path}: no such file")
    try:
        return gguf_facts(path)
    except GgufUnreadable as error:
        raise CatalogAddRefused(str(error)) from None
    except OSError as error:
        raise CatalogAddRefused(f"cannot read {path}: {error}") from None


def _entry_create(
    *, path: Path, name: str, facts: GgufFacts, template: str, sha256: str, fields: dict[str, int]
) -> CatalogModel:
    """The vocabulary copy first, then the row; if the row cannot be written (another add of the
    same name got there first), the copy goes too, unless an entry holds it.

    Copies are named by the vocabulary, not the file: entries whose files tokenize alike (two
    quantisations of one model: one vocabulary, one name, `gguf_file._vocabulary_sha256`) share
    one copy, so a gateway process loads that vocabulary once for all of them (Llama 3's costs
    about 36 MB in llama.cpp), and every process that loads a copy counts as every other does."""
    relative = Path(VOCAB_DIR) / f"vocab-{facts.vocabulary_sha256}.gguf"
    spec = f"{GGUF_SPEC}{relative}"
    copy = settings.VAR_DIR / relative
    copy.parent.mkdir(parents=True, exist_ok=True)
    if not copy.is_file():  # written whole or not at all (a rename), so one that is there is complete
        gguf_vocab_copy(path, facts, copy)
    try:
        fmt, longest = _format(spec, facts, template)
        with transaction.atomic():
            return CatalogModel.objects.create(
                name=name,
                kind=CatalogModel.Kind.CHAT,
                **fields,
                tokenizer=spec,
                sha256=sha256,
                quantization=facts.quantization,
                architecture=facts.architecture,
                chat_template=template,
                bos_text=fmt.bos_token,
                eos_text=fmt.eos_token,
                adds_bos=fmt.adds_bos,
                control_tokens=list(fmt.controls),
                end_of_turn=list(fmt.end_of_turn),
                longest_token_chars=longest,
                bos_token_id=facts.bos_token_id,
                eos_token_id=facts.eos_token_id,
                eot_token_id=facts.eot_token_id,
                vocab_size=facts.vocab_size,
                n_layers=facts.n_layers,
                n_experts=facts.n_experts,
                file_size=facts.file_size,
                weights_path=str(path.resolve()),
            )
    except BaseException as error:
        if not CatalogModel.objects.filter(tokenizer=spec).exists():  # an entry sharing the vocabulary keeps its copy
            copy.unlink(missing_ok=True)
        if isinstance(error, IntegrityError):
            raise CatalogAddRefused(f"{name} was added to the catalog meanwhile") from None
        if isinstance(error, TemplateRefused):
            raise CatalogAddRefused(f"the chat template cannot be used: {error}") from None
        raise


def _format(spec: str, facts: GgufFacts, template: str) -> tuple[ChatFormat, int]:
    """How the model is fed a chat, from its vocabulary (whether it starts prompts with BOS:
    llama.cpp's own answer, read from the copy) and its template; and its longest token, read
    once here rather than by each gateway process' first request. The copy's tokenizer is the
    one this process will count with (`tokenizer_for`'s cache)."""
    vocabulary = tokenizer_for(spec)
    adds_bos = vocabulary.count("", special=True) == 1
    fmt = chat_format_read(
        template=template,
        bos_token=facts.bos_text,
        eos_token=facts.eos_text,
        adds_bos=adds_bos,
        vocabulary_controls=facts.controls,
    )
    return fmt, vocabulary.longest_token_chars()
