"""Admission: every decision made before a request is queued, in one place.

The model must exist and be of the right kind, the prompt is rendered exactly as the
host will see it and counted with the gateway's own tokenizer, it and max_tokens must
fit the context the model is sold with (`CatalogModel.context_sold`: for a chat model
never more than its audits can read, so no job is sold that could not be audited),
and then `request_submit` holds the worst-case price (402 / 429 before anything is
queued). The prompt's token ids, counted once, also key prompt caching (`marketplace.trust.prefixes`).
Refusals are DomainErrors; the views only render them.
"""

from __future__ import annotations

from datetime import datetime

from accounts.models import ApiKey
from catalog.models import CatalogModel
from catalog.rendering import prompt_fragments, prompt_token_ids, render_instant_fixed
from catalog.selectors import catalog_model_by_name
from catalog.tokenizer import tokenizer_for
from core.errors import DomainError, bad_request
from marketplace.models import Request
from marketplace.selectors import served_models
from marketplace.services import request_submit
from marketplace.trust.prefixes import block_hashes
from protocol.rendering import Fragment, TemplateRefused


def trusted_only(*, api_key: ApiKey, data: dict) -> bool:
    """Trusted hosts only: the key's setting, or this request's `provider.trusted_only`."""
    return api_key.trusted_only or bool((data.get("provider") or {}).get("trusted_only"))


def rendered_prompt(
    model: CatalogModel,
    kind: str,
    data: dict,
    *,
    now: datetime | None = None,
) -> tuple[list[Fragment], list | None, str | None]:
    """The prompt rendered exactly as the host's model will see it (its template told it is
    `now`), plus what the request stores. A conversation the model's template refuses, or
    one it cannot render within its bounds, is a 400 saying why."""
    messages, prompt = (data["messages"], None) if kind == Request.Kind.CHAT else (None, data["prompt"])
    try:
        return prompt_fragments(model, kind=kind, messages=messages, prompt=prompt, now=now), messages, prompt
    except TemplateRefused as refused:
        raise bad_request(f"{model.name}: {refused}", code="unsupported_conversation", param="messages") from None


def request_admit(*, api_key: ApiKey, data: dict, params: dict, kind: str, public_id: str) -> Request:
    """Admit a chat or completion request: model, prompt tokens, context, then the hold and the job.

    With fallbacks (`models`, OpenRouter's convention), the first model that has a host
    online serves (the first of all when none has); the rest stay in `params["fallbacks"]`,
    tried in order when the queue times out (`services.request_reroute`)."""
    names = list(dict.fromkeys([data["model"], *(data.get("models") or [])]))
    chosen = [model_for(name, kind=kind, param="model" if index == 0 else "models") for index, name in enumerate(names)]
    first = 0
    if len(chosen) > 1:  # (only fallbacks read who is online: admission's usual path stays as it was)
        online = {served.model.pk for served in served_models() if served.hosts_online}
        first = next((index for index, model in enumerate(chosen) if model.pk in online), 0)
    model = chosen[first]
    params = {**params, "fallbacks": [m.name for m in chosen[first + 1 :]]} if len(chosen) > 1 else params
    params, now = render_instant_fixed(params)  # every later rendering of this request's prompt is this one's
    fragments, messages, prompt = rendered_prompt(model, kind, data, now=now)
    token_ids = prompt_token_ids(model, fragments)  # counted, and the blocks prompt caching keys on
    prompt_tokens = len(token_ids)
    if prompt_tokens + params["max_tokens"] > model.context_sold:
        raise bad_request(
            f"This model's context is {model.context_sold} tokens; the prompt has {prompt_tokens} and max_tokens "
            f"asks for {params['max_tokens']}. Shorten the prompt or lower max_tokens.",
            code="context_length_exceeded",
            param="messages" if messages is not None else "prompt",
        )
    return request_submit(
        public_id=public_id,
        api_key=api_key,
        model=model,
        kind=kind,
        messages=messages,
        prompt=prompt,
        params=params,
        stream=data["stream"],
        prompt_tokens=prompt_tokens,
        trusted_only=trusted_only(api_key=api_key, data=data),
        prefix_hashes=block_hashes(model_id=model.pk, token_ids=token_ids),
    )


ENDPOINTS: dict[str, str] = {
    Request.Kind.CHAT: "/v1/chat/completions",
    Request.Kind.COMPLETION: "/v1/completions",
    Request.Kind.EMBEDDINGS: "/v1/embeddings",
}
KIND_NAMES: dict[str, str] = {
    CatalogModel.Kind.CHAT: "a chat model",
    CatalogModel.Kind.EMBEDDING: "an embeddings model",
}
SERVED_AT: dict[str, str] = {
    CatalogModel.Kind.CHAT: "POST /v1/chat/completions (or /v1/completions)",
    CatalogModel.Kind.EMBEDDING: "POST /v1/embeddings",
}


def model_for(name: str, *, kind: str, param: str = "model") -> CatalogModel:
    """The active model of that name that a request of `kind` runs on. None of that name is a 404;
    one of the other kind (listed by /v1/models all the same) is a 400 saying where it is served."""
    model = catalog_model_by_name(name=name)
    if model is None:
        raise DomainError(
            f"The model '{name}' does not exist; GET /v1/models lists them.",
            status=404,
            code="model_not_found",
            param=param,
        )
    wanted = CatalogModel.Kind.EMBEDDING if kind == Request.Kind.EMBEDDINGS else CatalogModel.Kind.CHAT
    if model.kind != wanted:
        raise bad_request(
            f"The model '{name}' is {KIND_NAMES[model.kind]}: send "
            f"it to {SERVED_AT[model.kind]}. {ENDPOINTS[kind]} takes "
            f"{KIND_NAMES[wanted]} (GET /v1/models gives each model's kind).",
            code="wrong_model_kind",
            param=param,
        )
    return model


def embeddings_admit(*, api_key: ApiKey, data: dict, public_id: str) -> Request:
    """Admit an embeddings request: every input fits the context; all their tokens are held."""
    model = model_for(data["model"], kind=Request.Kind.EMBEDDINGS)
    tokenizer = tokenizer_for(model.tokenizer)
    prompt_tokens = 0
    for index, text in enumerate(data["input"]):
        if tokenizer.count(text, special=True) > model.context_length:
            raise bad_request(
                f"Input {index} is longer than this model's {model.context_length}-token context; split it.",
                code="context_length_exceeded",
                param=f"input[{index}]",
            )
        prompt_tokens += tokenizer.count(text, special=False)
    return request_submit(
        public_id=public_id,
        api_key=api_key,
        model=model,
        kind=Request.Kind.EMBEDDINGS,
        messages=None,
        prompt=None,
        params={"max_tokens": 0},
        stream=False,
        prompt_tokens=prompt_tokens,
        inputs=data["input"],
        trusted_only=trusted_only(api_key=api_key, data=data),
    )
